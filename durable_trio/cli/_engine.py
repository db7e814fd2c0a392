"""``durable-trio worker | engine | run MODULE:app ...``: the engine's command line.

Wired into ``durable-trio`` by :func:`add_engine_commands`. ``MODULE:app`` names an importable
module (or a ``path/to/file.py``) and the :class:`App` attribute in it; the current directory is
importable, as with ``python -m``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shlex
import signal
import sys
import traceback
import uuid
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import trio

from .._arguments import check_run_id, check_seconds
from .._engine._app import App
from .._engine._errors import RunFailed
from .._engine._open import open_engine
from .._engine._worker import open_worker
from .._errors import BrokerError, ConfigError, DurableTrioError, PayloadError
from .._json_values import parse_json_argument
from .._os_signals import close_on_signals
from .._redact import redact_url, url_scheme
from .._terminal import visible
from ..backends import open_backend

if TYPE_CHECKING:
    import argparse
    from collections.abc import Awaitable, Callable

    from .._engine._engine import Engine
    from .._engine._records import StepRecord


__all__ = ["add_engine_commands", "check_namespace_option", "load_app", "run_reporting_errors"]

#: The embedded default (as ``durable-trio examples``): a SQLite file under the working folder.
DEFAULT_BACKEND = "sqlite:///.durable/demo.db"


def _default_backend() -> str:
    return os.environ.get("DURABLE_TRIO_BACKEND") or DEFAULT_BACKEND


def load_app(target: str) -> App:
    """The :class:`App` that ``MODULE:attr`` (or ``path/file.py:attr``) names.

    Raises:
        ConfigError: it cannot be imported, or is not an App.
    """
    module_name, _, attribute = target.partition(":")
    attribute = attribute or "app"
    if not module_name:
        raise ConfigError(f"say MODULE:app, not {target!r}")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            spec = importlib.util.spec_from_file_location(path.stem, path)
            if spec is None or spec.loader is None:
                raise ConfigError(f"cannot load {path}")
            module = importlib.util.module_from_spec(spec)
            sys.modules.setdefault(path.stem, module)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ConfigError:
        raise
    except (ImportError, OSError) as exc:
        raise ConfigError(f"cannot import {module_name!r}: {exc}") from exc
    except Exception as exc:  # the module's own code failed: one line, not its traceback
        where = ""
        frames = traceback.extract_tb(exc.__traceback__)
        if frames:
            where = f" (at {frames[-1].filename}:{frames[-1].lineno})"
        mine = [frame for frame in frames if "/trio/" not in frame.filename.replace("\\", "/")]
        if isinstance(exc, RuntimeError) and "from inside a run()" in str(exc) and mine:
            # A script's ``trio.run(main)`` at its top level (as README's first example has
            # it), run again by the import: say how to make the module importable.
            raise ConfigError(
                f"cannot import {module_name!r}: its top level calls trio.run() (at "
                f"{mine[-1].filename}:{mine[-1].lineno}); put that call under "
                '`if __name__ == "__main__":` so that durable-trio can import its App'
            ) from exc
        raise ConfigError(
            f"cannot import {module_name!r}: {type(exc).__name__}: {exc}{where}"
        ) from exc
    if not hasattr(module, attribute):
        raise ConfigError(f"module {module_name!r} has no attribute {attribute!r} (say MODULE:app)")
    app = getattr(module, attribute)
    if not isinstance(app, App):
        raise ConfigError(f"{target!r} is not a durable_trio App (got {type(app).__name__})")
    return app


def run_reporting_errors(run: Callable[[], int]) -> int:
    """``run()`` (a command's ``trio.run``); an error of this package (a bad URL, refused
    credentials, an unreachable backend), alone or inside exception groups, is one line on
    stderr instead of a traceback.

    Returns:
        what ``run`` returns, or 2 after such an error (anything else propagates).
    """
    try:
        return run()
    except* DurableTrioError as group:
        failure = _first_leaf(group)
    # (a pool's "; next connect attempt in 0.03s" is for a process that goes on: this exits)
    text = _NEXT_ATTEMPT.sub("", str(failure))
    print(visible(f"error: {text}"), file=sys.stderr)
    return 2


_NEXT_ATTEMPT: Final = re.compile(r"; next connect attempt in [0-9.]+s$")


def _first_leaf(group: BaseExceptionGroup[DurableTrioError]) -> DurableTrioError:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def _announce(message: str) -> None:
    # (an instance id, an app's name: given by whoever runs the process, shown inert)
    print(visible(message), file=sys.stderr, flush=True)


def _interrupted(serve: Callable[[], Awaitable[int]]) -> int:
    """``trio.run(serve)``; a Ctrl-C outside :func:`close_on_signals` (opening or closing the
    backend) is exit status 130 without a traceback."""
    try:
        return trio.run(serve)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


def check_namespace_option(namespace: str | None) -> str | None:
    """``--namespace`` as given (``None``: left out).

    Raises:
        ConfigError: ``--namespace ''`` (an unset shell variable): read as left out, it
            operated the default namespace, not the one meant.
    """
    if namespace == "":
        raise ConfigError("--namespace must not be empty (leave it out for the default)")
    return namespace


def _transport_options(args: argparse.Namespace) -> dict[str, Any]:
    namespace = check_namespace_option(args.namespace) or os.environ.get("DURABLE_TRIO_NAMESPACE")
    options: dict[str, Any] = {"namespace": namespace} if namespace else {}
    for name in _THRESHOLDS:  # worker and engine (issue 30, item 9)
        if getattr(args, name, None) is not None:
            options[name] = getattr(args, name)
    return options


_THRESHOLDS = ("stalled_threshold", "stalled_check_interval", "dead_worker_threshold")


def _worker_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``worker`` command's transport options (``--processes`` children get the same)."""
    options = _transport_options(args)
    for name in ("instance_id", "close_timeout", "stalled_threshold", "stalled_check_interval"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    return options


def _child_worker_args(args: argparse.Namespace) -> list[str]:
    """The options a ``--processes N`` supervisor passes on to each child."""
    forwarded = ["--concurrency", str(args.concurrency), "--threads", str(args.threads)]
    if args.namespace:
        forwarded += ["--namespace", args.namespace]
    for name in _THRESHOLDS:
        if getattr(args, name) is not None:
            forwarded += ["--" + name.replace("_", "-"), repr(getattr(args, name))]
    return forwarded


def _log_to_stderr() -> None:
    """The supervisor's lines (starts, restarts, crash loops) on stderr, unless the
    ``durable_trio`` logger already has a handler."""
    import logging

    logger = logging.getLogger("durable_trio")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("supervisor: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))


def _cmd_worker(args: argparse.Namespace) -> int:
    from .._supervisor import PARENT_ENV, resolve_processes, run_worker_processes, watch_parent

    processes = resolve_processes(args.processes)
    if processes > 1:
        supervised = load_app(args.target)  # a bad target is one error here, not N crash loops
        _log_to_stderr()
        return run_worker_processes(
            args.target,
            args.backend,
            processes=processes,
            worker_args=_child_worker_args(args),
            close_timeout=5.0 if args.close_timeout is None else args.close_timeout,
            announce=_announce,
            # its slots' key (crash loops, last exits) for `health` and the console
            namespace=_transport_options(args).get("namespace", supervised.name),
        )
    app = load_app(args.target)
    parent = os.environ.get(PARENT_ENV)

    async def serve() -> int:
        async with (
            open_backend(args.backend) as backend,
            close_on_signals(announce=_announce) as stop,
        ):
            async with (
                open_worker(
                    app,
                    backend,
                    concurrency=args.concurrency,
                    threads=args.threads,
                    **_worker_options(args),
                ) as worker,
                trio.open_nursery() as nursery,
            ):
                if parent is not None and parent.isdigit():
                    # a supervisor's child: its supervisor gone (kill -9), close as on SIGTERM
                    nursery.start_soon(
                        watch_parent, int(parent), partial(os.kill, os.getpid(), signal.SIGTERM)
                    )
                remote = [n for n, w in app.workflows.items() if w.remote and w.fn is not None]
                # One write of the whole line: a supervisor's children share its stdout, and
                # print()'s two writes (the text, then the newline: unbuffered under
                # PYTHONUNBUFFERED) interleave two children's banners on one line.
                sys.stdout.write(
                    f"worker: serving {len(app.steps)} step(s) and {len(remote)} remote "
                    f"workflow(s) of {app.name!r} on {redact_url(backend.url)} "
                    f"(instance {worker.transport.instance_id}, pid {os.getpid()})\n"
                )
                sys.stdout.flush()
                await stop.wait()
                nursery.cancel_scope.cancel()
        return stop.exit_status

    return run_reporting_errors(partial(_interrupted, serve))


def _cmd_engine(args: argparse.Namespace) -> int:
    app = load_app(args.target)

    async def serve() -> int:
        async with (
            open_backend(args.backend) as backend,
            close_on_signals(announce=_announce) as stop,
        ):
            async with open_engine(
                app,
                backend,
                engine_id=args.engine_id,
                serve_tenants=args.serve_tenants,
                **_transport_options(args),
            ) as engine:
                stats = engine.statistics()
                role = ", serving tenant pods" if args.serve_tenants else ""
                print(
                    f"engine {engine.engine_id}: driving {app.name!r} on "
                    f"{redact_url(backend.url)}{role} ({stats.runs_resumed} run(s) resumed)"
                )
                await stop.wait()
        return stop.exit_status

    return run_reporting_errors(partial(_interrupted, serve))


async def _waiting_lines(engine: Engine, run_id: str) -> list[str]:
    """What a run that did not finish waits on, a line per step: its remote steps
    (``engine.waiting``), then its pending signals, timers and children, from its history
    (bounded: a slow or failing backend leaves the lines out, never hides the timeout)."""
    with trio.move_on_after(5.0):
        try:
            lines = [wait.describe() for wait in await engine.waiting(run_id)]
            history = await engine.history(run_id)
            now = engine.store.now()
        except DurableTrioError as exc:
            return [f"(what it waits on could not be read: {exc})"]
        return lines + [line for step in history if (line := _pending_line(step, now, run_id))]
    return []


def _pending_line(step: StepRecord, now: float, run_id: str) -> str | None:
    """One line for a pending signal wait, durable timer or child of the run (else ``None``)."""
    from .._engine._records import StepKind, StepState

    if step.status is not StepState.PENDING:
        return None
    facts = step.input if isinstance(step.input, dict) else {}
    if step.kind is StepKind.SIGNAL:
        text = f"step {step.step_id} waits on signal {step.name!r}"
        if step.wake_at is not None:
            text += f" (it gives up in {max(0.0, step.wake_at - now):.0f} s)"
        command = f"durable-trio runs signal {shlex.quote(run_id)} {shlex.quote(step.name)}"
        return f"{text}; send it: {command} [PAYLOAD-JSON]"
    if step.kind is StepKind.TIMER and step.wake_at is not None:
        left = max(0.0, step.wake_at - now)
        return f"step {step.step_id} sleeps (ctx.sleep) for {left:.0f} s more"
    if step.kind is StepKind.CHILD:
        return f"step {step.step_id} waits on child run {facts.get('runId')!r} ({step.name})"
    return None


async def _take_over_forever(engine: Engine, run_id: str) -> None:
    """Take ``run_id`` over whenever nobody drives it (at once for a run ``runs retry``
    reopened; after its lease for a run whose engine died while this waits), until cancelled.
    A store error is reported and tried again."""
    while True:
        try:
            await engine.take_over(run_id)
        except BrokerError as exc:
            engine.report(exc)
        await trio.sleep(engine.options.run_lease / 3)


def _start_options(args: argparse.Namespace) -> dict[str, Any]:
    """``run``'s ``--tag``, ``--dedup-key`` and ``--debounce`` as ``engine.start``'s
    arguments (docs/concurrency.md, "Debounce and dedup keys").

    Raises:
        ConfigError: a bad tag or delay; ``--debounce`` without ``--detach`` (its run starts
            later, in a reconciling engine: this command's engine reconciles nothing).
    """
    from .._engine._debounce import Debounce
    from .._engine._tags import parse_tag

    debounce = None
    if args.debounce is not None:
        if not args.detach:
            raise ConfigError(
                "--debounce needs --detach: the run starts when due, in a reconciling engine"
            )
        if args.debounce_delay is None:
            raise ConfigError("--debounce needs --debounce-delay SECONDS")
        debounce = Debounce(args.debounce, args.debounce_delay, args.debounce_max_wait)
    tags = dict(parse_tag(text, "--tag") for text in args.tag or ())
    return {"dedup_key": args.dedup_key, "debounce": debounce, "tags": tags or None}


def _cmd_run(args: argparse.Namespace) -> int:
    app = load_app(args.target)
    if args.input is not None and args.input_json is not None:
        print("error: give the run's input once: as INPUT or as --input", file=sys.stderr)
        return 2
    try:
        if args.input_json is not None:
            value = parse_json_argument(args.input_json, "INPUT")
        else:
            value = parse_json_argument("null" if args.input is None else args.input, "--input")
    except PayloadError as exc:  # not JSON, or nested too deep: one line, not a traceback
        print(visible(f"error: {exc}"), file=sys.stderr)
        return 2
    try:
        folding = _start_options(args)
        # Refused before anything starts (a bad bound once the run was started was a traceback)
        check_seconds(args.timeout, "run", "--timeout")
        check_run_id(args.run_id, "run", "--run-id")  # ('': refused, not a new id picked)
        if args.detach and url_scheme(args.backend or "") == "memory":
            raise ConfigError(
                "run --detach on memory:// records the run in this process's memory, gone "
                "when it exits, before any engine could drive it: give the URL the engines "
                "use (sqlite:///..., redis://...), or leave out --detach"
            )
    except (ConfigError, TypeError) as exc:
        print(visible(f"error: {exc}"), file=sys.stderr)
        return 2
    # Known before the run starts, so an interrupted command can always name it (a dedup key
    # or a debounce picks it in the store: known once started).
    outcome: dict[str, Any] = {"run_id": args.run_id or uuid.uuid4().hex}
    given_id = args.run_id if folding["dedup_key"] or folding["debounce"] else outcome["run_id"]

    async def drive() -> int:
        async with (
            open_backend(args.backend) as backend,
            close_on_signals(announce=_announce) as stop,
            AsyncExitStack() as stack,
        ):
            options = _transport_options(args)
            if args.with_worker:
                await stack.enter_async_context(open_worker(app, backend, **options))
            engine = await stack.enter_async_context(
                open_engine(app, backend, reconcile=False, **options)
            )
            # Only the body stops on a signal: leaving the blocks then releases the run (and
            # hands the steps back) while the backend is still open.
            with stop.body():
                run_id = await engine.start(
                    args.workflow, value, run_id=given_id, detach=args.detach, **folding
                )
                outcome["run_id"] = run_id
                if args.detach:
                    return 0
                with trio.move_on_after(args.timeout) as bound:
                    failure: DurableTrioError | None = None
                    async with trio.open_nursery() as nursery:
                        # An existing run (``runs retry`` reopened it, its engine died) is
                        # driven here if nobody drives it; a live engine's keeps it.
                        nursery.start_soon(_take_over_forever, engine, run_id)
                        try:
                            outcome["output"] = await engine.result(run_id)
                        except DurableTrioError as exc:  # (RunFailed...) raised bare, below
                            failure = exc
                        nursery.cancel_scope.cancel()
                    if failure is not None:
                        raise failure
                if bound.cancelled_caught:
                    outcome["waiting"] = await _waiting_lines(engine, run_id)
                    raise trio.TooSlowError
        return 0 if stop.signum is None or "output" in outcome else 128 + stop.signum

    try:
        status = _interrupted(drive)
    except RunFailed as exc:
        print(json.dumps({"runId": exc.run_id, "status": "failed", "error": exc.error}))
        return 1
    except trio.TooSlowError:
        print(
            visible(f"run {outcome.get('run_id')} did not finish in {args.timeout} s"),
            file=sys.stderr,
        )
        for line in outcome.get("waiting", ()):
            print(f"  {visible(line)}", file=sys.stderr)
        return 3
    except DurableTrioError as exc:
        print(visible(f"error: {exc}"), file=sys.stderr)
        return 2
    if status:  # interrupted: say which run, so it can be found (an engine drives it on)
        print(json.dumps({"runId": outcome["run_id"], "status": "interrupted"}))
        return status
    if args.detach:
        print(json.dumps({"runId": outcome["run_id"], "status": "pending"}))
    else:
        print(
            json.dumps(
                {"runId": outcome["run_id"], "status": "completed", "output": outcome["output"]}
            )
        )
    return 0


def add_engine_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``worker``, ``engine`` and ``run`` to ``durable-trio``'s sub-commands (each handler
    is stored as ``func`` and returns the exit status)."""

    def common(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("target", metavar="MODULE:app", help="the App, e.g. shop.flows:app")
        parser.add_argument(
            "--backend",
            default=_default_backend(),
            help=f"backend URL (default: $DURABLE_TRIO_BACKEND or {DEFAULT_BACKEND})",
        )
        parser.add_argument(
            "--namespace",
            help="transport namespace (default: $DURABLE_TRIO_NAMESPACE, else the app's name)",
        )

    def thresholds(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--stalled-threshold",
            type=float,
            help="seconds before a silent claim is taken back (120)",
        )
        parser.add_argument(
            "--stalled-check-interval", type=float, help="seconds between stalled sweeps (30)"
        )
        parser.add_argument(
            "--dead-worker-threshold",
            type=float,
            help="seconds before the claims of a worker whose liveness is gone are taken back (40)",
        )

    worker = subparsers.add_parser("worker", help="serve an app's steps")
    common(worker)
    worker.add_argument("--concurrency", type=int, default=8, help="steps at once (default 8)")
    worker.add_argument(
        "--processes",
        default="1",
        help="worker processes under a supervisor that restarts a dead one ('auto': one per "
        "core; default 1: this process serves, no supervisor)",
    )
    worker.add_argument(
        "--threads",
        type=int,
        default=8,
        help="threads for sync (def) steps, per process (default 8)",
    )
    worker.add_argument(
        "--close-timeout",
        type=float,
        help="seconds running steps get to finish on SIGTERM (default 5)",
    )
    worker.add_argument("--instance-id", help="this worker's instance id (default: random)")
    thresholds(worker)
    worker.set_defaults(func=_cmd_worker)

    engine = subparsers.add_parser("engine", help="drive an app's workflows")
    common(engine)
    engine.add_argument(
        "--engine-id",
        help="a stable id: a restarted engine takes its runs back at once (one process per id)",
    )
    engine.add_argument(
        "--serve-tenants",
        action="store_true",
        help="also be the control plane of store-less tenant pods (docs/remote.md)",
    )
    thresholds(engine)
    engine.set_defaults(func=_cmd_engine)

    run = subparsers.add_parser("run", help="start a workflow run and print its result as JSON")
    common(run)
    run.add_argument("workflow", help="the workflow name")
    run.add_argument(
        "input_json", nargs="?", metavar="INPUT", help="the run's input, as JSON (or --input)"
    )
    run.add_argument("--input", help="the run's input, as JSON (null when neither is given)")
    run.add_argument("--run-id", help="the run's id (starting an existing id is a no-op)")
    run.add_argument(
        "--detach", action="store_true", help="only record the run; a running engine drives it"
    )
    run.add_argument(
        "--with-worker", action="store_true", help="also serve the app's steps in this process"
    )
    run.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for the result (300)"
    )
    run.add_argument(
        "--tag", action="append", metavar="KEY=VALUE", help="a tag of the run (repeatable)"
    )
    run.add_argument(
        "--dedup-key", help="start nothing while the run of this key is unfinished: its id"
    )
    run.add_argument(
        "--debounce", metavar="KEY", help="fold into the debounced start of KEY (--detach)"
    )
    run.add_argument("--debounce-delay", type=float, metavar="SECONDS", help="its delay")
    run.add_argument("--debounce-max-wait", type=float, metavar="SECONDS", help="its max wait")
    run.set_defaults(func=_cmd_run)
