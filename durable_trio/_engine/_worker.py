"""``open_worker``: serve an app's steps through a queue transport.

Each registered step ``async def charge(order: dict) -> dict`` becomes a transport handler
that calls it with the task's input, inside:

- :func:`step_info` (a context variable): run id, step id, attempt, idempotency key, and
  ``heartbeat()`` (the step's beats, see ``durable_trio._transport._step_beats``);
- a cancel scope a ``cancel`` control message for the step's run cancels (best-effort: control
  is point-to-point, so with several workers only the one that takes the message acts);
- the step's :class:`Retry`: an exception of one of its ``non_retryable`` types is reported as
  non-retryable (the run does not wait for attempts that cannot help).

A plain ``def`` step runs in a thread (``trio.to_thread.run_sync``) under the worker's
``threads`` limiter; one registered with ``cpu=True`` in a ``trio-parallel`` worker process
under a limiter of one per core. A thread cannot be cancelled: a cancel (a ``cancel`` message,
a timeout, the close after ``close_timeout``) abandons it — the handler ends at once as any
cancelled step does (handed back, or failed ``cancelled``) while the thread runs to its end in
the background and its result is dropped. A process-pool call is really stopped: its worker
process is killed (``kill_on_cancel``). See ``docs/concurrency.md``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio

from .._errors import BrokerError
from .._transport._facade import open_queue_transport
from .._transport._step_beats import current_beats
from ..brokers import SupportsQueueLimits, SupportsRateLimits
from . import _snapshots as snapshots  # (statistics(): its class on first use)
from ._app import ConcurrencyKeyError
from ._context import _CURRENT_STEP, StepInfo
from ._payloads import signature_of, structure_as, to_json, unstructure_as
from ._stream import LazyStore, emitter_of, serving, store_opener

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from .._transport._facade import QueueTransport
    from .._wire import ControlMessage, RemoteTask
    from ..backends._backend import Backend
    from ._app import App, StepDefinition

__all__ = ["Worker", "open_worker"]

#: A per-key rate's job is handed back for at least this long when its key is past the rate
#: (the broker's answer is exact; this only bounds the round trips of a rounding to 0).
_GATE_MIN_WAIT = 0.001
#: ... and for this long when the broker could not be asked (no start known taken).
_GATE_RETRY = 1.0


class _StepCancelled(Exception):
    """A step stopped by a ``cancel`` control message for its run (not worth retrying)."""

    retryable = False
    code = "cancelled"


class _RunCancelledStep(_StepCancelled):
    """A step stopped because its run was cancelled: what was asked for, not an error (the
    transport logs it at INFO instead of reporting it through the error hook)."""

    quiet = True


def _classify(exc: Exception, definition: StepDefinition) -> None:
    """Tell the transport (which reads ``retryable`` and ``code`` off the exception) what kind
    of failure ``exc`` is, without disturbing attributes the exception already has."""
    retry = definition.retry
    if retry is not None and retry.is_non_retryable(exc):
        with contextlib.suppress(AttributeError):  # an exception type with __slots__
            exc.retryable = False  # type: ignore[attr-defined]
    if not hasattr(exc, "code"):
        with contextlib.suppress(AttributeError):
            exc.code = type(exc).__name__  # type: ignore[attr-defined]


class Worker:
    """Serves an app's steps. Open one with :func:`open_worker`.

    Attributes:
        app: the app whose steps it serves.
        transport: its queue transport.
    """

    def __init__(
        self,
        app: App,
        transport: QueueTransport,
        threads: int = 8,
        streams: LazyStore | None = None,
    ) -> None:
        self.app = app
        self.transport = transport
        self.streams = streams if streams is not None else LazyStore(None)
        """The run store its steps' emits append to (opened at the first emit)."""
        self.threads = trio.CapacityLimiter(threads)
        """Bounds the ``def`` steps running in threads at once."""
        self.cpu_processes = trio.CapacityLimiter(os.cpu_count() or 1)
        """Bounds the ``cpu=True`` steps running in worker processes at once."""
        self._scopes: dict[str, set[trio.CancelScope]] = {}
        self._attempts: dict[tuple[str, str, int], trio.CancelScope] = {}
        """The scope of each running attempt (a heartbeat-timeout failover stops it)."""
        self._running = 0
        self._executed = 0
        self._succeeded = 0
        self._failed = 0
        self._cancelled = 0

    def statistics(self) -> snapshots.WorkerStatistics:
        """A snapshot of the worker's counters."""
        return snapshots.WorkerStatistics(
            running=self._running,
            executed=self._executed,
            succeeded=self._succeeded,
            failed=self._failed,
            cancelled=self._cancelled,
        )

    def _call(self, definition: StepDefinition) -> Callable[[Any], Awaitable[Any]]:
        """``definition.fn`` as an ``async`` call, in a thread or process for a ``def``."""
        fn: Any = definition.fn
        if definition.runs_in == "thread":

            async def in_thread(value: Any) -> Any:
                # the thread sees step_info() (the context is copied), as an async step does
                call = functools.partial(contextvars.copy_context().run, fn, value)
                return await trio.to_thread.run_sync(
                    call, limiter=self.threads, abandon_on_cancel=True
                )

            return in_thread
        if definition.runs_in == "process":
            import trio_parallel

            async def in_process(value: Any) -> Any:
                return await trio_parallel.run_sync(
                    fn, value, kill_on_cancel=True, limiter=self.cpu_processes
                )

            return in_process
        return fn  # type: ignore[no-any-return]

    @staticmethod
    async def _typed(
        definition: StepDefinition, fn: Callable[[Any], Awaitable[Any]], value: Any
    ) -> Any:
        """``fn`` called with ``value`` structured into the step's input annotation; its output
        unstructured into JSON (docs/engine.md, "Typed payloads")."""
        signature = signature_of(definition.fn, 0)
        if signature.plain:
            return to_json(await fn(value))  # (no messages formatted for every step)
        what = f"step {definition.name!r}"
        output = await fn(structure_as(value, signature.input, f"the input of {what}"))
        return unstructure_as(output, signature.output, f"the output of {what}")

    def _serve(self, definition: StepDefinition, rate: SupportsRateLimits | None) -> None:
        fn = self._call(definition)
        per_key = rate is not None and definition.rate_per_key
        queue = self.transport.names.task_queue(definition.name)

        async def gate(task: RemoteTask) -> float | None:
            """A per-key rate: one start of the job's key, or the seconds until one fits
            (the transport hands the job back to the broker for that long)."""
            assert rate is not None
            try:
                key = definition.key_for(task.input)
            except ConcurrencyKeyError:
                return None  # (the handler fails it, not retryable)
            try:
                grant = await rate.take_starts(queue, 1, key=key)
            except BrokerError:
                return _GATE_RETRY  # (a start not known taken: the job waits, the rate holds)
            return None if grant.granted else max(grant.retry_after, _GATE_MIN_WAIT)

        async def handle(task: RemoteTask) -> Any:
            if per_key:
                definition.key_for(task.input)  # (raises ConcurrencyKeyError: not retryable)
            info = StepInfo(
                task.run_id,
                task.step_id,
                task.attempt,
                task.name,
                "remote",
                task.last_heartbeat,
                current_beats(),
                emitter_of(self.streams.get, task.run_id, task.step_id, task.attempt),
            )
            token = _CURRENT_STEP.set(info)
            scopes = self._scopes.setdefault(task.run_id, set())
            scope = trio.CancelScope()
            scopes.add(scope)
            attempt = (task.run_id, task.step_id, task.attempt)
            self._attempts[attempt] = scope
            self._running += 1
            self._executed += 1
            try:
                with scope:
                    try:
                        output = await self._typed(definition, fn, task.input)
                    except Exception as exc:
                        self._failed += 1
                        _classify(exc, definition)
                        raise
                    self._succeeded += 1
                    return output
                self._cancelled += 1
                if self._attempts.get(attempt) is not scope:  # taken out by cancel-step
                    raise _StepCancelled(
                        f"attempt {task.attempt} of step {task.step_id!r} of run "
                        f"{task.run_id!r} was failed over by the engine (heartbeat timeout)"
                    )
                raise _RunCancelledStep(f"run {task.run_id!r} was cancelled")
            finally:
                self._running -= 1
                scopes.discard(scope)
                if self._attempts.get(attempt) is scope:
                    del self._attempts[attempt]
                if not scopes:
                    self._scopes.pop(task.run_id, None)
                _CURRENT_STEP.reset(token)

        if per_key:
            self.transport.handle(definition.name, handle, gate=gate)
        else:
            self.transport.handle(definition.name, handle, rate=rate)

    async def _on_control(self, message: ControlMessage) -> None:
        if message.action == "cancel" and message.run_id is not None:
            for scope in self._scopes.get(message.run_id, ()):
                scope.cancel()
        elif message.action == "cancel-step" and isinstance(message.data, dict):
            # An attempt the engine failed over (heartbeat timeout): its result would be stale.
            attempt = (message.run_id, message.step_id, message.data.get("attempt"))
            found = self._attempts.pop(attempt, None)  # type: ignore[arg-type]
            if found is not None:
                found.cancel()
        await trio.lowlevel.checkpoint()


@asynccontextmanager
async def open_worker(
    app: App,
    backend: Backend,
    *,
    concurrency: int = 8,
    threads: int = 8,
    steps: list[str] | None = None,
    workflows: list[str] | None = None,
    turn_limit: float = 3600.0,
    tenant_pod: bool = False,
    **transport_options: Any,
) -> AsyncIterator[Worker]:
    """Serve ``app``'s steps — and the turns of its remote workflows — over ``backend`` until
    the block is left (then close gracefully: running steps get ``close_timeout`` to finish,
    the rest are handed back at once).

    Args:
        app: whose steps.
        backend: from :func:`~durable_trio.open_backend`.
        concurrency: steps (and workflow turns) running at once in this worker.
        threads: plain ``def`` steps running in threads at once (each also holds one of
            ``concurrency``); ``cpu=True`` steps use a pool of one process per core.
        steps: serve only these step names (default: all of the app's).
        workflows: serve the turns of only these remote workflows (default: every workflow
            the app registers with ``remote=True`` and its code; ``[]``: none).
        turn_limit: seconds a remote workflow's turn may run (its local steps included) before
            its run fails with ``TurnTimeout`` — workflow code that awaits anything but ``ctx``
            calls would otherwise hold the turn forever.
        tenant_pod: this worker runs in a store-less tenant pod (a backend with no key store):
            its liveness and descriptor are forwarded to the control plane, which records them
            (T22, docs/spec.md), so the control plane's ``health.group_health`` sees it.
        **transport_options: :func:`~durable_trio.open_queue_transport` options; ``namespace``
            defaults to the app's name.

    Raises:
        ConfigError: an option that cannot work, or an unknown step name in ``steps``.
    """
    from .._errors import ConfigError

    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"threads must be a positive integer, got {threads!r}")
    if any(app.steps[n].runs_in == "process" for n in (steps or app.steps) if n in app.steps):
        try:
            import trio_parallel  # noqa: F401
        except ImportError as exc:
            raise ConfigError(
                "cpu=True steps need trio-parallel (pip install 'durable_trio[cpu]')"
            ) from exc
    if not (isinstance(turn_limit, int | float) and turn_limit > 0):
        raise ConfigError(f"turn_limit must be a positive number of seconds, got {turn_limit!r}")
    names = list(app.steps) if steps is None else steps
    unknown = [name for name in names if name not in app.steps]
    if unknown:
        raise ConfigError(f"app {app.name!r} has no step(s) {', '.join(map(repr, unknown))}")
    served = (
        [n for n, w in app.workflows.items() if w.remote and w.fn is not None]
        if workflows is None
        else workflows
    )
    for name in served:
        definition = app.workflows.get(name)
        if definition is None or not definition.remote or definition.fn is None:
            raise ConfigError(
                f"app {app.name!r} has no remote workflow {name!r} with its code "
                "(register it with @app.workflow(name, remote=True))"
            )
    limits = _step_limits(app, names, backend.broker)
    rates = _step_rates(app, names, backend.broker)
    transport_options.setdefault("namespace", app.name)
    namespace = transport_options["namespace"]
    streams = LazyStore(None if tenant_pod else store_opener(backend, namespace))
    async with (
        serving(streams),  # outlives the transport: steps closing still emit
        open_queue_transport(backend, concurrency=concurrency, **transport_options) as transport,
    ):
        if tenant_pod:
            transport.remote.use_tenant_role()
        if limits is not None:
            for name in names:  # before any claim: each served step's limit, or none
                step = app.steps[name]
                await limits.set_queue_limit(
                    transport.names.task_queue(name),
                    step.max_concurrency,
                    per_key=step.concurrency_key is not None,
                )
        if rates is not None:
            for name in names:  # before any claim: each served step's rate, or none
                rate = app.steps[name].rate_limit
                await rates.set_queue_rate(
                    transport.names.task_queue(name),
                    None if rate is None else rate.count,
                    1.0 if rate is None else rate.per,
                    per_key=rate is not None and rate.key is not None,
                )
        worker = Worker(app, transport, threads, streams)
        for name in names:
            worker._serve(
                app.steps[name], rates if app.steps[name].rate_limit is not None else None
            )
        if served:  # remote workflows (docs/engine.md): their turns' code imported for them only
            from ._turn import run_turn
        for name in served:
            transport.remote.handle_workflow(
                name,
                functools.partial(
                    run_turn, app.workflows[name], transport, limit=turn_limit, app=app
                ),
            )
        transport.remote.on_control(worker._on_control)
        yield worker


def _step_limits(app: App, names: list[str], broker: Any) -> SupportsQueueLimits | None:
    """The broker that stores the served steps' fleet-wide limits (``None``: it keeps none,
    and no served step has one).

    Raises:
        ConfigError: a served step has ``max_concurrency`` and the broker cannot enforce it.
    """
    from .._errors import ConfigError

    if isinstance(broker, SupportsQueueLimits):
        return broker
    limited = [name for name in names if app.steps[name].max_concurrency is not None]
    if limited:
        raise ConfigError(
            f"step(s) {', '.join(map(repr, limited))} of app {app.name!r} set max_concurrency, "
            f"but the {type(broker).__name__} broker cannot enforce a fleet-wide limit "
            "(see docs/concurrency.md, \"Fleet-wide limits\", for the brokers that can)"
        )
    return None


def _step_rates(app: App, names: list[str], broker: Any) -> SupportsRateLimits | None:
    """The broker that keeps the served steps' rate limits (``None``: it keeps none, and no
    served step has one).

    Raises:
        ConfigError: a served step has ``rate_limit`` and the broker cannot keep it.
    """
    from .._errors import ConfigError

    if isinstance(broker, SupportsRateLimits):
        return broker
    limited = [name for name in names if app.steps[name].rate_limit is not None]
    if limited:
        raise ConfigError(
            f"step(s) {', '.join(map(repr, limited))} of app {app.name!r} set rate_limit, "
            f"but the {type(broker).__name__} broker cannot keep a rate limit "
            '(see docs/concurrency.md, "Rate limits", for the brokers that can)'
        )
    return None
