"""``durable-trio runs cancel|retry`` by filter (issue 34, item 3): ``--status --workflow --tag
--since --until`` instead of a run id, the count printed first, then a confirmation (``--yes``;
``--dry-run`` lists what would be done). Without ``--yes`` and without a terminal to ask on, the
command refuses (exit status 2) and says why. See :mod:`durable_trio._ops_bulk`."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import trio

from .._engine._tags import parse_tag
from .._errors import ConfigError
from .._terminal import visible

if TYPE_CHECKING:
    import argparse
    from collections.abc import Awaitable, Callable, Coroutine

    from .._ops import Operations
    from .._ops_bulk import BulkOutcome, RunFilter

__all__ = ["add_bulk_arguments", "add_tag_argument", "by_id_or_filter", "tags_of"]

_FILTERS = ("status", "workflow", "tag", "since", "until")
_GERUND = {"cancel": "cancelling", "retry": "retrying"}


def add_tag_argument(parser: argparse.ArgumentParser) -> None:
    """``--tag KEY=VALUE``, repeatable (several: runs carrying every one)."""
    parser.add_argument(
        "--tag",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="only runs with this tag (repeat it: runs with every one)",
    )


def tags_of(args: argparse.Namespace) -> dict[str, str] | None:
    """The ``--tag`` filters as a dict (``None``: none given).

    Raises:
        ConfigError: a filter that is not ``KEY=VALUE``, or a key given twice.
    """
    if not args.tag:
        return None
    tags: dict[str, str] = {}
    for text in args.tag:
        key, value = parse_tag(text)
        if key in tags and tags[key] != value:
            raise ConfigError(f"--tag: {key!r} given twice ({tags[key]!r} and {value!r})")
        tags[key] = value
    return tags


def add_bulk_arguments(parser: argparse.ArgumentParser, action: str) -> None:
    """The filters of a bulk ``runs cancel|retry`` and its confirmation flags."""
    parser.add_argument(
        "--status", help=f"{action} every run of this status (instead of a RUN_ID)"
    )
    parser.add_argument("--workflow", help=f"{action} every run of this workflow")
    add_tag_argument(parser)
    parser.add_argument("--since", help="only runs created at or after (Unix seconds or ISO)")
    parser.add_argument("--until", help="only runs created before (Unix seconds or ISO)")
    parser.add_argument("--yes", action="store_true", help="do it without asking")
    parser.add_argument(
        "--dry-run", action="store_true", help="list the runs it would act on, change nothing"
    )


def by_id_or_filter(
    single: Callable[[Operations, argparse.Namespace], Awaitable[int]],
    action: str,
    when: Callable[[str | None], float | None],
) -> Callable[[Operations, argparse.Namespace], Coroutine[Any, Any, int]]:
    """``runs cancel|retry``: of ``RUN_ID`` (``single``), or of every run the filters match."""

    async def command(ops: Operations, args: argparse.Namespace) -> int:
        filtered = [name for name in _FILTERS if getattr(args, name) is not None]
        if args.run_id is not None:
            if filtered or args.yes or args.dry_run:
                raise ConfigError(
                    f"runs {action}: a RUN_ID or filters (--{', --'.join(_FILTERS)}), not both"
                )
            return await single(ops, args)
        if not filtered:
            raise ConfigError(
                f"runs {action}: say which runs: a RUN_ID, or filters"
                f" (--{', --'.join(_FILTERS)})"
            )
        return await _bulk(ops, args, action, when)

    return command


def _filter(
    args: argparse.Namespace, when: Callable[[str | None], float | None]
) -> RunFilter:
    from .._ops_bulk import RunFilter

    return RunFilter(
        status=args.status,
        workflow=args.workflow,
        tags=tags_of(args),
        since=when(args.since),
        until=when(args.until),
    )


def _describe(run_filter: RunFilter) -> str:
    parts = []
    for key, value in run_filter.to_json().items():
        if key == "tags":
            parts += [f"tag {k}={v}" for k, v in value.items()]
        else:
            parts.append(f"{key} {value}")
    return visible(", ".join(parts))


async def _bulk(
    ops: Operations,
    args: argparse.Namespace,
    action: str,
    when: Callable[[str | None], float | None],
) -> int:
    run_filter = _filter(args, when)
    # With --json, stdout is the result's JSON alone: the count and the question go to stderr.
    say = sys.stderr if args.json else sys.stdout
    refused = False

    async def confirm(count: int) -> bool:
        nonlocal refused
        runs = "run matches" if count == 1 else "runs match"
        print(f"{count} {runs} ({_describe(run_filter)})", file=say, flush=True)
        if count == 0 or args.yes or args.dry_run:
            return True
        if not sys.stdin.isatty():
            refused = True
            print(
                f"error: not {_GERUND[action]} {count} runs without a confirmation: stdin is not a"
                " terminal to ask on (add --yes to do it, --dry-run to list them)",
                file=sys.stderr,
            )
            return False
        answer = await trio.to_thread.run_sync(
            input, f"{action} these {count} runs? [y/N] ", abandon_on_cancel=True
        )
        return answer.strip().lower() in ("y", "yes")

    def each(outcome: BulkOutcome) -> None:
        if not args.json:
            print(
                f"{visible(outcome.note)}: {visible(outcome.run_id)} ({visible(outcome.workflow)},"
                f" was {outcome.status})",
                flush=True,
            )

    if action == "cancel":
        result = await ops.cancel_runs(
            run_filter, reason=args.reason, dry_run=args.dry_run, confirm=confirm, on_each=each
        )
    else:
        result = await ops.retry_runs(
            run_filter, dry_run=args.dry_run, confirm=confirm, on_each=each
        )
    if args.json:
        data: dict[str, Any] = {"filter": run_filter.to_json(), **result.to_json()}
        print(json.dumps(data, indent=2))
    if refused:
        return 2
    if not result.confirmed:
        print("nothing done", file=say)
        return 1
    if not args.json and result.matched:
        verb = f"would {action}" if result.dry_run else "done"
        print(f"{verb}: {result.done}, skipped: {result.skipped}")
    return 0
