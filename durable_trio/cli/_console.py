"""``durable-trio console --backend URL``: the web console's command line.

Kept apart from :mod:`durable_trio.console` so ``durable-trio`` starts without the ``console``
extra installed; the command itself says to install it when it is missing.
"""

from __future__ import annotations

import os
import signal
import sys
from functools import partial
from typing import TYPE_CHECKING

import trio

from .._redact import redact_url

if TYPE_CHECKING:
    import argparse

__all__ = ["add_console_command"]

#: Said when the console extra is not installed.
MISSING_EXTRA = (
    "the console needs its extra: pip install 'durable_trio[console]' (hypercorn and starlette)"
)


def add_console_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``console`` to the ``durable-trio`` subcommands."""
    console = commands.add_parser(
        "console", help="the web console: runs, one run's history, schedules, workers, queues"
    )
    console.add_argument(
        "--backend", help="backend URL (default: $DURABLE_TRIO_BACKEND or the embedded SQLite)"
    )
    console.add_argument("--namespace", help="the namespace (default as for `health`)")
    console.add_argument(
        "--app", metavar="MODULE:app", help="take the namespace from this App (as worker/engine)"
    )
    console.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    console.add_argument("--port", type=int, default=8080, help="TCP port (8080; 0: a free one)")
    console.add_argument(
        "--allow-actions",
        action="store_true",
        help="allow retry, cancel, start a run, send a signal, pause/resume/delete a schedule,"
        " requeue and delete (read-only without it)",
    )
    console.add_argument(
        "--token",
        default=os.environ.get("DURABLE_TRIO_CONSOLE_TOKEN"),
        help="token every request must carry (required beyond loopback;"
        " default $DURABLE_TRIO_CONSOLE_TOKEN)",
    )
    console.set_defaults(func=_cmd_console)


def _cmd_console(args: argparse.Namespace) -> int:
    try:
        from ..console import check_exposure, run_console
    except ImportError:
        print(f"error: {MISSING_EXTRA}", file=sys.stderr)
        return 2
    from ._engine import run_reporting_errors
    from ._operations import operator_backend, resolve_namespace

    def main() -> int:
        check_exposure(args.host, args.token)  # (the flags first, as before the backend)
        backend = operator_backend(args.backend, "console")  # (memory://: refused, in one line)

        def announce(url: str) -> None:
            shown = f"{url}/?token=…" if args.token else url
            mode = "actions allowed" if args.allow_actions else "read-only"
            print(f"console: {shown} ({mode}) over {redact_url(backend)}", flush=True)

        run = partial(
            run_console,
            backend,
            namespace=resolve_namespace(args.namespace, args.app),
            host=args.host,
            port=args.port,
            allow_actions=args.allow_actions,
            token=args.token,
            announce=announce,
        )
        status = 0
        try:
            trio.run(run)
        except* KeyboardInterrupt:
            status = 128 + signal.SIGINT
        except* OSError as group:
            print(
                f"error: cannot listen on {args.host}:{args.port}: {_first_leaf(group)}",
                file=sys.stderr,
            )
            status = 2
        return status

    return run_reporting_errors(main)


def _first_leaf(error: BaseException) -> BaseException:
    """The first error inside nested exception groups (hypercorn's nursery wraps the bind
    error: ``[Errno 98] Address already in use``, not ``Exceptions from Trio nursery``)."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error
