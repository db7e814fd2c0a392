"""``durable-trio runs | jobs | queues``: the operator's commands, on :mod:`durable_trio._ops`.

Each opens the backend and the namespace's run store only (no worker, no engine), prints a
table (or ``--json`` for scripts) and exits: 0 on success, 1 when the thing asked for was not
there to change (``runs cancel`` of an ended run, ``jobs requeue`` of an unknown job), 2 on a
user error (one line on stderr).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
from typing import TYPE_CHECKING, Any

import trio

from .._errors import ConfigError, PayloadError
from .._redact import url_scheme
from .._terminal import visible
from ._bulk import add_bulk_arguments, add_tag_argument, by_id_or_filter, tags_of

if TYPE_CHECKING:
    import argparse
    from collections.abc import Awaitable, Callable

    from .._ops import Operations, StepView

__all__ = ["add_ops_commands", "resolve_namespace", "table"]

DEFAULT_BACKEND = "sqlite:///.durable/demo.db"


def resolve_namespace(namespace: str | None, app: str | None = None) -> str | None:
    """The namespace a command operates: ``--namespace``, else ``$DURABLE_TRIO_NAMESPACE``,
    else the name of the ``--app MODULE:app`` (what ``worker`` and ``engine`` use by
    default), else ``None`` (``"durable"``).

    Raises:
        ConfigError: ``--app`` names no App, or ``--namespace ''`` (it read as no namespace:
            the default's runs, not an error).
    """
    from ._engine import check_namespace_option

    if check_namespace_option(namespace) is not None:
        return namespace
    configured = os.environ.get("DURABLE_TRIO_NAMESPACE")
    if configured:
        return configured
    if app:
        from ._engine import load_app

        return load_app(app).name
    return None


def operator_backend(url: str | None, command: str) -> str:
    """The backend URL an operator's command reads (``--backend``, else
    ``$DURABLE_TRIO_BACKEND``, else the embedded SQLite file).

    Raises:
        ConfigError: a ``memory://`` URL: the command would open a store of its own process,
            empty, and print "no runs" (or "no live workers") whatever the workers and engines
            hold.
    """
    chosen = url or os.environ.get("DURABLE_TRIO_BACKEND") or DEFAULT_BACKEND
    if url_scheme(chosen) == "memory":  # (as open_backend reads the scheme)
        raise ConfigError(
            f"{command}: memory:// is a store of one process, empty in this one: it holds no "
            "other process's runs, jobs or workers; give the URL the workers and engines use "
            "(--backend sqlite:///... or redis://..., or $DURABLE_TRIO_BACKEND)"
        )
    return chosen


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain left-aligned table, every cell made :func:`~durable_trio._terminal.visible`
    (a cell holds stored strings: a control character in one must not reach the terminal)."""
    every = [[visible(cell) for cell in row] for row in (headers, *rows)]
    widths = [max(len(row[i]) for row in every) for i in range(len(headers))]
    return "".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n"
        for row in every
    )


def _time(value: float | None) -> str:
    if value is None:
        return "—"
    if value > 1e9:  # a Unix time (SQLite, Redis); memory:// counts trio's clock
        try:
            moment = datetime.datetime.fromtimestamp(value, datetime.UTC)
        except (OverflowError, ValueError, OSError):  # no time a calendar has (damaged)
            return f"{value} (not a time)"
        return moment.strftime("%Y-%m-%d %H:%M:%S UTC")  # the zone said: no reader guesses it
    return f"{value:.3f}"


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f} s"


def _when(text: str | None) -> float | None:
    """``--since`` / ``--until``: Unix seconds or an ISO 8601 time (UTC unless it says)."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"not a time (Unix seconds or ISO 8601): {text!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def _short(value: Any, width: int = 60) -> str:
    text = visible(json.dumps(value, default=str) if not isinstance(value, str) else value)
    return text if len(text) <= width else text[: width - 1] + "…"


def _error_line(error: Any) -> str:
    """An attempt's error as a short line: its message, then its code (unless the message
    starts with it, as a raised exception's does)."""
    if error is None:
        return ""
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        message, code = error["message"], error.get("code")
        if isinstance(code, str) and not message.startswith(code):
            message += f" [{code}]"
        return _short(message, 60)
    return _short(error, 60)


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


# -- commands ---------------------------------------------------------------------------------


async def _runs_list(ops: Operations, args: argparse.Namespace) -> int:
    page = await ops.list_runs(
        status=args.status,
        workflow=args.workflow,
        tenant=args.tenant,
        since=_when(args.since),
        until=_when(args.until),
        limit=args.limit,
        cursor=args.cursor,
        tags=tags_of(args),
    )
    from .._ops import run_to_json

    if args.json:
        damaged = [{"runId": d.run_id, "reason": d.reason} for d in page.damaged]
        _print_json(
            {"runs": [run_to_json(r) for r in page.runs], "nextCursor": page.next_cursor}
            | ({"damaged": damaged} if damaged else {})
        )
        return 0
    if not page.runs and not page.damaged:
        print("no runs")
    elif page.runs:
        rows = [
            [r.run_id, r.workflow, r.status.value, _time(r.created_at), _time(r.updated_at),
             r.owner or "—"]
            for r in page.runs
        ]  # fmt: skip
        print(table(["run", "workflow", "status", "created", "updated", "owner"], rows), end="")
    if page.damaged:
        # A row that cannot be read is named, never fails the listing (runs show names it too).
        rows = [[d.run_id, d.reason[:119] + "…" if len(d.reason) > 120 else d.reason]
                for d in page.damaged]  # fmt: skip
        print(f"{len(page.damaged)} damaged (unreadable) run row(s):")
        print(table(["run", "damaged"], rows), end="")
    if page.next_cursor:
        print(f"more: --cursor {visible(page.next_cursor)}")
    return 0


async def _runs_show(ops: Operations, args: argparse.Namespace) -> int:
    details = await ops.show_run(args.run_id, generation=args.generation)
    if args.json:
        data = details.to_json()
        events = await ops.run_events(args.run_id)
        if events:  # issue 18: the run's latest ctx.set_event values
            data["events"] = events
        _print_json(data)
        return 0
    run = details.run
    print(f"run {visible(run.run_id)}  workflow {visible(run.workflow)}  status {run.status.value}")
    owner = visible(run.owner or "—")
    print(f"created {_time(run.created_at)}  updated {_time(run.updated_at)}  owner {owner}")
    print(f"input  {_short(run.input)}")
    if details.generation or details.previous:  # continue-as-new (issue 34)
        previous = " ".join(map(str, details.previous)) or "—"
        if details.previous and details.generation <= max(details.previous):
            current = max(details.previous) + 1  # (showing an earlier one: --generation)
            print(f"generation {details.generation} (an earlier one; the run's current is "
                  f"{current})  previous kept {previous}")  # fmt: skip
        else:
            print(f"generation {details.generation}  previous {previous}")
    if run.parent is not None:
        print(f"parent {visible(run.parent)}")
    if run.tags:  # issue 34
        print(f"tags   {visible(' '.join(f'{k}={v}' for k, v in run.tags.items()))}")
    if details.children:
        print(f"children {visible(' '.join(details.children))}")
    if run.output is not None:
        print(f"output {_short(run.output)}")
    if run.error is not None:
        print(f"error  {_short(run.error, 200)}")
    if run.status.value == "blocked" and isinstance(run.error, dict):
        # The diff a deploy must fix (docs/engine.md, Versioning).
        at = run.error.get("stepId") or "end"
        print(
            visible(
                f"blocked at step {at}: history holds {run.error.get('expected')}, "
                f"the code called {run.error.get('found') or 'nothing more'}"
            )
        )
    rows = []
    notes = []
    marks = []
    for step in details.steps:
        if step.cancel_mark:  # an event of the run, not a step that ran
            marks.append(step)
            continue
        for attempt in step.attempts:
            rows.append(
                [step.step_id, step.kind.value, step.name, str(attempt.attempt), attempt.status,
                 _time(attempt.started_at), _time(attempt.ended_at), _seconds(attempt.duration),
                 attempt.worker or "—", _error_line(attempt.error),
                 _time(attempt.heartbeat.get("at")) if isinstance(attempt.heartbeat, dict)
                 else ""]
            )  # fmt: skip
        notes += [f"note: step {step.step_id} ({step.name}): {note}" for note in step.notes]
    if rows:
        print()
        headers = ["step", "kind", "name", "attempt", "status", "started", "ended", "took",
                   "worker", "error", "last beat"]  # fmt: skip
        print(table(headers, rows), end="")
    for note in notes:
        print(visible(note))
    for mark in marks:
        print(visible(_cancel_line(mark)))
    if details.timers:
        print()
        timer_rows = [[t.step_id, _time(t.wake_at), t.state] for t in details.timers]
        print(table(["timer", "wakes at", "state"], timer_rows), end="")
    events = await ops.run_events(args.run_id)
    if events:
        print()
        print(table(["event", "value"], [[k, _short(v)] for k, v in events.items()]), end="")
    return 0


def _cancel_line(mark: StepView) -> str:
    """The cancel mark of a run's history as one line: when, why, which steps it interrupted."""
    data = mark.output if isinstance(mark.output, dict) else {}
    reason = data.get("reason", mark.output)
    steps = data.get("interrupted") or []
    cut = f", interrupting step {', '.join(str(s) for s in steps)}" if steps else ""
    return f"cancel requested {_time(mark.created_at)}: {_short(reason, 200)}{cut}"


async def _runs_signal(ops: Operations, args: argparse.Namespace) -> int:
    from .._json_values import parse_json_argument

    try:
        payload = None
        if args.payload is not None:
            payload = parse_json_argument(args.payload, "PAYLOAD-JSON")
    except PayloadError as exc:  # not JSON, or nested too deep: one line, not a traceback
        print(visible(f"error: {exc}"), file=sys.stderr)
        return 2
    seq = await ops.signal_run(args.run_id, args.name, payload)
    if args.json:
        _print_json({"runId": args.run_id, "name": args.name, "seq": seq})
    else:
        print(f"signal {args.name!r} #{seq} sent to run {visible(args.run_id)}")
    return 0


async def _runs_cancel(ops: Operations, args: argparse.Namespace) -> int:
    from .._arguments import check_seconds
    from .._ops import CANCEL_GRACE

    # -1 or nan must not pass for "0: no compensation" (issue 36): one line, exit status 2.
    grace = CANCEL_GRACE
    if args.grace is not None:
        grace = check_seconds(args.grace, "runs cancel", "--grace")
    cancelled = await ops.cancel_run(
        args.run_id, reason=args.reason, grace=grace, wait=not args.no_wait
    )
    run = await ops.store.get_run(args.run_id)
    ended = run is not None and run.status.terminal
    if args.json:
        _print_json({"runId": args.run_id, "cancelled": cancelled, "ended": ended})
    elif not cancelled:
        print(f"run {visible(args.run_id)} had already ended or is being cancelled")
    elif ended:
        print(f"run {visible(args.run_id)} cancelled")
    else:
        print(f"run {visible(args.run_id)}: cancel sent to the engine driving it")
    return 0 if cancelled else 1


async def _runs_retry(ops: Operations, args: argparse.Namespace) -> int:
    run = await ops.retry_run(args.run_id)
    if args.json:
        _print_json({"runId": run.run_id, "status": run.status.value})
    else:
        print(f"run {visible(run.run_id)} reopened ({run.status.value}): a live engine resumes it")
    return 0


def duration(text: str) -> float:
    """``--older-than``: seconds, or a number with a unit (``30s``, ``15m``, ``12h``, ``7d``,
    ``2w``).

    Raises:
        ConfigError: not a duration > 0.
    """
    units = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0, "w": 604_800.0}
    number, unit = text.strip(), 1.0
    if number[-1:].lower() in units:
        number, unit = number[:-1], units[number[-1].lower()]
    try:
        seconds = float(number) * unit
    except ValueError:
        seconds = math.nan
    if not (0 < seconds < math.inf):
        raise ConfigError(
            "--older-than: not a duration > 0 (seconds, or 30s, 15m, 12h, 7d, 2w): "
            f"{visible(text)!r}"
        )
    return seconds


def _gens(count: int) -> str:
    """The previous generations a prune deleted (continue-as-new), if any."""
    if not count:
        return ""
    return f", and {count} previous generation{'' if count == 1 else 's'} (continue-as-new)"


def _finished(count: int) -> str:
    """``1 finished run``, ``2 finished runs``."""
    return f"{count} finished run{'' if count == 1 else 's'}"


async def _runs_prune(ops: Operations, args: argparse.Namespace) -> int:
    older_than = duration(args.older_than)
    which = "" if args.workflow is None else f" of workflow {visible(args.workflow)}"
    if not args.dry_run and not args.yes:
        preview = await ops.prune_runs(older_than, workflow=args.workflow, dry_run=True)
        if not sys.stdin.isatty():
            raise ConfigError(
                f"runs prune would delete up to {_finished(preview.count)}"
                f"{_gens(preview.generations)}: pass --yes (or --dry-run)"
            )
        answer = await trio.to_thread.run_sync(
            input,
            f"delete up to {_finished(preview.count)}{which} that ended before "
            f"{_time(preview.ended_before)}, with their history"
            f"{_gens(preview.generations)}? [y/N] ",
        )
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return 1
    report = await ops.prune_runs(older_than, workflow=args.workflow, dry_run=args.dry_run)
    if args.json:
        _print_json(report.to_json() | {"olderThan": older_than, "workflow": args.workflow})
    elif args.dry_run:
        print(
            f"would delete {_finished(report.count)}{which} that ended before "
            f"{_time(report.ended_before)}{_gens(report.generations)} (dry run: nothing deleted)"
        )
    else:
        print(
            f"deleted {_finished(report.count)}{which} that ended before "
            f"{_time(report.ended_before)}{_gens(report.generations)}"
        )
    return 0


async def _jobs_failed(ops: Operations, args: argparse.Namespace) -> int:
    jobs = await ops.failed_jobs(args.queue, limit=args.limit)
    if args.json:
        _print_json([j.to_json() for j in jobs])
        return 0
    if not jobs:
        print("no failed jobs")
        return 0
    rows = [
        [j.queue, j.job.id, _time(j.job.failed_at), str(j.job.attempts),
         str(j.job.stalled_count), _short(j.job.error, 60),
         # A job of an ended run is its evidence, not a live failure: say whose it is.
         "—" if j.run_status is None else f"{j.run_id} ({j.run_status})"]
        for j in jobs
    ]  # fmt: skip
    headers = ["queue", "job", "failed at", "attempts", "stalls", "error", "run"]
    print(table(headers, rows), end="")
    return 0


async def _jobs_requeue(ops: Operations, args: argparse.Namespace) -> int:
    done = await ops.requeue_job(args.queue, args.job_id)
    if args.json:
        _print_json({"queue": args.queue, "jobId": args.job_id, "requeued": done})
    else:
        outcome = "requeued" if done else f"is not failed on {visible(args.queue)}"
        print(f"job {visible(args.job_id)} {outcome}")
    return 0 if done else 1


async def _jobs_delete(ops: Operations, args: argparse.Namespace) -> int:
    done = await ops.delete_job(args.queue, args.job_id)
    if args.json:
        _print_json({"queue": args.queue, "jobId": args.job_id, "deleted": done})
    else:
        outcome = "deleted" if done else f"is not failed on {visible(args.queue)}"
        print(f"job {visible(args.job_id)} {outcome}")
    return 0 if done else 1


async def _queues(ops: Operations, args: argparse.Namespace) -> int:
    views = await ops.queues()
    if args.json:
        _print_json([v.to_json() for v in views])
        return 0
    if not views:
        print(f"no queues in namespace {ops.names.prefix!r}")
        return 0

    def count(value: int | None) -> str:
        return "—" if value is None else str(value)

    rows = [
        [v.queue, str(v.ready), count(v.delayed), count(v.claimed), count(v.failed),
         str(v.live_workers), _seconds(v.oldest_ready_age)]
        for v in views
    ]  # fmt: skip
    headers = ["queue", "ready", "delayed", "claimed", "failed", "workers", "oldest ready"]
    if any(v.limit is not None for v in views):
        # Fleet-wide limits (issue 33): the column only where one is set. In use: "claimed";
        # waiting: "ready".
        headers.append("limit")
        for row, v in zip(rows, views, strict=True):
            row.append(limit_text(v.limit, v.per_key))
    if any(v.rate is not None for v in views):
        # Rate limits: this window's starts / the rate (issue 33).
        headers.append("rate (window)")
        for row, v in zip(rows, views, strict=True):
            row.append(v.rate_text)
    print(table(headers, rows), end="")
    return 0


def limit_text(limit: int | None, per_key: bool) -> str:
    """A queue's fleet-wide limit as the tables show it (``2``, ``1 per key``, ``—``)."""
    if limit is None:
        return "—"
    return f"{limit} per key" if per_key else str(limit)


def _runner(
    command: Callable[[Operations, argparse.Namespace], Awaitable[int]],
    *,
    reads_only: bool = False,
) -> Callable[[argparse.Namespace], int]:
    """The command's ``func``; ``reads_only``: it changes nothing, so a SQLite file this
    process cannot write is opened read-only instead of refused."""

    def run(args: argparse.Namespace) -> int:
        from .._ops import open_operations
        from ._engine import run_reporting_errors

        async def main() -> int:
            namespace = resolve_namespace(args.namespace, args.app)
            url = operator_backend(args.backend, _command_name(args))
            async with open_operations(
                url,
                namespace=namespace,
                existing=True,
                discover=True,
                read_only="if_needed" if reads_only else False,
            ) as ops:
                return await command(ops, args)

        try:
            return run_reporting_errors(lambda: trio.run(main))
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130

    return run


def _command_name(args: argparse.Namespace) -> str:
    """``runs list``, ``jobs failed``, ``queues``, ``schedules add``: the command given."""
    for group in ("runs", "jobs", "schedules"):
        sub = getattr(args, f"{group}_command", None)
        if sub is not None:
            return f"{group} {sub}"
    return getattr(args, "command", None) or "queues"


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", help=f"backend URL (default: $DURABLE_TRIO_BACKEND or {DEFAULT_BACKEND})"
    )
    parser.add_argument(
        "--namespace",
        help="the namespace (default: $DURABLE_TRIO_NAMESPACE, else --app's name, else the "
        "backend's only one; none yet: durable)",
    )
    parser.add_argument(
        "--app", metavar="MODULE:app", help="take the namespace from this App (as worker/engine)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON (for scripts)")


def add_ops_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``runs``, ``jobs`` and ``queues`` to ``durable-trio``'s sub-commands."""
    runs = subparsers.add_parser("runs", help="list, show, cancel, retry or prune workflow runs")
    runs_commands = runs.add_subparsers(dest="runs_command", required=True)
    listing = runs_commands.add_parser("list", help="runs, newest first, a page at a time")
    _common(listing)
    listing.add_argument(
        "--status", help="pending, running, completed, failed, cancelled or blocked"
    )
    listing.add_argument("--workflow", help="only runs of this workflow")
    listing.add_argument("--tenant", help="only runs a tenant pod started")
    listing.add_argument("--since", help="created at or after (Unix seconds or ISO 8601)")
    listing.add_argument("--until", help="created before (Unix seconds or ISO 8601)")
    add_tag_argument(listing)
    listing.add_argument("--limit", type=int, default=50, help="runs per page (50)")
    listing.add_argument("--cursor", help="the next page (printed after a full page)")
    listing.set_defaults(func=_runner(_runs_list, reads_only=True))
    handlers: tuple[tuple[str, str, Callable[[Operations, argparse.Namespace], Awaitable[int]]],
                    ...] = (
        ("show", "a run and its history timeline", _runs_show),
        ("cancel", "cancel a run, or every run the filters match", _runs_cancel),
        ("retry", "resume a failed run (or each the filters match) from its failed step",
         _runs_retry),
    )  # fmt: skip
    for name, helptext, handler in handlers:
        sub = runs_commands.add_parser(name, help=helptext)
        _common(sub)
        if name == "show":
            sub.add_argument("run_id", metavar="RUN_ID")
            sub.add_argument(
                "--generation", type=int, default=None, metavar="N",
                help="a previous generation's history (continue-as-new)",
            )  # fmt: skip
        else:  # issue 34: or every run the filters match
            sub.add_argument("run_id", metavar="RUN_ID", nargs="?", default=None)
            add_bulk_arguments(sub, name)
            handler = by_id_or_filter(handler, name, _when)
        if name == "cancel":
            sub.add_argument("--reason", default="cancelled by an operator")
            sub.add_argument(
                "--grace",
                type=float,
                default=None,
                metavar="SECONDS",
                help="wait this long (plus what is left of the run's lease) for the engine "
                "driving it to deliver RunCancelled and compensate, then settle it (default "
                "30, the engine's cancel_grace; 0: settle it at once, without compensation)",
            )
            sub.add_argument(
                "--no-wait",
                action="store_true",
                help="return once the cancel is sent to the engine driving the run",
            )
        sub.set_defaults(func=_runner(handler, reads_only=name == "show"))

    signal = runs_commands.add_parser("signal", help="send a signal to a run (ctx.wait_signal)")
    _common(signal)
    signal.add_argument("run_id", metavar="RUN_ID")
    signal.add_argument("name", metavar="NAME")
    signal.add_argument("payload", metavar="PAYLOAD-JSON", nargs="?", default=None)
    signal.set_defaults(func=_runner(_runs_signal))

    prune = runs_commands.add_parser(
        "prune",
        help="delete finished runs that ended longer ago than --older-than, and the previous "
        "generations (continue-as-new) of any run that did",
    )
    _common(prune)
    prune.add_argument(
        "--older-than",
        required=True,
        metavar="DURATION",
        help="since their end: seconds, or 30s, 15m, 12h, 7d, 2w",
    )
    prune.add_argument("--workflow", help="only runs of this workflow")
    prune.add_argument("--dry-run", action="store_true", help="count them, delete nothing")
    prune.add_argument("--yes", action="store_true", help="do not ask before deleting")
    prune.set_defaults(func=_runner(_runs_prune))

    jobs = subparsers.add_parser("jobs", help="inspect, requeue or delete set-aside jobs")
    jobs_commands = jobs.add_subparsers(dest="jobs_command", required=True)
    failed = jobs_commands.add_parser("failed", help="set-aside jobs with their evidence")
    _common(failed)
    failed.add_argument("--queue", help="one queue (default: every queue of the namespace)")
    failed.add_argument("--limit", type=int, default=100, help="at most this many (100)")
    failed.set_defaults(func=_runner(_jobs_failed, reads_only=True))
    for name, helptext, handler in (
        ("requeue", "put a failed job back as pending, its counters reset", _jobs_requeue),
        ("delete", "remove a failed job for good", _jobs_delete),
    ):
        sub = jobs_commands.add_parser(name, help=helptext)
        _common(sub)
        sub.add_argument("queue", metavar="QUEUE")
        sub.add_argument("job_id", metavar="JOB_ID")
        sub.set_defaults(func=_runner(handler))

    queues = subparsers.add_parser("queues", help="every queue's depth, claims and failures")
    _common(queues)
    queues.set_defaults(func=_runner(_queues, reads_only=True))
