"""The engine: the public facade over the pieces that drive workflow runs.

::

    tree (._tree: one task, from the engine's start to the end of its close)
    └── runs          one driver task per run this engine drives (._runtime, ._remote_run)
        └── loops     lease renewal, reconcile, the store watch (._timers), the step watch,
                      the loss audit, schedules, cancel delivery, heartbeats, control plane
    (the transport's loops call the result handler, ._results)

:class:`Engine` is the public API (start, result, status, cancel, list, history, reconcile)
and what starts its pieces; its close is the unwinding of its tree (:class:`~._tree.EngineTree`),
which :meth:`Engine.aclose` asks for and waits for. The services its drivers use are
:class:`~._services.EngineServices`, which lends out the owners of what the pieces share
(made here first: :class:`~._drivers.Drivers`, :mod:`._waits`, the dispatch ledgers of the
step watch and the loss audit); applying results is
:class:`~._results.ResultHandler`; its periodic loops are :class:`~._timers.EngineTimers`.
"""

from __future__ import annotations

# Real imports, not TYPE_CHECKING ones (the ``noqa: TC00x``): ``Engine.list`` shadows the builtin
# inside the class body, so its annotations spell the type ``builtins.list``; that, and the
# return types of the public properties (``App``, ``RunStore``, ...), ``typing.get_type_hints``
# (and anything built on it) must resolve at run time. ``Engine.statistics`` and
# ``Engine.duplicates`` name their classes through ``_snapshots``, which imports each on its
# first use: an operator's call, not every engine's start.
import builtins  # noqa: TC003
import contextlib
from collections.abc import Mapping  # noqa: TC003 (the type hints resolve at run time)
from typing import TYPE_CHECKING, Any, Literal, overload

import attrs
import trio
from trio_util import RepeatedEvent, wait_any

from .._arguments import check_bool, check_name, check_optional_name, check_run_id, check_seconds
from .._errors import BrokerError, TransportClosed
from .._transport._facade import QueueTransport  # noqa: TC001
from .._wire import ControlMessage
from . import _snapshots as snapshots
from ._adoption import Adoption
from ._advert import MIN_ADVERT_TTL, EngineAdvert
from ._app import App  # noqa: TC001
from ._audit import LossAudit, SentAttempts
from ._cancel_delivery import (
    cancel_elsewhere,
    cancel_inside,
    cancel_remote,
    deliver_marked_forever,
)
from ._children import cancel_children
from ._deadline import drive_within_deadline
from ._debounce import Debounce, check_folding
from ._debounced import DebouncedStarts
from ._drivers import Drivers
from ._errors import (
    EngineClosed,
    RunCancelled,
    RunNotFound,
    UnknownWorkflow,
    run_failure,
)
from ._heartbeats import watch_heartbeats
from ._new_run import NewRunWatch, record_debounced_start, record_new_run
from ._options import EngineOptions
from ._records import RunRecord, RunState, RunStatus, StepRecord
from ._remote_run import RemoteRunDriver
from ._results import ResultHandler
from ._retention import prune_forever
from ._retry import Retry  # noqa: TC001
from ._runtime import RunDriver
from ._schedules import Scheduler, Schedules
from ._services import EngineServices
from ._step_watch import StepChecks, StepWait, StepWatch
from ._step_watch import waiting as step_waits
from ._stores import RunStore  # noqa: TC001
from ._stores._wakes import wakes_of
from ._stream import engine_stream
from ._tags import check_tags
from ._timers import EngineTimers
from ._tree import EngineTree
from ._update_desk import UpdateDesk
from ._updates import engine_update
from ._waits import Applying, DecisionLocks, StepWaiters

if TYPE_CHECKING:
    from .._transport._options import ErrorHook
    from ._services import Driver

__all__ = ["Engine", "EngineOptions", "start_engine"]


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
        # Built by open_engine. The pieces share ``services`` (what the drivers use): the owners
        # it lends out (drivers, waits, what hears of dispatches, the update desk) and this
        # engine's start and cancel (a child run's start, a cancel walking a run's children).
        self._checks = StepChecks(options, transport.names.task_queue)
        self._update_desk = UpdateDesk(store)
        sent = self._sent = SentAttempts(transport.names.task_queue)
        services = self._services = EngineServices(
            *(app, store, transport, options, on_error),
            *(Drivers(), StepWaiters(), Applying(), DecisionLocks()),
            start_run=self._start_child,
            cancel_run=self._cancel_one,
            dispatch_watches=(self._checks, sent) if options.audit_interval else (self._checks,),
            update_desk=self._update_desk,
        )
        self._results = ResultHandler(services)
        # Its key in the key store (the workflows it runs): written at start and at every
        # lease renewal tick, removed at close (._advert).
        advert = self._advert = EngineAdvert(
            transport.backend.keys,
            transport.names,
            options.engine_id,
            app,
            ttl=max(MIN_ADVERT_TTL, options.run_lease),
            report=services.report,
        )
        self._timers = EngineTimers(services, advert)
        self._tree = EngineTree(services.drivers, services, advert)
        self._spawned = RepeatedEvent()
        """Set whenever a driver starts: wakes ``result`` pollers."""
        self._adoption = Adoption(services, self._spawn, lambda: self._tree.closing)
        self._schedules_changed = RepeatedEvent()
        self._schedules = Schedules(
            services.store,
            services.options.wall_clock,
            app=services.app,
            on_change=self._schedules_changed.set,
        )
        recheck = options.reconcile_interval or options.schedule_recheck
        self._debounced = DebouncedStarts(
            store, recheck, started=self._started, reconcile=self.reconcile, report=self.report
        )

    @property
    def app(self) -> App:
        """The app whose workflows it drives."""
        return self._services.app

    @property
    def store(self) -> RunStore:
        """Its run store."""
        return self._services.store

    @property
    def transport(self) -> QueueTransport:
        """Its queue transport (results in, tasks out)."""
        return self._services.transport

    @property
    def options(self) -> EngineOptions:
        """Its options."""
        return self._services.options

    @property
    def engine_id(self) -> str:
        """Its owner id on the runs it drives."""
        return self._services.options.engine_id

    def report(self, exc: BaseException) -> None:
        """Hand ``exc`` to the engine's error hook (``on_error``)."""
        self._services.report(exc)

    @property
    def schedules(self) -> Schedules:
        """The namespace's schedules: add, list, pause, resume, delete (docs/engine.md)."""
        return self._schedules

    @property
    def default_retry(self) -> Retry:
        """The retry policy of a step that names none."""
        return self._services.default_retry

    # ------------------------------------------------------------------ lifecycle

    async def _start(self, loops: trio.Nursery) -> None:
        # The loops go into the tree's loops nursery, the drivers into its runs (._tree).
        await self._advert.write()
        results = self._results
        self.transport.on_result(results.on_result)
        if any(w.remote for w in self.app.workflows.values()):
            self.transport.remote.on_decision(results.on_decision)
            self.transport.remote.on_step_event(results.on_step_event)
        # Step beats (recorded on their checkpoints) and remote turns' beats.
        self.transport.remote.on_heartbeat(results.on_heartbeat)
        options = self.options
        if options.serve_tenants:
            from ._control import ControlPlane

            ControlPlane(self._services, self, self.transport).attach(loops)
        loops.start_soon(self._update_desk.run, self._tree.runs)
        loops.start_soon(StepWatch(self._services, self._checks, results.on_result).run)
        if options.audit_interval:
            loops.start_soon(LossAudit(self._services, self._sent, options.audit_interval).run)
        if options.reconcile:
            await self.reconcile(include_own=True)
        self._timers.start(loops, self.reconcile)
        if options.reconcile:  # a short-lived engine (reconcile=False) fires no schedules,
            loops.start_soon(self._debounced.run)  # starts no debounced run
            scheduler = Scheduler(self, self._schedules, self._schedules_changed)
            await scheduler.start()
            loops.start_soon(scheduler.run)
        loops.start_soon(
            deliver_marked_forever, self._services, self.options.cancel_grace,
            self.options.run_lease / 3, loops, self._cancel_steps,
        )  # fmt: skip
        if any(step.heartbeat_timeout is not None for step in self.app.steps.values()):
            loops.start_soon(
                watch_heartbeats,
                self._services,
                results.fail_over,
                options.heartbeat_check_interval,
            )
        loops.start_soon(prune_forever, self._services)  # (returns at once: nothing to prune)

    async def aclose(self) -> None:
        """Stop driving runs: ask the engine's tree to unwind and wait until it has, level by
        level, each bounded: (1) stop the loops; (2) cancel every run's driver where it waits
        (their checkpoints are already stored); (3) release the runs still in flight so another
        engine takes them over at once (bounded by ``cleanup_timeout``). The transport and store
        close after this, on leaving :func:`open_engine`. Idempotent; shielded.

        Called from a driver or a loop of this engine (which the close waits for), it asks and
        returns: the close goes on, and cancels the caller like any other.
        """
        tree = self._tree
        tree.close()
        if not tree.running or tree.holds_current_task():
            await trio.lowlevel.checkpoint()
            return
        with trio.CancelScope(shield=True):
            await tree.closed.wait()

    async def _start_child(self, workflow: str, input: Any, run_id: str, parent: str) -> str:
        return await self.start(workflow, input, run_id=run_id, parent=parent)

    def _started(self, run: RunRecord) -> None:
        self._services.count("runs_started")
        self._services.run_event("started", run)

    def _spawn(self, run: RunRecord, history: builtins.list[StepRecord]) -> Driver:
        definition = self.app.workflows[run.workflow]
        driver: Driver
        if definition.remote:
            driver = RemoteRunDriver(self._services, run, history)
        else:
            driver = RunDriver(self._services, run, history)
        self._services.drivers.add(driver)
        self._spawned.set()
        assert self._tree.runs is not None
        self._tree.runs.start_soon(
            drive_within_deadline, self._services, driver, definition, name=f"run {run.run_id}"
        )
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
        return await self._adoption.reconcile(include_own=include_own)

    async def take_over(self, run_id: str) -> bool:
        """Drive ``run_id`` here if nobody drives it (pending with no owner, as ``retry``
        leaves it, or its owner's lease lapsed), with its children nobody drives: what
        :meth:`reconcile` does, for one run (an engine opened with ``reconcile=False``, as
        ``durable-trio run --run-id`` opens, takes over nothing else).

        The store claims orphaned runs a batch at a time; those that are not ``run_id`` or one
        of its descendants are released again at once (pending, no owner), untouched.

        Returns:
            Whether this engine drives it now (``False``: it ended, or a live engine drives it).

        Raises:
            EngineClosed: the engine is closed.
        """
        if self._tree.closing:
            await trio.lowlevel.checkpoint()
            raise EngineClosed("the engine is closed")
        return await self._adoption.take_over(run_id)

    async def start(
        self,
        workflow: str,
        input: Any = None,
        *,
        run_id: str | None = None,
        detach: bool = False,
        timeout: float | None = None,  # noqa: ASYNC109 (the run's, stored; not this call's)
        parent: str | None = None,
        dedup_key: str | None = None,
        debounce: Debounce | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> str:
        """Start a run of ``workflow`` with ``input``; returns its run id at once.

        Idempotent by ``run_id``: starting an id that exists starts nothing and returns it
        (the existing run keeps its input and its timeout).

        Args:
            workflow: a workflow the app registers.
            input: its JSON input.
            run_id: the run's id (default: a random one).
            detach: only record the run (status pending, no owner); an engine's reconcile
                takes it over: at once where the run store has wakes (SQLite, Redis, memory:
                the start rings every reconciling engine), else within ``reconcile_interval``.
            timeout: seconds the run may take from now, on the run store's clock, whichever
                engines drive it (the deadline is stored with the run: a resumed run keeps
                it). At the deadline the run fails with ``RunTimedOut`` and its pending steps
                are no longer waited on. ``None``: no timeout.
            parent: the run starting this one as a child workflow (stored as
                :attr:`RunRecord.parent`; ``ctx.child`` sets it).
            dedup_key: start nothing while the run last started with this key (in this
                workflow) is unfinished: return its id (docs/concurrency.md, "Debounce and
                dedup keys").
            debounce: fold this start into the debounced run of ``debounce.key`` (started
                ``delay`` after the last start with the key, with the latest input): returns
                that run's id, a run from its start on (:class:`Debounce`).
            tags: the run's tags, stored with it and indexed (docs/engine.md, "Tags").

        Raises:
            UnknownWorkflow: the app does not register ``workflow``.
            EngineError: ``run_id`` exists as a run of another workflow.
            PayloadError: ``input`` is not a JSON value (NaN, a set, nested deeper than
                ``MAX_JSON_DEPTH``, ...); ``path`` names where.
            TypeError: ``workflow`` or ``run_id`` is not a str, ``detach`` not a bool,
                ``timeout`` not a number.
            ConfigError: an empty ``workflow`` or ``run_id``, a bad ``timeout``,
                ``dedup_key`` or ``tags``; ``dedup_key`` or ``debounce`` with ``run_id``,
                ``parent`` or each other.
            EngineClosed: the engine is closed.
        """
        check_name(workflow, "engine.start", "workflow")
        check_optional_name(parent, "engine.start", "parent")  # a child's id: ctx.child's
        (check_run_id if parent is None else check_optional_name)(run_id, "engine.start", "run_id")
        check_bool(detach, "engine.start", "detach")
        check_folding(run_id, parent, dedup_key, debounce)
        seconds = (
            None
            if timeout is None
            else check_seconds(timeout, "engine.start", "timeout", positive=True)
        )
        if self._tree.closing:
            # The engine's own callers (scheduler, parent, pod) were cancelled when closing
            # began; one resumed with its result already in leaves here by that cancel, not
            # with an error to tell from a real one (seen in CI: a schedule's tick).
            await trio.lowlevel.checkpoint()
            raise EngineClosed("the engine is closed")
        if workflow not in self.app.workflows:
            raise UnknownWorkflow(
                f"no workflow {workflow!r} in app {self.app.name!r} "
                f"(registered: {', '.join(self.app.workflows) or 'none'})"
            )
        checked_tags = check_tags(tags, "engine.start: tags")
        if debounce is not None:
            folded, due = await record_debounced_start(
                self.store, workflow, input, debounce, timeout=seconds, tags=checked_tags
            )
            self._debounced.due(due)
            return folded
        with NewRunWatch(self.store, run_id, wanted=not detach and dedup_key is None) as watch:
            stored, created = await record_new_run(
                self.store,
                workflow,
                input,
                run_id=watch.run_id,
                owner=None if detach else self.engine_id,
                lease=self.options.run_lease,
                timeout=seconds,
                parent=parent,
                dedup_key=dedup_key,
                tags=checked_tags,
            )
            if not created:
                return stored.run_id
            self._started(stored)
            if not detach:
                watch.hand_over(self._spawn(stored, []))
        return stored.run_id

    async def result(self, run_id: str) -> Any:
        """Wait for the run to end; return its output.

        Waits on the driver when this engine drives the run, else polls the store every
        ``watch_interval`` (1 s when that is off). Bound the wait with ``trio.fail_after``.

        Raises:
            RunFailed: the run failed (``error_type`` says why: ``StepFailed``, ...).
            RunTimedOut: (a ``RunFailed``) the run did not end within its ``timeout``.
            RunCancelled: the run was cancelled.
            RunNotFound: no such run (nor a debounced start to create it: the result of
                one is waited for).
            EngineClosed: the engine closed before the run ended.
        """
        poll = self.options.watch_interval or 1.0
        wakes = wakes_of(self.store)
        while True:
            # Taken before the read: the ring of an engine settling it elsewhere (issue 30).
            with wakes.watching(run_id) if wakes else contextlib.nullcontext() as rung:
                driver = self._services.drivers.get(run_id)
                record: RunRecord | None = None
                if driver is not None:
                    await driver.done.wait()
                    record = driver.final
                if record is None:
                    record = await _run_or_pending(self.store, run_id)
                if record is None:  # a debounced start not yet started: wait for its run
                    await _rung_or_spawned(rung, self._spawned, poll)
                    continue
                if record.status.terminal:
                    return _outcome(record)
                if self._tree.closing:
                    raise EngineClosed(f"the engine closed before run {run_id!r} ended")
                if run_id not in self._services.drivers:
                    # Driven elsewhere (or by no one yet): the ring, else the poll; at once
                    # should this engine take the run over meanwhile.
                    await _rung_or_spawned(rung, self._spawned, poll)

    async def get(self, run_id: str) -> RunRecord:
        """The run as the store holds it now.

        Raises:
            RunNotFound: no such run.
        """
        record = await self.store.get_run(check_name(run_id, "engine", "run_id"))
        if record is None:
            raise RunNotFound(run_id)
        return record

    @overload
    async def status(self, run_id: str, *, events: Literal[False] = False) -> RunStatus: ...

    @overload
    async def status(self, run_id: str, *, events: Literal[True]) -> RunState: ...

    async def status(self, run_id: str, *, events: bool = False) -> RunStatus | RunState:
        """The run's status now (pending, running, completed, failed, cancelled, blocked);
        with ``events=True`` a :class:`RunState`: the status and the run's latest events
        (``ctx.set_event``), read together, so a caller sees progress without waiting for the
        result.

        Raises:
            RunNotFound: no such run.
            SignalDataError: (with ``events``) a stored event is damaged (not JSON).
        """
        status = (await self.get(run_id)).status
        if not events:
            return status
        return RunState(run_id, status, await self.events(run_id))

    async def waiting(self, run_id: str) -> builtins.list[StepWait]:
        """The remote steps the run waits on now: each one's task queue
        (``{prefix}:tasks:{token}``), how long its attempt has waited, whether a worker took
        it and how many live workers serve that queue. ``StepWait.describe()`` says it in a
        line (what ``durable-trio run`` prints for a run that did not finish in time).

        Raises:
            RunNotFound: no such run.
        """
        await self.get(run_id)
        return await step_waits(self._services, self._checks, run_id)

    async def history(self, run_id: str) -> builtins.list[StepRecord]:
        """The run's checkpoints, in step id order (each remote step with the duplicate
        completed results this engine met for it: :attr:`StepRecord.duplicates`).

        Raises:
            RunNotFound: no such run.
        """
        await self.get(run_id)
        steps = await self.store.get_steps(run_id)
        duplicates = self._services.duplicates.of_run(run_id)
        if not duplicates:
            return steps
        return [
            attrs.evolve(
                step,
                duplicates=tuple(d.to_json() for d in duplicates if d.step_id == step.step_id),
            )
            for step in steps
        ]

    def duplicates(self, run_id: str | None = None) -> builtins.list[snapshots.DuplicateResult]:
        """The completed results this engine met for an attempt that had already completed,
        each with its cause (which lease was lost, whose, when: see docs/concepts.md,
        "At-least-once windows"), oldest first: of ``run_id``, or of every run. None was
        applied (the first result stays). Kept in memory, the newest 1,000; counted in
        :attr:`EngineStatistics.duplicate_completions`."""
        return self._services.duplicates.of_run(run_id)

    async def signal(self, run_id: str, name: str, payload: Any = None) -> int:
        """Send signal ``name`` with JSON ``payload`` to the run (``ctx.wait_signal(name)``
        returns it). Returns once the signal is stored (buffered if the run does not wait yet).

        Returns:
            The signal's sequence number among the run's signals of that name (1, 2, ...).

        Raises:
            RunNotFound: no such run.
            RunNotSignalable: the run has finished.
            PayloadError: ``payload`` is not a JSON value.
        """
        from ._signals import send_signal

        check_name(name, "engine.signal", "name")
        return await send_signal(self.store, self._services.drivers.get, run_id, name, payload)

    async def events(self, run_id: str) -> dict[str, Any]:
        """The run's latest events (``ctx.set_event``), by key.

        Raises:
            RunNotFound: no such run.
            SignalDataError: a stored event is damaged (not JSON).
        """
        from ._signals import decode_stored

        await self.get(run_id)
        stored = await self.store.get_events(run_id)
        return {k: decode_stored(v, f"event {k!r} of run {run_id!r}") for k, v in stored.items()}

    stream = engine_stream  # async for entry in engine.stream(run_id, after=0): _stream
    update = engine_update  # await engine.update(run_id, name, payload): _updates

    async def get_event(self, run_id: str, key: str, *, timeout: float | None = None) -> Any:  # noqa: ASYNC109 (a durable deadline, not a trio one)
        """The run's latest value of event ``key`` (``ctx.set_event``); if it is not set yet,
        wait up to ``timeout`` seconds for it (``None``: do not wait).

        Raises:
            RunNotFound: no such run.
            EventTimeout: ``key`` was not set within ``timeout`` (or at once, without one).
        """
        from ._signals import wait_event

        await self.get(run_id)
        return await wait_event(self.store, run_id, key, timeout)

    async def cancel(self, run_id: str, *, reason: str = "cancelled") -> bool:
        """Cancel the run. A local workflow driven by this engine gets :class:`RunCancelled`
        at its await and may compensate (bounded by ``cancel_grace``; docs/engine.md,
        "Cancellation inside a workflow"): this call returns once it ended, cancelled.
        Otherwise it is settled as cancelled at once, its driver stopped where it
        waits (by its owner at its next lease renewal), and the workers are asked
        (best-effort, point-to-point control) to cancel its running steps. Late results are
        ignored (counted as orphans).

        Its descendants started with ``on_parent_cancel="cancel"`` (the default) are cancelled
        too, each the same way, breadth-first from the root down, iteratively (any depth);
        calling it again on a run already cancelled finishes the cancel of its descendants if
        an earlier one was interrupted (docs/engine.md, "Child workflows").

        Returns:
            Whether this call cancelled it (``False``: it had already ended).

        Raises:
            RunNotFound: no such run.
        """
        cancelled = await self._cancel_one(run_id, reason)
        await cancel_children(self.store, run_id, self._cancel_one)
        return cancelled

    async def _cancel_one(self, run_id: str, reason: str = "cancelled") -> bool:
        """:meth:`cancel` of ``run_id`` alone (a driver's end still cancels its own children)."""
        await self.get(run_id)
        driver = self._services.drivers.get(run_id)
        if isinstance(driver, RunDriver) and not driver.settling:
            # A local workflow driven here: RunCancelled inside it, its compensation bounded
            # by cancel_grace; then the workers are asked to cancel what it left running.
            cancelled = await cancel_inside(
                self._services, driver, reason, self.options.cancel_grace
            )
            if cancelled:
                await self._cancel_steps(run_id)
            return cancelled
        if isinstance(driver, RemoteRunDriver) and not driver.settling:
            cancelled = await cancel_remote(
                self._services, driver, reason, self.options.cancel_grace
            )
            if cancelled:
                await self._cancel_steps(run_id)
            return cancelled
        current = await self.get(run_id)
        # (Its owner's lease expired: nobody drives it, nobody would deliver a mark.)
        elsewhere = (
            driver is None
            and current.status is RunStatus.RUNNING
            and current.owner
            and current.lease_until is not None
            and current.lease_until > self.store.now()
        )
        # Driven by another engine: the mark tells its owner, which delivers it (its
        # compensation bounded by its own cancel_grace); settled here if it has not ended
        # within this engine's grace plus a lease (an owner that died or ignores marks).
        if elsewhere:
            lease = self.options.run_lease
            ended = await cancel_elsewhere(
                self._services, run_id, reason, self.options.cancel_grace + lease, lease / 3
            )
            if ended is not None:
                if ended:
                    await self._cancel_steps(run_id)
                return ended
        error = {"type": "RunCancelled", "message": reason}
        cancelled = await self.store.finish_run(run_id, RunStatus.CANCELLED, error=error)
        if driver is not None:
            driver.scope.cancel()
        if cancelled:
            self._services.count("runs_cancelled")
            record = await self.store.get_run(run_id)
            if record is not None:
                self._services.run_event("cancelled", record)
            await self._cancel_steps(run_id)
        return cancelled

    async def _cancel_steps(self, run_id: str) -> None:
        """Ask the workers (best-effort) to cancel the running steps of ``run_id``."""
        try:
            await self.transport.remote.send_control(ControlMessage(action="cancel", run_id=run_id))
        except (BrokerError, TransportClosed) as exc:
            self._services.report(exc)

    async def retry(self, run_id: str) -> RunRecord:
        """Retry a failed run, or a blocked one (docs/engine.md, Versioning): it resumes from
        the step that failed it, its completed steps replayed from the store (never re-run).
        The run is reopened in the store (pending, no owner) and this engine's reconcile takes
        it over at once (``ops.retry_run``, the CLI's and the console's retry, rings every
        reconciling engine instead). What changes (a fresh budget of attempts and backoff for
        a remote step, one more attempt for a local one, a run timeout started afresh): see
        :mod:`durable_trio._engine._reopen` and docs/operations.md.

        Returns:
            The run as reopened.

        Raises:
            RunNotFound: no such run.
            RunNotRetryable: the run is neither failed nor blocked.
            EngineClosed: the engine is closed.
        """
        if self._tree.closing:
            raise EngineClosed("the engine is closed")
        from ._reopen import retry_run  # (an operator's call: imported with its first use)

        record = await retry_run(self.store, run_id)
        await self.reconcile()
        return record

    def statistics(self) -> snapshots.EngineStatistics:
        """A snapshot of the engine's counters (idempotent application made measurable)."""
        return snapshots.EngineStatistics(
            engine_id=self.engine_id,
            active_runs=len(self._services.drivers),
            waiting_steps=len(self._services.waiters),
            **self._services.counters,
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


def _outcome(record: RunRecord) -> Any:
    """An ended run's output, or its error raised (``engine.result``)."""
    if record.status is RunStatus.CANCELLED:
        raise RunCancelled(record.run_id, record.error)
    if record.status is RunStatus.FAILED:
        raise run_failure(record.run_id, record.error)
    return record.output


async def _run_or_pending(store: RunStore, run_id: str) -> RunRecord | None:
    """The run; ``None`` while a debounced start is to create it (``engine.result``).

    Raises:
        RunNotFound: neither.
    """
    record = await store.get_run(check_name(run_id, "engine.result", "run_id"))
    if record is None and await store.debounced_due(run_id) is None:
        record = await store.get_run(run_id)  # (created since the first read)
        if record is None:
            raise RunNotFound(run_id)
    return record


async def _rung_or_spawned(rung: trio.Event | None, spawned: RepeatedEvent, poll: float) -> None:
    """Return once ``rung`` is set (if any), a driver starts here, or after ``poll`` seconds
    (``engine.result`` of a run driven elsewhere, issue 30, item 1)."""
    with trio.move_on_after(poll):
        if rung is None:
            await spawned.wait()
        else:
            await wait_any(rung.wait, spawned.wait)


async def start_engine(engine: Engine, root: trio.Nursery) -> None:
    """Start ``engine`` in ``root`` (what :func:`open_engine` does on entry): its tree (the runs
    and loops nurseries, ._tree), then its pieces in them: the transport's handlers, the
    initial reconcile and the timers."""
    loops = await root.start(engine._tree.run)
    await engine._start(loops)
