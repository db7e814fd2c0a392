"""The ``durable-trio`` command line (also ``python -m durable_trio``)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

import trio

from .. import __version__
from .._redact import redact_url

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence
    from types import ModuleType

__all__ = ["main"]


def _checkout_examples() -> Path | None:
    """The ``examples/`` folder of the source checkout this package runs from, if it does.

    The wheel ships only the library: installed from it, the package sits in site-packages with
    no repository around it, and the examples are not on this machine.
    """
    package = Path(__file__).resolve().parent.parent  # durable_trio/cli/_main.py
    root = package.parent  # <root>/durable_trio, beside the checkout's pyproject.toml
    if (root / "pyproject.toml").is_file() and (root / "examples").is_dir():
        return root / "examples"
    return None


#: Where the examples live: ``$DURABLE_TRIO_EXAMPLES``, else the source checkout's ``examples/``.
_CHECKOUT_EXAMPLES = _checkout_examples()

#: Said (on one line) when neither names a folder: where to get the examples.
_NOT_INSTALLED = (
    "the examples are not installed with the package: they are in the examples/ folder of the"
    " durable_trio repository; run `durable-trio examples` from a clone (`make demo`), or set"
    " DURABLE_TRIO_EXAMPLES to that folder"
)

#: The embedded default: a SQLite file under the working folder, reused on purpose (the
#: durable-state demos show that what one run left behind, the next one finds).
DEFAULT_BACKEND = "sqlite:///.durable/demo.db"


def _examples_dir() -> Path | None:
    configured = os.environ.get("DURABLE_TRIO_EXAMPLES")
    return Path(configured) if configured else _CHECKOUT_EXAMPLES


def _discover() -> dict[str, Path]:
    folder = _examples_dir()
    if folder is None or not folder.is_dir():
        return {}
    # Files are named NN_name.py: the number orders them, the name is what users type.
    return {
        path.stem.split("_", 1)[1] if path.stem[:2].isdigit() else path.stem: path
        for path in sorted(folder.glob("*.py"))
        if not path.stem.startswith("_")
    }


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"durable_trio_example_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load example {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _summary(path: Path) -> str:
    """The example's docstring's first paragraph on one line, its ``literals`` quoted plainly
    (a whole sentence: a first line alone stops mid-sentence)."""
    module_doc = (_load(path).__doc__ or "").strip()
    paragraph = " ".join(module_doc.split("\n\n", 1)[0].split())
    return re.sub(r"``(.+?)``", r"'\1'", paragraph)


def _backend_url(url: str | None) -> str:
    # (open_backend makes a SQLite file's folder, or says clearly why it cannot)
    return url or os.environ.get("DURABLE_TRIO_BACKEND") or DEFAULT_BACKEND


def _run_example(name: str, path: Path, backend: str) -> bool:
    module = _load(path)
    entry = cast("Callable[[str], Awaitable[None]] | None", getattr(module, "main", None))
    if entry is None:
        print(f"✗ {name}: the example has no `async def main(backend_url)`")
        return False
    print(f"▶ {name} — {_summary(path)}")
    start = time.perf_counter()
    try:
        trio.run(entry, backend)
    except (Exception, SystemExit) as exc:
        print(f"✗ {name} failed: {exc!r}\n")
        return False
    print(f"✓ {name} ({time.perf_counter() - start:.2f} s)\n")
    return True


def _backend_problem(url: str) -> bool:
    """Whether ``url`` cannot be opened (a bad scheme or URL, refused credentials, a server not
    there): then it is said in one line on stderr, once."""
    from ..backends import open_backend
    from ._engine import run_reporting_errors

    async def probe() -> int:
        async with open_backend(url):
            return 0

    return run_reporting_errors(lambda: trio.run(probe)) != 0


def _cmd_examples(args: argparse.Namespace) -> int:
    examples = _discover()
    if not examples:
        folder = _examples_dir()
        where = _NOT_INSTALLED if folder is None else f"no examples found in {folder}"
        print(where, file=sys.stderr)
        return 2
    if args.action == "list":
        width = max(map(len, examples))
        for name, path in examples.items():
            print(f"{name:<{width}}  {_summary(path)}")
        return 0
    if args.all == bool(args.name):
        print("say `run NAME` or `run --all`", file=sys.stderr)
        return 2
    backend = _backend_url(args.backend)
    chosen = examples if args.all else {n: examples[n] for n in args.name if n in examples}
    unknown = [n for n in (args.name or []) if n not in examples]
    if unknown:
        print(f"unknown example(s): {', '.join(unknown)}; see `durable-trio examples list`")
        return 2
    if _backend_problem(backend):  # said once, not once per example
        return 2
    print(f"Running {len(chosen)} example(s) on {redact_url(backend)}\n")
    failed = [name for name, path in chosen.items() if not _run_example(name, path, backend)]
    if failed:
        print(f"{len(failed)} of {len(chosen)} example(s) failed: {', '.join(failed)}")
        return 1
    print(f"All {len(chosen)} example(s) passed on {redact_url(backend)}.")
    return 0


def _cmd_health(args: argparse.Namespace) -> int:
    from ._engine import run_reporting_errors
    from ._health import run_health
    from ._operations import operator_backend, resolve_namespace

    def run() -> int:
        namespace = resolve_namespace(args.namespace, args.app)
        url = operator_backend(args.backend, "health")
        trio.run(
            lambda: run_health(
                url,
                namespace,
                watch_mode=args.watch,
                interval=args.interval,
                iterations=args.iterations,
                prometheus=args.prometheus,
                as_json=args.json,
            )
        )
        return 0

    if args.json and (args.watch or args.prometheus is not None):
        print("error: --json prints one reading: not with --watch or --prometheus", file=sys.stderr)
        return 2
    problem = _health_argument_problem(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        return run_reporting_errors(run)
    except BaseException as error:  # a Ctrl-C outside the signal handling (opening the backend)
        if _only(KeyboardInterrupt, error):
            return 130
        raise


def _health_argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``health``'s ``--interval``, ``--iterations`` or ``--prometheus``
    (a traceback, or a port the kernel wrapped, before), or ``None``."""
    from .._arguments import check_seconds
    from .._errors import ConfigError

    try:
        check_seconds(args.interval, "health", "--interval", positive=True)
    except ConfigError as exc:
        return str(exc)
    if args.iterations is not None and args.iterations < 1:
        return f"--iterations must be an integer >= 1, got {args.iterations}"
    if args.prometheus is not None and not 0 <= args.prometheus <= 65535:
        return f"--prometheus: a port is 0..65535 (0: a free one), got {args.prometheus}"
    return None


def _only(kind: type[BaseException], error: BaseException) -> bool:
    """Whether ``error`` is a ``kind``, or exception groups of nothing else (as a nursery
    wraps what its tasks raised)."""
    if isinstance(error, BaseExceptionGroup):
        return all(_only(kind, inner) for inner in error.exceptions)
    return isinstance(error, kind)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="durable-trio", description="Durable execution for Trio: workers, engines, examples."
    )
    parser.add_argument("--version", action="version", version=f"durable-trio {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    examples = commands.add_parser("examples", help="list or run the examples")
    examples.add_argument(
        "action", nargs="?", default="list", choices=["list", "run"], help="(default: list)"
    )
    examples.add_argument("name", nargs="*", help="example name(s) to run")
    examples.add_argument("--all", action="store_true", help="run every example")
    examples.add_argument(
        "--backend", help=f"backend URL (default: $DURABLE_TRIO_BACKEND or {DEFAULT_BACKEND})"
    )
    examples.set_defaults(func=_cmd_examples)
    health = commands.add_parser("health", help="every group's depth and live workers")
    health.add_argument(
        "--backend", help=f"backend URL (default: $DURABLE_TRIO_BACKEND or {DEFAULT_BACKEND})"
    )
    health.add_argument(
        "--namespace",
        help="the namespace (default: $DURABLE_TRIO_NAMESPACE, else --app's name, else the "
        "backend's only one; none yet: durable)",
    )
    health.add_argument(
        "--app", metavar="MODULE:app", help="take the namespace from this App (as worker/engine)"
    )
    health.add_argument("--watch", action="store_true", help="refresh live (rich)")
    health.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (2)")
    health.add_argument("--iterations", type=int, help="stop after this many refreshes")
    health.add_argument(
        "--prometheus", type=int, metavar="PORT", help="also serve /metrics on 127.0.0.1:PORT"
    )
    health.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    health.set_defaults(func=_cmd_health)
    from ._engine import add_engine_commands
    from ._operations import add_ops_commands

    add_engine_commands(commands)
    add_ops_commands(commands)
    from ._schedules import add_schedule_commands

    add_schedule_commands(commands)
    from ._console import add_console_command

    add_console_command(commands)
    from ._migrate import add_migrate_command

    add_migrate_command(commands)
    return parser


def _not_utf8(argv: Sequence[str]) -> str | None:
    """What is wrong with the first argument that is not UTF-8 (its bytes decoded to lone
    surrogates, ``surrogateescape``): no store, queue or JSON can hold it, so every command
    refuses it in one line before it starts rather than failing in a driver with a traceback."""
    for index, arg in enumerate(argv, 1):
        try:
            arg.encode()
        except UnicodeEncodeError:
            return f"argument {index} ({arg!r}) is not valid UTF-8"
    return None


def _innermost(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser of the innermost (sub)command ``argv`` names (``runs list``: ``list``'s)."""
    for word in argv:
        choices = next(
            (
                action.choices
                for action in parser._actions
                if isinstance(action, argparse._SubParsersAction)
            ),
            None,
        )
        if choices is None:
            break
        sub = choices.get(word)
        if isinstance(sub, argparse.ArgumentParser):
            parser = sub
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``durable-trio``; returns the exit status."""
    from .._errors import DurableTrioError
    from .._terminal import visible

    problem = _not_utf8(sys.argv[1:] if argv is None else argv)
    if problem is not None:
        print(visible(f"error: {problem}"), file=sys.stderr)
        return 2
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # Said by the (sub)command's own parser, with its usage: the top-level usage does not
        # say what `queues` takes.
        _innermost(parser, sys.argv[1:] if argv is None else argv).error(
            f"unrecognized arguments: {' '.join(unknown)}"
        )
    func = cast("Callable[[argparse.Namespace], int]", args.func)
    try:
        return func(args)
    except DurableTrioError as exc:  # a user error met before the command ran (MODULE:app)
        print(visible(f"error: {exc}"), file=sys.stderr)
        return 2
    except BaseException as error:
        if not _only(BrokenPipeError, error):
            raise
        # The reader went away (`durable-trio runs list --json | head -1`): stop quietly, as a
        # tool killed by SIGPIPE does; stdout goes to /dev/null so the interpreter's own last
        # flush does not fail again on the closed pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
