"""The engine: drives workflow runs, applies step results, reconciles after crashes.

::

    engine (root nursery, lives as long as the ``async with``)
    ├── runs          one RunDriver task per run this engine drives (see ._runtime)
    ├── lease keeper  renews this engine's run leases every run_lease / 3
    ├── reconcile     takes over runs nobody drives (dead engine, released, detached starts)
    └── watch         re-reads the checkpoints its runs wait on (results applied elsewhere)
    (the transport's results loop calls Engine._on_result)

Idempotent application: a result is applied by compare-and-set on its checkpoint (still
pending, at the result's attempt, run unfinished). Anything else — a duplicate delivery, a
result for an attempt already retried, a result for a finished run — changes nothing and is
counted (:meth:`Engine.statistics`).
"""

from __future__ import annotations

# A real import, not a TYPE_CHECKING one: ``Engine.list`` shadows the builtin inside the class
# body, so its annotations spell the type ``builtins.list``, which ``typing.get_type_hints``
# (and anything built on it) must resolve at run time.
import builtins  # noqa: TC003
import math
import random
import uuid
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import trio

from .._errors import BrokerError, DurableTrioError, TransportClosed
from .._options import log_error
from .._wire import (
    ControlMessage,
    RemoteTask,
    StepError,
    StepEvent,
    StepHeartbeat,
    StepResult,
    StepStatus,
    WorkflowDecision,
)
from ._errors import (
    EngineClosed,
    EngineError,
    RunCancelled,
    RunFailed,
    RunNotFound,
    UnknownWorkflow,
)
from ._options import EngineOptions
from ._records import (
    Applied,
    RunRecord,
    RunStatus,
    StepKind,
    StepRecord,
    StepState,
    error_to_json,
    normalize_json,
)
from ._remote_run import RemoteRunDriver, apply_decision, apply_step_event
from ._retry import Retry, StoredRetry
from ._runtime import RunDriver, StepWaiter, describe_error, send_step
from ._statistics import COUNTERS, EngineStatistics

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .._options import ErrorHook
    from .._transport import QueueTransport
    from ._app import App, StepDefinition
    from ._stores import RunStore

__all__ = ["Engine", "EngineOptions", "EngineStatistics"]

T = TypeVar("T")

#: Runs claimed per store call by reconcile (it loops while batches come back full).
_CLAIM_BATCH = 100
#: First and largest delay between two attempts at a store / broker call that failed.
_GUARD_BACKOFF = (0.05, 5.0)


_VERDICT_COUNTER = {
    Applied.APPLIED: "results_applied",
    Applied.DUPLICATE: "duplicate_results",
    Applied.STALE: "stale_results",
    Applied.MISSING: "orphan_results",
    Applied.RUN_FINISHED: "orphan_results",
}


class Engine:
    """Drives an app's workflows. Open one with :func:`open_engine`.

    Attributes:
        app: the app whose workflows it drives.
        store: its run store.
        transport: its queue transport (results in, tasks out).
        engine_id: its owner id on the runs it drives.
    """

    def __init__(
        self,
        app: App,
        store: RunStore,
        transport: QueueTransport,
        options: EngineOptions,
        on_error: ErrorHook,
    ) -> None:
        self.app = app
        self.store = store
        self.transport = transport
        self.options = options
        self.engine_id = options.engine_id
        self.default_retry = options.default_retry
        self._on_error = on_error
        self._drivers: dict[str, RunDriver | RemoteRunDriver] = {}
        self._waiters: dict[tuple[str, str], StepWaiter] = {}
        self._applying: dict[tuple[str, str], trio.Event] = {}
        self._decision_locks: dict[str, trio.Lock] = {}
        """Remote runs whose decisions are being applied (one at a time per run)."""
        """Steps whose result this engine is applying now (checkpoint, then retry dispatch)."""
        # Every counter present from the start: a misspelt name is a KeyError, not a new one.
        self._counters = dict.fromkeys(COUNTERS, 0)
        # A store whose clock is trio's (the memory store, or a wrapper of it that says so)
        self._trio_clock = bool(getattr(store, "trio_clock", False))
        self._runs: trio.Nursery | None = None
        self._loops: trio.Nursery | None = None
        self._closing = False
        self._unreleased: set[str] = set()
        """Runs whose driver stopped unsettled without this engine asking it to (a cancel from
        outside ``open_engine``): still owned here, so ``aclose`` releases them."""
        self._spawned = trio.Event()
        """Set (and replaced) whenever a driver starts: wakes ``result`` pollers."""
        self._listeners: builtins.list[Callable[[str, RunRecord], None]] = []
        """Run lifecycle listeners (the control plane's tenant events)."""

    # ------------------------------------------------------------------ services for drivers

    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] += n

    def _report(self, exc: BaseException) -> None:
        try:
            self._on_error(exc)
        except Exception:  # a broken hook must not take a loop down with it
            log_error(exc)

    async def _guard(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """``await call()``, retried with a backoff while the store or broker fails.

        Transient backend errors never reach workflow code (which would fail the run for an
        infrastructure hiccup): they are reported and the call retried until it succeeds or
        the run's driver is cancelled.
        """
        delay, largest = _GUARD_BACKOFF
        while True:
            try:
                return await call()
            except (BrokerError, TransportClosed) as exc:
                report = EngineError(f"{what} failed (retrying in {delay:.2f} s): {exc}")
                report.__cause__ = exc
                self._report(report)
            await trio.sleep(delay)
            delay = min(delay * 2, largest)

    def _step_definition(self, name: str) -> StepDefinition | None:
        return self.app.steps.get(name)

    def _retry_for(self, name: str, override: Retry | None) -> Retry:
        if override is not None:
            return override
        step = self.app.steps.get(name)
        if step is not None and step.retry is not None:
            return step.retry
        return self.default_retry

    def _rng_for(self, record: StepRecord) -> random.Random | None:
        seed = self.options.seed
        if seed is None:
            return None
        return random.Random(f"{seed}:{record.run_id}:{record.step_id}:{record.attempt}")

    async def _sleep_until(self, at: float) -> None:
        """Sleep until store-clock time ``at``."""
        if self._trio_clock:  # the memory store's clock IS trio's: wake at exactly ``at``
            await trio.sleep_until(at)
        else:
            await trio.sleep(max(0.0, at - self.store.now()))

    def _watch(self, key: tuple[str, str]) -> StepWaiter:
        waiter = self._waiters.get(key)
        if waiter is None:
            waiter = self._waiters[key] = StepWaiter()
        return waiter

    def _unwatch(self, key: tuple[str, str], waiter: StepWaiter) -> None:
        if self._waiters.get(key) is waiter:
            del self._waiters[key]

    def _run_event(self, kind: str, run: RunRecord) -> None:
        """Tell the listeners that ``run`` started or settled (``kind``: ``started``,
        ``completed``, ``failed``, ``cancelled``). Listeners must not block."""
        for listener in list(self._listeners):
            try:
                listener(kind, run)
            except Exception as exc:  # a broken listener must not take a run down
                self._report(exc)

    async def _settle(
        self, run: RunRecord, status: RunStatus, *, output: Any = None, error: Any = None
    ) -> RunRecord | None:
        """Settle ``run`` (first settle wins), count it and tell the listeners.

        Returns:
            The run as settled by this call, or ``None`` (it was already settled).
        """
        settled = await self._guard(
            lambda: self.store.finish_run(run.run_id, status, output=output, error=error),
            "settling a run",
        )
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
        self._count(f"runs_{status.value}")
        self._run_event(status.value, final)
        return final

    def _forget(self, driver: RunDriver | RemoteRunDriver) -> None:
        run_id = driver.run.run_id
        if self._drivers.get(run_id) is driver:
            del self._drivers[run_id]
            # A cancel from around open_engine reaches the drivers before (or while) aclose
            # runs: what aclose must release is kept here, not lost with the driver. Not a
            # driver this engine stopped itself (a lost lease, a cancelled run, aclose: its run
            # is owned elsewhere, settled, or on aclose's list), nor one that ended without a
            # cancel (its run settled elsewhere): only those still under a cancel from outside.
            if (
                driver.final is None
                and not driver.scope.cancel_called
                and trio.current_effective_deadline() == -math.inf
            ):
                self._unreleased.add(run_id)

    async def _dispatch(self, record: StepRecord, delay: float) -> None:
        """Send ``record``'s current attempt to the workers, then record that it landed.

        Raises:
            PayloadError: the task cannot be sent (no retry can help).
        """
        task = RemoteTask(
            run_id=record.run_id,
            step_id=record.step_id,
            attempt=record.attempt,
            name=record.name,
            input=record.input,
            priority=record.priority,
        )
        await self._guard(lambda: self.transport.dispatch(task, delay=delay), "dispatching")
        self._count("steps_dispatched")
        await self._guard(
            lambda: self.store.mark_dispatched(record.run_id, record.step_id, record.attempt),
            "checkpointing a dispatch",
        )

    # ------------------------------------------------------------------ result application

    def _next_state(self, current: StepRecord, result: StepResult) -> tuple[StepRecord, float]:
        """The checkpoint after ``result`` (and the retry delay, if it is a retry)."""
        # A result came back, so the attempt was dispatched (whatever the local copy says).
        if result.status is StepStatus.COMPLETED:
            completed = attrs.evolve(
                current, status=StepState.COMPLETED, output=result.output, dispatched=True
            )
            return completed, 0.0
        error = result.error or StepError(message="the step failed without an error")
        policy = StoredRetry.from_json(current.retry)
        if error.retryable and policy.retries_after(current.attempt, error.code):
            delay = policy.policy.delay(current.attempt, rng=self._rng_for(current))
            retry = attrs.evolve(
                current,
                attempt=current.attempt + 1,
                wake_at=self.store.now() + delay,
                dispatched=False,
                error=error_to_json(error),
            )
            return retry, delay
        failed = attrs.evolve(
            current, status=StepState.FAILED, error=error_to_json(error), dispatched=True
        )
        return failed, 0.0

    async def _on_result(self, result: StepResult) -> None:
        """Apply one step result, idempotently (see the module docstring).

        Error handling:
            A store error propagates: the transport hands the result back for redelivery.
        """
        key = (result.run_id, result.step_id)
        waiter = self._waiters.get(key)
        current = waiter.record if waiter is not None else None
        if (
            current is None
            or current.status is not StepState.PENDING
            or current.attempt != result.attempt
        ):
            # The local view may lag behind the store (another engine moved the step on): the
            # store decides.
            current = await self.store.get_step(result.run_id, result.step_id)
        if current is None or current.kind is not StepKind.REMOTE:
            self._count("orphan_results")
            return
        if current.status is not StepState.PENDING:
            self._count("duplicate_results")
            return
        if current.attempt != result.attempt:
            self._count("stale_results")
            if current.attempt == result.attempt + 1 and not current.dispatched:
                # This result's first application checkpointed the retry, then stopped before
                # the retry's dispatch was confirmed (cancelled: its claim's lease lost, T8 of
                # docs/spec.md);
                # the redelivery finishes the job, or nobody would while this engine lives.
                # While that first application is still under way here, wait for it: it may
                # yet dispatch (a duplicated result) or be cancelled (a lost lease).
                applying = self._applying.get(key)
                if applying is not None:
                    await applying.wait()
                    found = await self.store.get_step(result.run_id, result.step_id)
                    if found is None or found.dispatched or found.attempt != current.attempt:
                        return
                    current = found
                self._count("redispatched")
                await send_step(self, current, self._waiters.get(key))
            return
        following, delay = self._next_state(current, result)
        done = self._applying[key] = trio.Event()  # copies arriving meanwhile wait for us
        try:
            verdict = await self.store.update_step(following, expect_attempt=current.attempt)
            self._count(_VERDICT_COUNTER[verdict])
            if verdict is not Applied.APPLIED:
                return
            waiter = self._waiters.get(key)
            if waiter is not None:
                waiter.update(following)
            if following.status is StepState.PENDING:
                self._count("retries")
                try:
                    await self._dispatch(following, delay)
                except DurableTrioError as exc:  # the same task went out before: not expected
                    self._report(exc)
        finally:
            if self._applying.get(key) is done:
                del self._applying[key]
            done.set()

    async def _on_decision(self, decision: WorkflowDecision) -> None:
        await apply_decision(self, decision)

    async def _on_step_event(self, event: StepEvent) -> None:
        await apply_step_event(self, event)

    async def _on_heartbeat(self, beat: StepHeartbeat) -> None:
        """A running remote workflow turn beats: its run's driver waits on."""
        driver = self._drivers.get(beat.run_id)
        if isinstance(driver, RemoteRunDriver) and beat.step_id.startswith("turn:"):
            driver.beat()
        await trio.lowlevel.checkpoint()

    # ------------------------------------------------------------------ background loops

    async def _renew_leases(self) -> None:
        period = self.options.run_lease / 3
        start = trio.current_time()
        tick = 1
        while True:
            await trio.sleep_until(start + tick * period)
            tick += 1
            owned = list(self._drivers)
            if not owned:
                continue
            try:
                kept = await self.store.renew_runs(self.engine_id, owned, self.options.run_lease)
            except BrokerError as exc:
                self._report(exc)
                continue
            for run_id in owned:
                driver = self._drivers.get(run_id)
                if run_id not in kept and driver is not None and not driver.settling:
                    # Taken over (our lease lapsed), or settled elsewhere (cancelled).
                    self._count("lost_runs")
                    driver.scope.cancel()

    async def _reconcile_forever(self, interval: float) -> None:
        start = trio.current_time()
        tick = 1
        while True:
            await trio.sleep_until(start + tick * interval)
            tick += 1
            try:
                await self.reconcile()
            except BrokerError as exc:
                self._report(exc)

    async def _watch_forever(self, interval: float) -> None:
        start = trio.current_time()
        tick = 1
        while True:
            await trio.sleep_until(start + tick * interval)
            tick += 1
            # Only waiters older than a tick: a younger one read the store since.
            older = trio.current_time() - interval
            keys = [
                key for key, w in self._waiters.items() if w.record is not None and w.since <= older
            ]
            if not keys:
                continue
            try:
                records = await self.store.get_steps_many(keys)
            except BrokerError as exc:
                self._report(exc)
                continue
            for key, record in zip(keys, records, strict=True):
                waiter = self._waiters.get(key)
                if waiter is not None and record is not None:
                    waiter.update(record)

    # ------------------------------------------------------------------ lifecycle

    async def _start(self, root: trio.Nursery) -> None:
        self._runs = await root.start(_serve_nursery)
        self._loops = await root.start(_serve_nursery)
        self.transport.on_result(self._on_result)
        if any(w.remote for w in self.app.workflows.values()):
            self.transport.remote.on_decision(self._on_decision)
            self.transport.remote.on_step_event(self._on_step_event)
            self.transport.on_heartbeat(self._on_heartbeat)
        options = self.options
        if options.serve_tenants:
            from ._control import ControlPlane

            ControlPlane(self).attach(self._loops)
        if options.reconcile:
            await self.reconcile(include_own=True)
            if options.reconcile_interval:
                self._loops.start_soon(self._reconcile_forever, options.reconcile_interval)
        self._loops.start_soon(self._renew_leases)
        if options.watch_interval:
            self._loops.start_soon(self._watch_forever, options.watch_interval)

    async def aclose(self) -> None:
        """Stop driving runs, in bounded phases: (1) stop the loops; (2) cancel every run's
        driver where it waits (their checkpoints are already stored); (3) release the runs
        still in flight so another engine takes them over at once (bounded by
        ``cleanup_timeout``). The transport and store close after this, on leaving
        :func:`open_engine`. Idempotent.
        """
        if self._closing:
            await trio.lowlevel.checkpoint()
            return
        self._closing = True
        with trio.CancelScope(shield=True):
            if self._loops is not None:
                self._loops.cancel_scope.cancel()
            in_flight = [*self._drivers, *self._unreleased]
            self._unreleased.clear()
            for driver in list(self._drivers.values()):
                driver.scope.cancel()
            if self._runs is not None:
                self._runs.cancel_scope.cancel()
            with trio.move_on_after(self.options.cleanup_timeout):
                for driver in list(self._drivers.values()):
                    await driver.done.wait()
            if self.options.release_on_close and in_flight:
                with trio.move_on_after(self.options.cleanup_timeout):
                    try:
                        await self.store.release_runs(self.engine_id, in_flight)
                    except BrokerError as exc:
                        self._report(exc)

    def _spawn(
        self, run: RunRecord, history: builtins.list[StepRecord]
    ) -> RunDriver | RemoteRunDriver:
        definition = self.app.workflows[run.workflow]
        driver: RunDriver | RemoteRunDriver
        if definition.remote:
            driver = RemoteRunDriver(self, run, history)
        else:
            driver = RunDriver(self, run, history)
        self._drivers[run.run_id] = driver
        self._spawned.set()
        self._spawned = trio.Event()
        assert self._runs is not None
        self._runs.start_soon(driver.drive, definition, name=f"run {run.run_id}")
        return driver

    # ------------------------------------------------------------------ public API

    async def reconcile(self, *, include_own: bool = False) -> int:
        """Take over runs nobody drives and resume them (replaying their history; their
        attempts whose dispatch was never confirmed are re-dispatched). Runs at start and
        every ``reconcile_interval``; call it to do it now.

        Args:
            include_own: also take runs still owned by this ``engine_id`` (a previous process
                under the same id died) — done once at start.

        Returns:
            How many runs were taken over.
        """
        taken = 0
        while not self._closing:
            claimed = await self.store.claim_runs(
                self.engine_id,
                self.options.run_lease,
                include_own=include_own,
                limit=_CLAIM_BATCH,
            )
            for run in claimed:
                if run.run_id in self._drivers:
                    continue
                if run.workflow not in self.app.workflows:
                    error = describe_error(
                        UnknownWorkflow(f"this engine's app does not register {run.workflow!r}")
                    )
                    await self.store.finish_run(run.run_id, RunStatus.FAILED, error=error)
                    self._count("runs_failed")
                    continue
                history = await self.store.get_steps(run.run_id)
                self._count("runs_resumed")
                self._spawn(run, history)
                taken += 1
            if len(claimed) < _CLAIM_BATCH:
                break
        return taken

    async def start(
        self,
        workflow: str,
        input: Any = None,
        *,
        run_id: str | None = None,
        detach: bool = False,
    ) -> str:
        """Start a run of ``workflow`` with ``input``; returns its run id at once.

        Idempotent by ``run_id``: starting an id that exists starts nothing and returns it.

        Args:
            workflow: a workflow the app registers.
            input: its JSON input.
            run_id: the run's id (default: a random one).
            detach: only record the run (status pending, no owner); an engine's reconcile
                takes it over (this one's within ``reconcile_interval``).

        Raises:
            UnknownWorkflow: the app does not register ``workflow``.
            EngineError: ``run_id`` exists as a run of another workflow.
            PayloadError: ``input`` is not a JSON value (NaN, a set, nested deeper than
                ``MAX_JSON_DEPTH``, ...); ``path`` names where.
            EngineClosed: the engine is closed.
        """
        if self._closing:
            raise EngineClosed("the engine is closed")
        if workflow not in self.app.workflows:
            raise UnknownWorkflow(
                f"no workflow {workflow!r} in app {self.app.name!r} "
                f"(registered: {', '.join(self.app.workflows) or 'none'})"
            )
        value = normalize_json(input, f"the input of workflow {workflow!r}")
        now = self.store.now()
        record = RunRecord(
            run_id=run_id or uuid.uuid4().hex,
            workflow=workflow,
            input=value,
            status=RunStatus.PENDING if detach else RunStatus.RUNNING,
            created_at=now,
            updated_at=now,
            owner=None if detach else self.engine_id,
            lease_until=None if detach else now + self.options.run_lease,
        )
        stored, created = await self.store.create_run(record)
        if not created:
            if stored.workflow != workflow:
                raise EngineError(
                    f"run {stored.run_id!r} exists as a run of {stored.workflow!r}, "
                    f"not {workflow!r}"
                )
            return stored.run_id
        self._count("runs_started")
        self._run_event("started", stored)
        if not detach:
            self._spawn(stored, [])
        return stored.run_id

    async def result(self, run_id: str) -> Any:
        """Wait for the run to end; return its output.

        Waits on the driver when this engine drives the run, else polls the store every
        ``watch_interval`` (1 s when that is off). Bound the wait with ``trio.fail_after``.

        Raises:
            RunFailed: the run failed (``error_type`` says why: ``StepFailed``,
                ``NonDeterminismError``, the workflow's own exception type ...).
            RunCancelled: the run was cancelled.
            RunNotFound: no such run.
            EngineClosed: the engine closed before the run ended.
        """
        poll = self.options.watch_interval or 1.0
        while True:
            driver = self._drivers.get(run_id)
            record: RunRecord | None = None
            if driver is not None:
                await driver.done.wait()
                record = driver.final
            if record is None:
                record = await self.get(run_id)
            if record.status is RunStatus.COMPLETED:
                return record.output
            if record.status is RunStatus.CANCELLED:
                raise RunCancelled(run_id, record.error)
            if record.status is RunStatus.FAILED:
                raise RunFailed(run_id, record.error)
            if self._closing:
                raise EngineClosed(f"the engine closed before run {run_id!r} ended")
            if run_id not in self._drivers:
                # Driven elsewhere (or by no one yet): poll, but wake at once should this
                # engine take the run over meanwhile.
                with trio.move_on_after(poll):
                    await self._spawned.wait()

    async def get(self, run_id: str) -> RunRecord:
        """The run as the store holds it now.

        Raises:
            RunNotFound: no such run.
        """
        record = await self.store.get_run(run_id)
        if record is None:
            raise RunNotFound(run_id)
        return record

    async def status(self, run_id: str) -> RunStatus:
        """The run's status now (pending, running, completed, failed, cancelled).

        Raises:
            RunNotFound: no such run.
        """
        return (await self.get(run_id)).status

    async def history(self, run_id: str) -> builtins.list[StepRecord]:
        """The run's checkpoints, in step id order.

        Raises:
            RunNotFound: no such run.
        """
        await self.get(run_id)
        return await self.store.get_steps(run_id)

    async def cancel(self, run_id: str, *, reason: str = "cancelled") -> bool:
        """Cancel the run: it is settled as cancelled at once, its driver stopped where it
        waits (here, or by its owner at its next lease renewal), and the workers are asked
        (best-effort, point-to-point control) to cancel its running steps. Late results are
        ignored (counted as orphans).

        Returns:
            Whether this call cancelled it (``False``: it had already ended).

        Raises:
            RunNotFound: no such run.
        """
        await self.get(run_id)
        error = {"type": "RunCancelled", "message": reason}
        cancelled = await self.store.finish_run(run_id, RunStatus.CANCELLED, error=error)
        driver = self._drivers.get(run_id)
        if driver is not None:
            driver.scope.cancel()
        if cancelled:
            self._count("runs_cancelled")
            record = await self.store.get_run(run_id)
            if record is not None:
                self._run_event("cancelled", record)
            try:
                await self.transport.send_control(ControlMessage(action="cancel", run_id=run_id))
            except (BrokerError, TransportClosed) as exc:
                self._report(exc)
        return cancelled

    def statistics(self) -> EngineStatistics:
        """A snapshot of the engine's counters (idempotent application made measurable)."""
        return EngineStatistics(
            engine_id=self.engine_id,
            active_runs=len(self._drivers),
            waiting_steps=len(self._waiters),
            **self._counters,
        )

    async def list(
        self,
        *,
        status: RunStatus | str | None = None,
        workflow: str | None = None,
        limit: int = 100,
    ) -> builtins.list[RunRecord]:
        """Runs in the store, newest first, optionally filtered by status and/or workflow."""
        wanted = None if status is None else RunStatus(status)
        return await self.store.list_runs(status=wanted, workflow=workflow, limit=limit)


async def _serve_nursery(*, task_status: trio.TaskStatus[trio.Nursery]) -> None:
    async with trio.open_nursery() as nursery:
        task_status.started(nursery)
        await trio.sleep_forever()
