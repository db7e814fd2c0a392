"""``durable-trio migrate URL [--check]``: a PostgreSQL backend's tables, brought up to date.

Every part (the broker, the key store, the run store) has its own versioned steps; a process
that opens the backend applies the missing ones itself, which needs ``CREATE`` on the database.
This command applies them ahead of time, run by the schema's owner, so the processes can run as
a role with only the rights to use the tables (docs/deployment.md, "PostgreSQL"). It prints
each part's version. ``--check`` changes nothing: exit 0 when every part is current, 1 when
one is behind (a deploy's gate), 2 on an error (one line on stderr).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import trio

from .._redact import redact_url
from ._operations import table

if TYPE_CHECKING:
    import argparse

    from ..backends.postgres import SchemaState

__all__ = ["add_migrate_command"]


def add_migrate_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``migrate`` to the ``durable-trio`` subcommands."""
    migrate = commands.add_parser(
        "migrate",
        help="apply a PostgreSQL backend's schema migrations (or --check them)",
        description=__doc__.split("\n\n", 1)[1].replace("``", "'") if __doc__ else None,
    )
    migrate.add_argument(
        "url",
        nargs="?",
        help="the backend URL, postgresql://... (default: $DURABLE_TRIO_BACKEND)",
    )
    migrate.add_argument(
        "--backend",
        dest="backend",
        metavar="URL",
        help="the backend URL, as the other commands take it (or give it as URL)",
    )
    migrate.add_argument(
        "--check",
        action="store_true",
        help="change nothing: exit 1 if a part is behind this durable_trio's version",
    )
    migrate.set_defaults(func=_cmd_migrate)


def _cmd_migrate(args: argparse.Namespace) -> int:
    from ._engine import run_reporting_errors

    if args.url and args.backend and args.url != args.backend:
        print("error: give the backend URL once: as URL or as --backend", file=sys.stderr)
        return 2
    url = args.url or args.backend or os.environ.get("DURABLE_TRIO_BACKEND")
    if not url:
        print("error: say which backend: durable-trio migrate postgresql://...", file=sys.stderr)
        return 2
    if not url.startswith(("postgresql://", "postgres://")):
        print(
            f"error: {redact_url(url)} has no migrations to apply: only a PostgreSQL backend's "
            "tables are versioned (SQLite and Redis make theirs at the first open)",
            file=sys.stderr,
        )
        return 2
    try:
        from ..backends.postgres import postgres_schema
    except ImportError as missing:
        print(
            f"error: PostgreSQL needs its extra: pip install 'durable_trio[postgres]' ({missing})",
            file=sys.stderr,
        )
        return 2

    def run() -> int:
        state = trio.run(lambda: postgres_schema(url, apply=not args.check))
        print(_report(state), end="")
        return 0 if state.current or not args.check else 1

    return run_reporting_errors(run)


def _report(state: SchemaState) -> str:
    rows = []
    for part, newest in state.newest.items():
        applied = state.applied[part]
        if applied == newest:
            status = "current"
        elif applied == 0:
            status = "not created"
        else:
            status = f"behind: {newest - applied} step(s) to apply"
        rows.append([part, str(applied), str(newest), status])
    heading = f"schema {state.schema!r}: " + ("current" if state.current else "not current")
    return heading + "\n" + table(["part", "version", "newest", "status"], rows)
