"""``durable-trio schedules list | add | pause | resume | delete``: a namespace's schedules.

Each opens the backend and the namespace's run store only (as ``runs``), changes or prints the
stored schedules and exits: 0 on success, 1 when the schedule named is not there (or ``add``
finds the name taken), 2 on a user error (one line on stderr). The engines of the namespace see
a change within their ``schedule_recheck`` (5 s by default).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import trio

from ._operations import DEFAULT_BACKEND, _common, _time, resolve_namespace, table

if TYPE_CHECKING:
    import argparse
    from collections.abc import Awaitable, Callable

    from .._engine._schedules import Schedules

__all__ = ["add_schedule_commands"]

_DONE = {"pause": "paused", "resume": "resumed", "delete": "deleted"}


async def _list(schedules: Schedules, args: argparse.Namespace) -> int:
    infos = await schedules.list()
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
                             maxCatchUp=d.max_catch_up, paused=d.paused)  # fmt: skip
            rows.append(entry)
        print(json.dumps(rows, indent=2))
        return 0
    lines = []
    for info in infos:
        s = info.schedule
        if s is None:
            lines.append([info.name, "—", "DAMAGED", "—", "—", _time(info.last_tick)])
            continue
        when = s.cron + f" ({s.timezone})" if s.cron is not None else f"every {s.every:g} s"
        state: str = "paused" if s.paused else s.catch_up
        if info.error is not None:  # listed with --app: engines of that app skip it
            state = "unknown workflow"
        lines.append([info.name, s.workflow, when, state, _time(info.next_tick),
                      _time(info.last_tick)])  # fmt: skip
    print(table(["name", "workflow", "when", "state", "next tick", "last tick"], lines), end="")
    return 0


async def _add(schedules: Schedules, args: argparse.Namespace) -> int:
    from .._json_values import parse_json_argument

    value = None if args.input is None else parse_json_argument(args.input, "--input")
    stored = await schedules.add(
        args.name, args.workflow, cron=args.cron, every=args.every, input=value,
        timezone=args.timezone, catch_up=args.catch_up, max_catch_up=args.max_catch_up,
        replace=args.replace,
    )  # fmt: skip
    if not stored:
        print(f"schedule {args.name!r} exists (--replace to overwrite it)", file=sys.stderr)
        return 1
    print(f"added schedule {args.name!r}")
    return 0


def _change(verb: str) -> Callable[[Schedules, argparse.Namespace], Awaitable[int]]:
    async def change(schedules: Schedules, args: argparse.Namespace) -> int:
        done = await getattr(schedules, verb)(args.name)
        if not done:
            print(f"no schedule {args.name!r}", file=sys.stderr)
            return 1
        print(f"{_DONE[verb]} schedule {args.name!r}")
        return 0

    return change


def _runner(
    command: Callable[[Schedules, argparse.Namespace], Awaitable[int]], *, existing: bool = True
) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from .._engine._schedules import Schedules
        from .._ops import open_operations
        from ._engine import load_app, run_reporting_errors

        async def main() -> int:
            app = load_app(args.app) if args.app else None
            namespace = resolve_namespace(args.namespace, args.app)
            url = args.backend or os.environ.get("DURABLE_TRIO_BACKEND") or DEFAULT_BACKEND
            async with open_operations(
                url, namespace=namespace, existing=existing, discover=True
            ) as ops:
                return await command(Schedules(ops.store, time.time, app=app), args)

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
    group = subparsers.add_parser("schedules", help="list, add, pause, resume or delete schedules")
    commands = group.add_subparsers(dest="schedules_command", required=True)
    listing = commands.add_parser("list", help="the namespace's schedules, next and last tick")
    _common(listing)
    listing.set_defaults(func=_runner(_list))
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
    add.add_argument("--max-catch-up", type=int, default=10, help="bound on ticks run at once")
    add.add_argument("--replace", action="store_true", help="overwrite a schedule of that name")
    add.set_defaults(func=_runner(_add, existing=False))
    for verb, helptext in (
        ("pause", "pause a schedule (its ticks meanwhile never start)"),
        ("resume", "resume a paused schedule from its next tick"),
        ("delete", "delete a schedule (the runs it started stay)"),
    ):
        sub = commands.add_parser(verb, help=helptext)
        _common(sub)
        sub.add_argument("name", metavar="NAME")
        sub.set_defaults(func=_runner(_change(verb)))
