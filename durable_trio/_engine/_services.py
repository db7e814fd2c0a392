"""What the engine's drivers get from the engine: :class:`DriverServices`, and the object that
provides it, :class:`EngineServices`.

The drivers (:mod:`._runtime`, :mod:`._remote_run`), the result handler (:mod:`._results`) and
the control plane (:mod:`._control`) depend on this module, never on :mod:`._engine`: the
imports go one way (drivers -> services; the engine facade -> drivers), and the contract
between a driver and the engine is the :class:`DriverServices` Protocol below rather than the
engine's private attributes.

:class:`EngineServices` holds what the pieces share, each table with its one owner, made by
the engine before the services and handed to them at construction: the drivers by run id
(:class:`~._drivers.Drivers`), the steps waited on, the results being applied and the per-run
decision locks (:mod:`._waits`), and what hears of every dispatch (the step watch's checks and
the loss audit's ledger, :class:`DispatchWatch`). The counters are its own. The engine facade
(:class:`~._engine.Engine`) owns one and reports it in :meth:`~._engine.Engine.statistics`.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import attrs
import trio

from .. import _telemetry as telemetry
from .._backoff import Backoff
from .._errors import BrokerError, TransportClosed
from .._logs import get_logger
from .._outages import OutageReports
from .._transport._options import log_error
from .._wire import RemoteTask
from ._counters import COUNTERS
from ._drivers import Driver, Drivers
from ._duplicates import DuplicateLog
from ._errors import EngineError
from ._records import previous_details
from ._step_timeouts import StepTimeouts
from ._stores._wakes import ring

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping, Sequence

    from .._transport._facade import QueueTransport
    from .._transport._options import ErrorHook
    from .._wire import WorkflowTask
    from ._app import App, StepDefinition
    from ._options import EngineOptions
    from ._records import RunRecord, RunStatus, StepRecord
    from ._retry import Retry
    from ._step_timeouts import StepTimeouts as _Timeouts
    from ._stores import RunStore
    from ._waits import Applying, DecisionLocks, StepWaiters

__all__ = [
    "CancelRun",
    "DispatchWatch",
    "Driver",
    "DriverServices",
    "EngineServices",
    "StartRun",
    "UpdateServing",
]

T = TypeVar("T")

#: The delays between two attempts at a store / broker call that failed: 0.05 s, doubling, at
#: most 5 s, no jitter (the engine's calls are few; determinism keeps the simulation's digests).
_GUARD_BACKOFF = Backoff(initial=0.05, maximum=5.0)


class StartRun(Protocol):
    """Starts a child workflow run (``engine.start``, issue 18)."""

    def __call__(self, workflow: str, input: Any, run_id: str, parent: str, /) -> Awaitable[str]:
        """Start run ``run_id`` of ``workflow`` under run ``parent``; returns its id."""


class CancelRun(Protocol):
    """Cancels one run (``engine.cancel`` of that run alone: whoever ends a run's children walks
    the tree itself, :func:`~._children.cancel_children`)."""

    def __call__(self, run_id: str, reason: str, /) -> Awaitable[bool]:
        """Cancel run ``run_id``; whether this call cancelled it."""


class DriverServices(Protocol):
    """What a driver (and the pieces beside it) needs from the engine, and nothing else."""

    @property
    def app(self) -> App:
        """The app whose workflows the engine drives."""

    @property
    def store(self) -> RunStore:
        """The run store."""

    @property
    def options(self) -> EngineOptions:
        """The engine's options."""

    @property
    def default_retry(self) -> Retry:
        """The retry policy of a step that names none (nor does its definition)."""

    @property
    def waiters(self) -> StepWaiters:
        """The remote steps this engine's drivers wait on (their one owner)."""

    @property
    def applying(self) -> Applying:
        """Steps whose result the engine is applying now (their one owner)."""

    @property
    def decision_locks(self) -> DecisionLocks:
        """Remote runs whose decisions are being applied here (their one owner)."""

    @property
    def drivers(self) -> Mapping[str, Driver]:
        """The drivers of the runs this engine drives, by run id."""

    @property
    def start_run(self) -> StartRun:
        """Starts a child workflow run."""

    @property
    def update_desk(self) -> UpdateServing:
        """Starts the runs' update serving when needed (._update_desk)."""

    @property
    def cancel_run(self) -> CancelRun:
        """Cancels one run."""

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``name`` (one of :data:`~._counters.COUNTERS`)."""

    def report(self, exc: BaseException) -> None:
        """Hand ``exc`` to the error hook (a broken hook is logged, never raised)."""

    async def guard(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """``await call()``, retried with a backoff while the store or broker fails."""

    def step_definition(self, name: str) -> StepDefinition | None:
        """The app's definition of step ``name``, if it registers one."""

    def retry_for(self, name: str, override: Retry | None) -> Retry:
        """The retry policy of step ``name``: ``override``, the step's own, or the default."""

    def rng_for(self, record: StepRecord) -> random.Random | None:
        """The random source of ``record``'s retry jitter (``None``: unseeded)."""

    async def sleep_until(self, at: float) -> None:
        """Sleep until store-clock time ``at``."""

    def add_listener(self, listener: Callable[[str, RunRecord], None]) -> None:
        """Call ``listener(kind, run)`` whenever a run starts or settles."""

    def run_event(self, kind: str, run: RunRecord) -> None:
        """Tell the listeners that ``run`` started or settled."""

    async def settle(
        self, run: RunRecord, status: RunStatus, *, output: Any = None, error: Any = None
    ) -> RunRecord | None:
        """Settle ``run`` (first settle wins); ``None`` if it was settled already."""

    def forget(self, driver: Driver) -> None:
        """``driver`` stopped: it no longer drives its run."""

    async def dispatch(self, record: StepRecord, delay: float) -> None:
        """Send ``record``'s current attempt to the workers, then checkpoint that it landed."""

    async def dispatch_turn(self, task: WorkflowTask) -> None:
        """Send a remote workflow's turn to its workflow workers."""


class DispatchWatch(Protocol):
    """What the engine's step watch (:mod:`._step_watch`) hears of every dispatch."""

    def dispatched(
        self, record: StepRecord, timeouts: _Timeouts, job_id: str, delay: float
    ) -> None:
        """``record``'s current attempt went out as job ``job_id``, ready after ``delay``."""


class UpdateServing(Protocol):
    """When a run's updates begin to be served (the engine's :mod:`._update_desk`)."""

    def begin(self, servant: Any) -> None:
        """``servant``'s driver begins (its updates served now, or once a request may have
        come)."""

    def end(self, servant: Any) -> None:
        """``servant``'s driver ended: its serving stops."""


class EngineServices:
    """The engine's shared state and the services its pieces use (satisfies
    :class:`DriverServices`). Made by the engine, one per engine.

    Attributes:
        app: the app whose workflows the engine drives.
        store: the run store.
        transport: the queue transport (tasks out).
        options: the engine's options.
        default_retry: ``options.default_retry``.
        counters: the statistics counters, every one present from the start.
        drivers: the drivers of the runs this engine drives, by run id (their one owner).
        waiters: the remote steps waited on (their one owner).
        applying: the steps whose result is being applied here (their one owner).
        decision_locks: remote runs whose decisions are being applied here (their one owner).
        start_run: starts a child workflow run.
        cancel_run: cancels one run (a driver ending its children, or a child met under a
            cancelled parent, walks the tree itself: ``cancel_children``).
        update_desk: starts the runs' update serving when needed (._update_desk).
        duplicates: the duplicate completed results met, with their causes.

    Args:
        dispatch_watches: what hears of every dispatch, in this order (the step watch's
            checks, the loss audit's ledger).
    """

    def __init__(
        self,
        app: App,
        store: RunStore,
        transport: QueueTransport,
        options: EngineOptions,
        on_error: ErrorHook,
        drivers: Drivers,
        waiters: StepWaiters,
        applying: Applying,
        decision_locks: DecisionLocks,
        *,
        start_run: StartRun,
        cancel_run: CancelRun,
        dispatch_watches: Sequence[DispatchWatch],
        update_desk: UpdateServing,
    ) -> None:
        self.app = app
        self.store = store
        self.transport = transport
        self.options = options
        self.default_retry = options.default_retry
        self._on_error = on_error
        # A misspelt counter name is a KeyError, not a new counter.
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.drivers = drivers
        self.waiters = waiters
        self.applying = applying
        self.decision_locks = decision_locks
        self.adopted: set[str] = set()
        """Runs this engine took over by reconcile (started elsewhere, detached, or left by
        another engine): settling one rings its id, for a caller waiting in another process."""
        self.duplicates = DuplicateLog()
        self.outages = OutageReports(get_logger("durable_trio.engine"))
        """The guard's reports of a failing store or broker, folded while it stays down."""
        self._listeners: list[Callable[[str, RunRecord], None]] = []
        self.start_run = start_run
        self.cancel_run = cancel_run
        self.update_desk = update_desk
        self._dispatch_watches = tuple(dispatch_watches)
        # A store whose clock is trio's (the memory store, or a wrapper of it that says so)
        self._trio_clock = bool(getattr(store, "trio_clock", False))

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def report(self, exc: BaseException) -> None:
        try:
            self._on_error(exc)
        except Exception:  # a broken hook must not take a loop down with it
            log_error(exc)

    async def guard(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """``await call()``, retried with a backoff while the store or broker fails.

        Transient backend errors never reach workflow code (which would fail the run for an
        infrastructure hiccup): they are reported and the call retried until it succeeds or
        the run's driver is cancelled. While many runs' calls fail alike (an outage), the
        reports are folded (:class:`~durable_trio._outages.OutageReports`).
        """
        failures = 0
        while True:
            try:
                value = await call()
            except (BrokerError, TransportClosed) as exc:
                failures += 1
                delay = _GUARD_BACKOFF.delay(failures)
                folded = self.outages.failed(what)
                if folded is None:
                    self.count("reports_folded")
                else:
                    report = EngineError(
                        f"{what} failed (retrying in {delay:.2f} s): {exc}{folded}"
                    )
                    report.__cause__ = exc
                    self.report(report)
            else:
                if failures:
                    self.outages.succeeded(what)
                return value
            await trio.sleep(delay)

    def step_definition(self, name: str) -> StepDefinition | None:
        return self.app.steps.get(name)

    def workflow_of(self, run_id: str) -> str | None:
        """The workflow of a run this engine drives (``None``: driven elsewhere)."""
        driver = self.drivers.get(run_id)
        return None if driver is None else driver.run.workflow

    def retry_for(self, name: str, override: Retry | None) -> Retry:
        if override is not None:
            return override
        step = self.app.steps.get(name)
        if step is not None and step.retry is not None:
            return step.retry
        return self.default_retry

    def rng_for(self, record: StepRecord) -> random.Random | None:
        seed = self.options.seed
        if seed is None:
            return None
        return random.Random(f"{seed}:{record.run_id}:{record.step_id}:{record.attempt}")

    async def sleep_until(self, at: float) -> None:
        """Sleep until store-clock time ``at``."""
        if self._trio_clock:  # the memory store's clock IS trio's: wake at exactly ``at``
            await trio.sleep_until(at)
        else:
            await trio.sleep(max(0.0, at - self.store.now()))

    def add_listener(self, listener: Callable[[str, RunRecord], None]) -> None:
        self._listeners.append(listener)

    def run_event(self, kind: str, run: RunRecord) -> None:
        """Tell the listeners that ``run`` started or settled (``kind``: ``started``,
        ``completed``, ``failed``, ``cancelled``), and the logs and telemetry
        (docs/observability.md). Listeners must not block."""
        telemetry.run_event(kind, run)
        for listener in list(self._listeners):
            try:
                listener(kind, run)
            except Exception as exc:  # a broken listener must not take a run down
                self.report(exc)

    async def settle(
        self, run: RunRecord, status: RunStatus, *, output: Any = None, error: Any = None
    ) -> RunRecord | None:
        """Settle ``run`` (first settle wins), count it and tell the listeners.

        Returns:
            The run as settled by this call, or ``None`` (it was already settled).
        """
        settled = await self.guard(
            lambda: self.store.finish_run(run.run_id, status, output=output, error=error),
            "settling a run",
        )
        if run.run_id in self.adopted:
            self.adopted.discard(run.run_id)
            store = self.store
            if settled:
                # Started elsewhere: its caller's ``engine.result`` waits on this ring, not on
                # its poll (issue 30, item 1).
                await ring(store, run.run_id)
        if not settled:
            return None
        now = self.store.now()
        final = attrs.evolve(
            run,
            status=status,
            output=output,
            error=error,
            owner=None,
            lease_until=None,
            updated_at=now,
        )
        self.count(f"runs_{status.value}")
        self.run_event(status.value, final)
        return final

    def forget(self, driver: Driver) -> None:
        if self.drivers.get(driver.run.run_id) is driver:
            self.adopted.discard(driver.run.run_id)
        self.drivers.forget(driver)

    async def dispatch(self, record: StepRecord, delay: float) -> None:
        """Send ``record``'s current attempt to the workers, then record that it landed.

        Raises:
            PayloadError: the task cannot be sent (no retry can help).
        """
        timeouts = StepTimeouts.of_record(record)
        step = self.app.steps.get(record.name)
        # Its concurrency key (raises ConcurrencyKeyError, a PayloadError: the step fails).
        key = None if step is None else step.key_for(record.input)
        task = RemoteTask(
            run_id=record.run_id,
            step_id=record.step_id,
            attempt=record.attempt,
            name=record.name,
            input=record.input,
            priority=record.priority,
            timeout=timeouts.timeout,
            heartbeat_timeout=record.heartbeat_timeout,
            last_heartbeat=previous_details(record),
            max_attempts=_max_attempts(record.retry),
        )
        with telemetry.dispatching(record.run_id):  # the job carries the run's trace context
            job_id = await self.guard(
                lambda: self.transport.dispatch(task, delay=delay, concurrency_key=key),
                "dispatching",
            )
        self.count("steps_dispatched")
        telemetry.step_dispatched(record, self.workflow_of(record.run_id), job_id)
        for watch in self._dispatch_watches:
            watch.dispatched(record, timeouts, job_id, delay)
        await self.guard(
            lambda: self.store.mark_dispatched(record.run_id, record.step_id, record.attempt),
            "checkpointing a dispatch",
        )

    async def dispatch_turn(self, task: WorkflowTask) -> None:
        """Send a remote workflow's turn (retried while the broker fails).

        Raises:
            PayloadError: the turn cannot be sent (its history is too large).
        """
        await self.guard(
            lambda: self.transport.remote.dispatch_workflow_task(task),
            "dispatching a workflow turn",
        )


def _max_attempts(policy: Any) -> int | None:
    """The attempts a stored policy (:meth:`Retry.to_json`) allows, for the task's log level."""
    value = policy.get("maxAttempts") if isinstance(policy, dict) else None
    return value if type(value) is int and value >= 1 else None
