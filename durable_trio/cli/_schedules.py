"""``durable-trio schedules list | add | pause | resume | delete | backfill``: a namespace's
schedules.

Each opens the backend and the namespace's run store only (as ``runs``), changes or prints the
stored schedules and exits: 0 on success, 1 when the schedule named is not there (or ``add``
finds the name taken), 2 on a user error (one line on stderr). The engines of the namespace see
a change within their ``schedule_recheck`` (5 s by default).

Without ``--app``, ``add`` and ``list`` check a schedule's workflow against the workflows the
namespace's live engines advertise (their keys, ``_engine._advert``): ``add`` refuses one no
live engine runs (``--force`` adds it anyway) and warns when no engine is live to ask;
``list`` marks it ``unknown workflow``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any

import trio

from .._naming import DEFAULT_NAMESPACE
from .._terminal import visible
from ._operations import (
    _common,
    _time,
    _when,
    operator_backend,
    resolve_namespace,
    table,
)

if TYPE_CHECKING:
    import argparse
    from collections.abc import Awaitable, Callable

    from .._engine._schedules import ScheduleInfo, Schedules
    from .._ops import Operations

__all__ = ["add_schedule_commands"]

_DONE = {"pause": "paused", "resume": "resumed", "delete": "deleted"}


class _Target:
    """What a command works on: the schedules, the namespace, and (``list`` and ``add``
    without ``--app``) the workflows its live engines run (``None``: none is live, or not
    asked)."""

    def __init__(self, schedules: Schedules, namespace: str, known: frozenset[str] | None) -> None:
        self.schedules = schedules
        self.namespace = namespace
        self.known = known


async def _list(target: _Target, args: argparse.Namespace) -> int:
    infos = await target.schedules.list()
    if args.json:
        rows: list[dict[str, Any]] = []
        for info in infos:
            # camelCase, as every --json output (docs/operations.md, "JSON output")
            entry: dict[str, Any] = {"name": info.name, "lastTick": info.last_tick,
                                     "nextTick": info.next_tick, "error": info.error}  # fmt: skip
            if info.schedule is not None:
                d = info.schedule
                entry.update(workflow=d.workflow, cron=d.cron, every=d.every, input=d.input,
                             timezone=d.timezone, catchUp=d.catch_up,
                             maxCatchUp=d.max_catch_up, overlap=d.overlap,
                             skipped=info.skipped, buffered=info.buffered,
                             paused=d.paused)  # fmt: skip
            rows.append(entry)
        print(json.dumps(rows, indent=2))
        return 0
    if not infos:  # (as runs list, queues, jobs failed: a sentence, not a bare header)
        print(f"no schedules in namespace {target.namespace!r}")
        return 0
    lines = []
    for info in infos:
        s = info.schedule
        if s is None:
            lines.append([info.name, "—", "DAMAGED", "—", "—", "—", "—", _time(info.last_tick)])
            continue
        when = s.cron + f" ({s.timezone})" if s.cron is not None else f"every {s.every:g} s"
        state = "paused" if s.paused else "active"
        if info.error is not None:  # no live engine (or --app's) runs it: engines skip it
            state = "unknown workflow"
        lines.append([info.name, s.workflow, when, state, s.catch_up, _overlap(info),
                      _time(info.next_tick), _time(info.last_tick)])  # fmt: skip
    headers = ["name", "workflow", "when", "state", "catch-up", "overlap", "next tick",
               "last tick"]  # fmt: skip
    print(table(headers, lines), end="")
    return 0


def _overlap(info: ScheduleInfo) -> str:
    """The overlap policy, with the ticks it skipped and the one it holds (if any)."""
    assert info.schedule is not None
    shown: str = info.schedule.overlap
    if info.skipped:
        shown += f", {info.skipped} skipped"
    if info.buffered is not None:
        shown += f", {_time(info.buffered)} buffered"
    return shown


async def _add(target: _Target, args: argparse.Namespace) -> int:
    from .._json_values import parse_json_argument

    value = None if args.input is None else parse_json_argument(args.input, "--input")
    refusal, warning = (None, None) if args.app is not None else _check_workflow(target, args)
    if refusal is not None:
        print(visible(f"error: {refusal}"), file=sys.stderr)
        return 2
    stored = await target.schedules.add(
        args.name, args.workflow, cron=args.cron, every=args.every, input=value,
        timezone=args.timezone, catch_up=args.catch_up, max_catch_up=args.max_catch_up,
        overlap=args.overlap, replace=args.replace,
    )  # fmt: skip
    if not stored:
        print(visible(f"schedule {args.name!r} exists (--replace to overwrite it)"),
              file=sys.stderr)  # fmt: skip
        return 1
    if warning is not None:
        print(visible(f"warning: {warning}"), file=sys.stderr)
    print(visible(f"added schedule {args.name!r}"))
    return 0


async def _backfill(target: _Target, args: argparse.Namespace) -> int:
    start, end = _when(args.start), _when(args.end)
    assert start is not None  # (required options)
    assert end is not None
    done = await target.schedules.backfill(args.name, start, end, dry_run=args.dry_run)
    if done is None:
        print(visible(f"no schedule {args.name!r}"), file=sys.stderr)
        return 1
    if args.json:
        rows = [{"tick": t.tick, "runId": t.run_id, "started": t.started} for t in done]
        print(json.dumps(rows, indent=2))
        return 0
    verb = ("would start", "exists") if args.dry_run else ("started", "existed")
    lines = [[_time(t.tick), t.run_id, verb[0] if t.started else verb[1]] for t in done]
    print(table(["tick", "run id", "run"], lines), end="")
    fresh = sum(t.started for t in done)
    summary = (
        f"{len(done)} ticks of schedule {args.name!r}: {fresh} "
        + ("would start (dry run)" if args.dry_run else "started")
        + f", {len(done) - fresh} had a run"
    )
    print(visible(summary))
    return 0


def _check_workflow(target: _Target, args: argparse.Namespace) -> tuple[str | None, str | None]:
    """``add``'s check of its workflow against the live engines' (without ``--app``): why it
    is refused, or ``None``; and a warning to print once it is stored (no engine is live to
    ask, or ``--force``), or ``None``."""
    known, namespace = target.known, target.namespace
    if known is None:
        unchecked = f"no live engine of namespace {namespace!r} to check workflow {args.workflow!r}"
        return None, f"{unchecked} against: added unchecked"
    if args.workflow in known:
        return None, None
    unknown = (
        f"no live engine of namespace {namespace!r} runs workflow {args.workflow!r} "
        f"(they run: {', '.join(sorted(known)) or 'none'})"
    )
    if args.force:
        return None, f"{unknown}: added anyway (--force)"
    return f"{unknown}; --force adds it anyway", None


def _change(verb: str) -> Callable[[_Target, argparse.Namespace], Awaitable[int]]:
    async def change(target: _Target, args: argparse.Namespace) -> int:
        done = await getattr(target.schedules, verb)(args.name)
        if not done:
            print(visible(f"no schedule {args.name!r}"), file=sys.stderr)
            return 1
        print(visible(f"{_DONE[verb]} schedule {args.name!r}"))
        return 0

    return change


async def _known_workflows(ops: Operations) -> frozenset[str] | None:
    """The workflows the namespace's live engines run (``None``: no engine is live)."""
    from .._engine._advert import known_workflows

    return known_workflows(await ops.engines())


def _runner(
    command: Callable[[_Target, argparse.Namespace], Awaitable[int]],
    *,
    existing: bool = True,
    checks: bool = False,
    reads_only: bool = False,
) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from .._engine._schedules import Schedules
        from .._ops import open_operations
        from ._engine import load_app, run_reporting_errors

        async def main() -> int:
            app = load_app(args.app) if args.app else None
            namespace = resolve_namespace(args.namespace, args.app)
            url = operator_backend(args.backend, f"schedules {args.schedules_command}")
            async with open_operations(
                url,
                namespace=namespace,
                existing=existing,
                discover=True,
                read_only="if_needed" if reads_only else False,
            ) as ops:
                # Without --app: the workflows the live engines run (what list marks and
                # add checks against).
                known = await _known_workflows(ops) if checks and app is None else None
                schedules = Schedules(ops.store, time.time, app=app, known=known)
                target = _Target(schedules, ops.namespace or DEFAULT_NAMESPACE, known)
                return await command(target, args)

        try:
            return run_reporting_errors(lambda: trio.run(main))
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130

    return run


def add_schedule_commands(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """Add ``schedules`` to ``durable-trio``'s sub-commands."""
    group = subparsers.add_parser(
        "schedules", help="list, add, pause, resume, delete or backfill schedules"
    )
    commands = group.add_subparsers(dest="schedules_command", required=True)
    listing = commands.add_parser("list", help="the namespace's schedules, next and last tick")
    _common(listing)
    listing.set_defaults(func=_runner(_list, checks=True, reads_only=True))
    add = commands.add_parser("add", help="add a schedule (its first tick is the next after now)")
    _common(add)
    add.add_argument("name", metavar="NAME")
    add.add_argument("workflow", metavar="WORKFLOW")
    when = add.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", help='a cron expression, e.g. "0 3 * * *"')
    when.add_argument("--every", type=float, help="seconds between ticks (1 to 31622400)")
    add.add_argument("--timezone", default="UTC", help="the cron's IANA time zone (UTC)")
    add.add_argument("--input", help="each run's JSON input")
    add.add_argument("--catch-up", default="skip", choices=("skip", "once", "all"),
                     help="ticks missed while no engine ran (skip)")  # fmt: skip
    add.add_argument("--max-catch-up", type=int, default=10,
                     help="bound on ticks run at once (1 to 1000)")  # fmt: skip
    add.add_argument(
        "--overlap",
        default="skip",
        choices=("skip", "buffer_one", "allow", "cancel_other"),
        help="a tick while the previous run is unfinished: skip it (default), buffer_one "
        "(start it when that run ends), allow (stack runs), cancel_other (cancel that run)",
    )
    add.add_argument("--replace", action="store_true", help="overwrite a schedule of that name")
    add.add_argument(
        "--force",
        action="store_true",
        help="add it even if no live engine of the namespace runs WORKFLOW (without --app)",
    )
    add.set_defaults(func=_runner(_add, existing=False, checks=True))
    for verb, helptext in (
        ("pause", "pause a schedule (its ticks meanwhile never start)"),
        ("resume", "resume a paused schedule from its next tick"),
        ("delete", "delete a schedule (the runs it started stay)"),
    ):
        sub = commands.add_parser(verb, help=helptext)
        _common(sub)
        sub.add_argument("name", metavar="NAME")
        sub.set_defaults(func=_runner(_change(verb)))
    backfill = commands.add_parser(
        "backfill", help="start the runs of a schedule's past ticks in a range (each once)"
    )
    _common(backfill)
    backfill.add_argument("name", metavar="NAME")
    when_help = "Unix seconds or ISO 8601 (UTC unless it names a zone); the tick at it counts"
    backfill.add_argument("--from", dest="start", required=True, metavar="T", help=when_help)
    backfill.add_argument("--to", dest="end", required=True, metavar="T", help=when_help)
    backfill.add_argument(
        "--dry-run", action="store_true", help="start nothing: print the ticks and their runs"
    )
    backfill.set_defaults(func=_runner(_backfill))
