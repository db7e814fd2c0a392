"""The engine's side of a remote workflow (T14–T16, docs/spec.md): turns out, decisions and step
events in.

A :class:`RemoteRunDriver` drives one run of a workflow registered ``remote=True`` (or declared
with :meth:`App.remote_workflow`). It holds no workflow code; it loops:

1. read the run's history, send it in a :class:`~durable_trio.WorkflowTask` (a *turn*) onto the
   workflow's routing-token task queue;
2. wait for the turn's decision to be applied (by this engine, or by any engine sharing the
   namespace: decisions are point-to-point), re-sending the turn after ``turn_timeout``;
3. wait until something the workflow waits on moves (a remote step settles, a timer fires),
   then go to 1.

Applying a decision (:func:`apply_decision`) is a store-level change any engine can make, and
an idempotent one: its commands insert checkpoints under the step ids the turn assigned (an
existing checkpoint is kept), its end settles the run (the first settle wins). Since workflow
code is deterministic, a decision computed from an older history asks for nothing a newer one
contradicts; one that does (a local step whose re-run gave another outcome) is stale: it stops
being applied and the driver sends a fresh turn.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .._errors import PayloadError
from .._wire import DecisionStatus, StepEventKind, WorkflowTask
from ._cancel import CANCEL_MARK, mark_reason
from ._children import ChildFailed, cancel_children, child_step, start_child_run, wait_child
from ._records import (
    Applied,
    RunRecord,
    RunStatus,
    StepKind,
    StepRecord,
    StepState,
    error_to_json,
    normalize_json,
    patch_marker,
    step_to_json,
)
from ._runtime import describe_error, send_step, send_unconfirmed
from ._step_timeouts import (
    StepTimeouts,
    UnknownStep,
    check_step_known,
    command_timeouts,
    with_timeouts,
)
from ._stores._wakes import SupportsRunWakes, first_of, step_key
from ._versioning import is_blocking

if TYPE_CHECKING:
    from .._wire import StepEvent, WorkflowDecision
    from ._app import WorkflowDefinition
    from ._services import DriverServices
    from ._waits import StepWaiter

__all__ = ["RemoteRunDriver", "apply_decision", "apply_step_event"]

#: What the driver hears about its turn's decision.
_APPLIED, _STALE = "applied", "stale"


class _BadDecision(PayloadError):
    """A decision this engine cannot apply (malformed command)."""


def _text(command: dict[str, Any], field: str) -> str:
    value = command.get(field)
    if not isinstance(value, str) or not value:
        raise _BadDecision(f"a {command.get('type')!r} command needs a string {field!r}")
    return value


def _run_error(decision: WorkflowDecision) -> dict[str, Any]:
    """A failed decision's error as the run store keeps a run failure."""
    error = decision.error
    if error is None:
        return {"type": "WorkflowFailed", "message": "the workflow turn failed without an error"}
    if isinstance(error.details, dict) and isinstance(error.details.get("type"), str):
        return dict(error.details)
    return {"type": error.code or "WorkflowFailed", "message": error.message}


async def _apply_command(services: DriverServices, run: RunRecord, command: Any) -> bool:
    """Checkpoint one command. Returns ``False`` when it contradicts the stored history (the
    decision is stale)."""
    if not isinstance(command, dict):
        raise _BadDecision(f"a decision command must be an object, got {command!r}")
    store = services.store
    kind = command.get("type")
    step_id = _text(command, "stepId")
    if kind == "step":
        name = _text(command, "name")
        retry = command.get("retry")
        if not isinstance(retry, dict):
            retry = services.retry_for(name, None).to_json()
        priority = command.get("priority")
        step = services.step_definition(name)
        retry = with_timeouts(retry, command_timeouts(command).over(StepTimeouts.of(step)))
        try:
            check_step_known(name, services.app.name, services.app.steps)
        except UnknownStep as exc:
            raise _BadDecision(str(exc)) from None
        fresh = StepRecord(
            run_id=run.run_id,
            step_id=step_id,
            kind=StepKind.REMOTE,
            name=name,
            status=StepState.PENDING,
            input=normalize_json(command.get("input"), f"the input of step {name!r}"),
            retry=retry,
            priority=priority if isinstance(priority, int) else step.priority if step else None,
            heartbeat_timeout=step.heartbeat_timeout if step else None,
        )
        stored = await services.guard(lambda: store.begin_step(fresh), "checkpointing")
        if (stored.kind, stored.name) != (StepKind.REMOTE, name):
            return False
        if (
            stored.status is StepState.PENDING
            and not stored.dispatched
            and stored.attempt == 1  # a later attempt is its result handler's to send
            and (run.run_id, step_id) not in services.applying
        ):
            await send_step(services, stored, None)
        return True
    if kind == "sleep":
        seconds = command.get("seconds")
        if not isinstance(seconds, int | float) or seconds < 0:
            raise _BadDecision(f"a sleep command needs seconds >= 0, got {seconds!r}")
        timer = StepRecord(
            run_id=run.run_id,
            step_id=step_id,
            kind=StepKind.TIMER,
            name="sleep",
            status=StepState.PENDING,
            input=float(seconds),
            wake_at=store.now() + float(seconds),
        )
        stored = await services.guard(lambda: store.begin_step(timer), "checkpointing")
        return stored.kind is StepKind.TIMER
    if kind == "local":
        name = _text(command, "name")
        try:
            status = StepState(str(command.get("status")))
        except ValueError:
            raise _BadDecision(f"a local command's status is {command.get('status')!r}") from None
        attempt = command.get("attempt", 1)
        local = StepRecord(
            run_id=run.run_id,
            step_id=step_id,
            kind=StepKind.LOCAL,
            name=name,
            status=status,
            attempt=attempt if isinstance(attempt, int) else 1,
            output=command.get("output"),
            error=command.get("error"),
        )
        stored = await services.guard(lambda: store.begin_step(local), "checkpointing")
        if (stored.kind, stored.name, stored.status) == (
            StepKind.LOCAL,
            name,
            StepState.PENDING,
        ):  # left pending by an engine that once ran this workflow locally: settle it
            verdict = await services.guard(
                lambda: store.update_step(local, expect_attempt=stored.attempt), "checkpointing"
            )
            return verdict is Applied.APPLIED
        return (stored.kind, stored.name, stored.status, stored.output) == (
            StepKind.LOCAL,
            name,
            status,
            local.output,
        )
    if kind in ("signal", "event"):  # issue 18
        from ._signals import apply_command

        return await apply_command(services, run, command, step_id)

    if kind == "patch":
        name = _text(command, "name")
        stored = await services.guard(
            lambda: store.begin_step(patch_marker(run.run_id, name)), "checkpointing"
        )
        return stored.kind is StepKind.PATCH

    if kind == "child":  # ctx.child / ctx.start_child (issue 18): checkpoint, then start it
        name = _text(command, "name")
        child_id = _text(command, "runId")
        mode = command.get("onParentCancel", "cancel")
        if mode not in ("cancel", "abandon"):
            raise _BadDecision(f"a child command's onParentCancel is {mode!r}")
        value = normalize_json(command.get("input"), f"the input of child workflow {name!r}")
        # Failed at once if past max_child_depth; only while the parent is unfinished.
        child = child_step(
            run.run_id, run.depth, services.options.max_child_depth, step_id, name, value,
            child_id, mode,
        )  # fmt: skip
        found = await services.guard(
            lambda: store.begin_step_unless_finished(child), "checkpointing"
        )
        if found is None or (found.kind, found.name) != (StepKind.CHILD, name):
            return False  # (ended meanwhile: the driver's next turn finds it so)
        if found.status is StepState.PENDING:
            await start_child_run(services, found)  # (refused: the next turn finds it failed)
        return True
    raise _BadDecision(f"unknown decision command type {kind!r}")


async def apply_decision(services: DriverServices, decision: WorkflowDecision) -> None:
    """Apply one decision to the store (any engine may; see the module docstring), then tell
    the run's driver if this engine drives it. Decisions of one run are applied one at a time
    here, so a duplicate (a turn redelivered) finds the first one's steps already dispatched
    instead of dispatching them again.

    Error handling:
        A malformed decision fails the run (``BadDecision``, reported through the error hook).
        A store error propagates: the transport redelivers the decision.
    """
    async with services.decision_locks.holding(decision.run_id):
        await _apply_decision(services, decision)


async def _apply_decision(services: DriverServices, decision: WorkflowDecision) -> None:
    store = services.store
    run = await store.get_run(decision.run_id)
    definition = None if run is None else services.app.workflows.get(run.workflow)
    if run is None or definition is None or not definition.remote:
        services.count("orphan_decisions")
        return
    if run.status.terminal or run.status is RunStatus.BLOCKED:
        services.count("stale_decisions")
        return
    verdict = _APPLIED
    try:
        for command in decision.commands:
            if not await _apply_command(services, run, command):
                verdict = _STALE
                break
    except PayloadError as exc:
        services.report(exc)
        error = {"type": "BadDecision", "message": str(exc)}
        await services.settle(run, RunStatus.FAILED, error=error)
        verdict = _APPLIED
    else:
        if verdict is _STALE:
            services.count("stale_decisions")
        elif decision.status in (DecisionStatus.COMPLETED, DecisionStatus.FAILED) and (
            mark := await services.guard(
                lambda: services.store.get_step(run.run_id, CANCEL_MARK), "reading"
            )
        ):  # cancelled: it ends cancelled, whatever the workflow did after the cancel
            cancelled: dict[str, Any] = {"type": "RunCancelled", "message": mark_reason(mark)}
            cancelled["cut"] = False
            await services.settle(run, RunStatus.CANCELLED, error=cancelled)
        elif decision.status is DecisionStatus.COMPLETED:
            await services.settle(run, RunStatus.COMPLETED, output=decision.output)
        elif decision.status is DecisionStatus.FAILED:
            error = _run_error(decision)
            if is_blocking(error):  # non-determinism: parked, not failed for good
                services.count("nondeterminism_failures")
                await services.settle(run, RunStatus.BLOCKED, error=error)
            else:
                await services.settle(run, RunStatus.FAILED, error=error)
    if verdict is _APPLIED:
        services.count("decisions_applied")
    driver = services.drivers.get(run.run_id)
    if isinstance(driver, RemoteRunDriver):
        driver.decided(decision.task_id, verdict)


async def apply_step_event(services: DriverServices, event: StepEvent) -> None:
    """Checkpoint a workflow worker's local step once it ended (T16); ``started`` is counted.

    The turn's decision carries the same outcome: whichever lands first is kept.
    """
    if event.kind is StepEventKind.STARTED:
        services.count("step_events")
        return
    run = await services.store.get_run(event.run_id)
    if run is None or run.status.terminal or run.status is RunStatus.BLOCKED:
        services.count("orphan_step_events")
        return
    completed = event.kind is StepEventKind.COMPLETED
    record = StepRecord(
        run_id=event.run_id,
        step_id=event.step_id,
        kind=StepKind.LOCAL,
        name=event.name or "local",
        status=StepState.COMPLETED if completed else StepState.FAILED,
        attempt=event.attempt,
        output=event.output if completed else None,
        error=None if event.error is None or completed else error_to_json(event.error),
    )
    await services.store.begin_step(record)
    services.count("step_events")


class RemoteRunDriver:
    """Drives one remote workflow run (see the module docstring). Created by the engine."""

    def __init__(self, services: DriverServices, run: RunRecord, history: list[StepRecord]) -> None:
        self.services = services
        self.run = run
        self.scope = trio.CancelScope()
        self.done = trio.Event()
        self.final: RunRecord | None = None
        self.settling = False
        self.turns = 0
        self._verdict: str | None = None
        self._decided = trio.Event()
        self._turn_ids: set[str] = set()
        """The task ids of the turn in flight (one per copy sent)."""
        self._deadline = 0.0
        self._moved_on = False
        """The last turn's decision was never seen (see :meth:`_turn`): progress waits at most
        ``turn_timeout`` before the next turn goes out."""
        self._waking: trio.CancelScope | None = None
        self._woken = False
        """:meth:`wake` was called while no progress wait was open (a turn in flight): the
        next turn goes out at once instead of waiting for progress."""
        self.cancel_seen = False
        """A cancel mark in its history is being handled here (``_cancel``)."""
        del history  # re-read from the store before every turn
        self._children = False
        """The run started child workflows (ended with it unless abandoned, issue 18)."""

    def wake(self) -> None:
        """The run's history changed under it (a cancel mark): send a turn now (or, with a
        turn in flight, as soon as its decision is applied: the wake is not lost)."""
        self._woken = True
        if self._waking is not None:
            self._waking.cancel()

    def beat(self) -> None:
        """The turn in flight is running (a turn heartbeat): wait ``turn_timeout`` more."""
        self._deadline = trio.current_time() + self.services.options.turn_timeout

    def decided(self, task_id: str, verdict: str) -> None:
        """A decision for this run was applied (or found stale). Only a decision of the turn
        in flight (any copy of it) moves the driver on: an older turn's, arriving late (a
        redelivered turn), changed nothing the driver waits for."""
        if task_id in self._turn_ids:
            self._verdict = verdict
            self._decided.set()

    async def drive(self, definition: WorkflowDefinition) -> None:
        """Turn after turn until the run is settled (by a decision, a cancel, ...)."""
        del definition  # the code is on the workflow workers
        services = self.services
        try:
            with self.scope:
                try:
                    await self._loop()
                    if self._children:
                        # No orphan: children it started and never awaited end with it. The
                        # run is over: a cancel or a lease renewal meeting it now must not
                        # treat it as a run still driven here.
                        self.settling = True
                        await self._end_children()
                except PayloadError as exc:  # the turn cannot be sent (history too large)
                    services.report(exc)
                    error = describe_error(exc)
                    self.final = await services.settle(self.run, RunStatus.FAILED, error=error)
        finally:
            services.forget(self)
            self.done.set()

    async def _end_children(self) -> None:
        services = self.services
        await services.guard(
            lambda: cancel_children(
                services.store,
                self.run.run_id,
                services.cancel_run,
                ended="ended",
                descend_ended=False,
            ),
            "cancelling children",
        )

    async def _loop(self) -> None:
        services = self.services
        store = services.store
        run_id = self.run.run_id
        while True:
            if await self._ended():
                return
            records = await services.guard(lambda: store.get_steps(run_id), "reading")
            self._children = self._children or any(r.kind is StepKind.CHILD for r in records)
            sent = [step_to_json(r) for r in records]
            await self._turn(records, sent)
            if await self._ended():
                return
            if self._verdict == _STALE:
                continue
            if self._woken:  # woken during the turn: its history changed, send the next one
                self._woken = False
                continue
            with trio.CancelScope() as self._waking:
                await self._progress(sent)
            self._waking = None
            self._woken = False

    async def _settled_decisions(self) -> None:
        """Wait out a decision of this run being applied here: a step it inserted but has not
        dispatched yet is not one to dispatch again."""
        await self.services.decision_locks.wait_out(self.run.run_id)

    async def _ended(self) -> bool:
        """Whether the run is over (or gone); an ended run's record becomes :attr:`final`."""
        services = self.services
        run = await services.guard(lambda: services.store.get_run(self.run.run_id), "reading")
        over = run is None or run.status.terminal or run.status is RunStatus.BLOCKED
        if run is not None and over:
            self.final = run
        return over

    async def _stop_child_wait(self) -> None:
        """The run ended elsewhere while it waited for a child: its loop sees that next."""
        await trio.lowlevel.checkpoint()

    async def _send_turn(self, records: list[StepRecord]) -> None:
        services = self.services
        run = self.run
        self.turns += 1
        task = WorkflowTask(
            task_id=f"{run.run_id}:{len(records)}:{uuid.uuid4().hex[:12]}",
            run_id=run.run_id,
            workflow=run.workflow,
            group=run.workflow,
            input=run.input,
            history=tuple(step_to_json(r) for r in records),
        )
        self._turn_ids.add(task.task_id)
        await services.dispatch_turn(task)
        services.count("turns_dispatched")

    async def _turn(self, records: list[StepRecord], sent: list[dict[str, Any]]) -> None:
        """Send a turn; return once its decision was applied (here or by another engine)."""
        services = self.services
        options = services.options
        self._decided = trio.Event()
        self._verdict = None
        self._turn_ids = set()
        self._moved_on = False
        await self._send_turn(records)
        self._deadline = trio.current_time() + options.turn_timeout
        poll = options.watch_interval or 1.0
        store = services.store
        wakes = store.wakes if isinstance(store, SupportsRunWakes) else None
        with contextlib.ExitStack() as watch:
            # A decision applied by another engine rings (the store's wakes): taken before the
            # store is read, and again before each read, so no ring is lost in between.
            key = step_key(self.run.run_id)
            rung = watch.enter_context(wakes.watching(key)) if wakes else None
            while True:
                wait = min(poll, max(0.0, self._deadline - trio.current_time()))
                with trio.move_on_after(wait):
                    if rung is None:
                        await self._decided.wait()
                    else:
                        await first_of(self._decided, rung)
                if self._decided.is_set():
                    return
                if wakes is not None and rung is not None and rung.is_set():
                    watch.close()
                    rung = watch.enter_context(wakes.watching(key))
                if await self._look(records, sent):
                    return

    async def _look(self, records: list[StepRecord], sent: list[dict[str, Any]]) -> bool:
        """The turn's decision not seen here: whether the driver moves on (the store shows it
        applied by another engine, the run ended, or the turn is moved on); a turn past its
        deadline with nothing pending is sent again."""
        services = self.services
        await self._settled_decisions()
        # Applied by another engine? It shows in the store.
        if await self._ended():
            return True
        now = await services.guard(lambda: services.store.get_steps(self.run.run_id), "reading")
        if [step_to_json(r) for r in now] != sent:
            return True
        if trio.current_time() >= self._deadline:
            if any(r.status is StepState.PENDING for r in now):
                # The workflow waits on something the store holds (a step, a timer): move
                # on with it. Its decision may have been applied by another engine while
                # changing nothing this driver can see (a turn after a takeover, or after
                # one of several parallel steps settled); re-sending turns would only
                # repeat that, never running the timer. A turn lost for good costs nothing
                # either: the next one goes out once something moves.
                services.count("turns_moved_on")
                self._moved_on = True
                return True
            services.count("turns_resent")
            await self._send_turn(records)
            self._deadline = trio.current_time() + services.options.turn_timeout
        return False

    async def _progress(self, sent: list[dict[str, Any]]) -> None:
        """Wait until a step the workflow waits on settles or a timer fires."""
        services = self.services
        store = services.store
        run_id = self.run.run_id
        await self._settled_decisions()
        records = await services.guard(lambda: store.get_steps(run_id), "reading")
        pending = [r for r in records if r.status is StepState.PENDING]
        known = {step["stepId"] for step in sent}
        if any(r.kind is StepKind.CHILD and r.step_id not in known for r in pending):
            # A child started by the last turn: the workflow goes on at once (start_child
            # returns once the child exists; ctx.child then waits in the next turn).
            return
        if not pending:
            if [step_to_json(r) for r in records] == sent:
                # The turn waited on nothing the engine could ever settle (workflow code that
                # awaits something other than ctx calls): fail loudly rather than spin.
                error = {
                    "type": "WorkflowStuck",
                    "message": "the workflow turn neither ended nor asked for a step or a timer "
                    "(workflow code must await only ctx calls)",
                }
                await services.settle(self.run, RunStatus.FAILED, error=error)
            return
        waiters: list[tuple[tuple[str, str], StepWaiter]] = []
        try:
            for record in pending:
                if record.kind is StepKind.REMOTE:
                    key = (run_id, record.step_id)
                    waiters.append((key, services.waiters.watch(key)))
            async with trio.open_nursery() as nursery:
                if self._moved_on:
                    # Its turn was never answered as far as this driver knows (lost for good,
                    # or answered elsewhere with nothing new): another turn goes out after
                    # turn_timeout even if nothing moves, so what a lost turn would have added
                    # (a parallel step) does not wait for the slowest pending one.
                    nursery.cancel_scope.deadline = (
                        trio.current_time() + services.options.turn_timeout
                    )

                async def remote(key: tuple[str, str], waiter: StepWaiter) -> None:
                    # A result of this step being applied here (a retry checkpointed, its
                    # dispatch under way) is left to finish: its retry is not ours to send.
                    applying = services.applying.get(key)
                    if applying is not None:
                        await applying.wait()
                    # Watch BEFORE reading: a result applied from now on reaches the waiter.
                    found = await services.guard(lambda: store.get_step(*key), "reading")
                    if found is not None:
                        waiter.update(found)
                        if found.status is StepState.PENDING and not found.dispatched:
                            if found.wake_at is None:
                                await send_unconfirmed(services, found, waiter)
                            else:  # (a retry or an operator's reopening)
                                services.count("redispatched")
                                await send_step(services, found, waiter)
                    await waiter.wait()
                    nursery.cancel_scope.cancel()

                async def timer(record: StepRecord) -> None:
                    assert record.wake_at is not None
                    await services.sleep_until(record.wake_at)
                    fired = attrs.evolve(record, status=StepState.COMPLETED)
                    verdict = await services.guard(
                        lambda: store.update_step(fired, expect_attempt=record.attempt),
                        "checkpointing",
                    )
                    if verdict is Applied.APPLIED:
                        services.count("timers_fired")
                    nursery.cancel_scope.cancel()

                async def child(record: StepRecord) -> None:
                    await start_child_run(services, record)
                    with contextlib.suppress(ChildFailed):  # its end is checkpointed either way
                        await wait_child(services, record, self._stop_child_wait)
                    nursery.cancel_scope.cancel()

                for key, waiter in waiters:
                    nursery.start_soon(remote, key, waiter)

                async def signal(record: StepRecord) -> None:
                    from ._signals import settle_signal

                    await settle_signal(services, self, record)
                    nursery.cancel_scope.cancel()

                for record in pending:
                    if record.kind is StepKind.SIGNAL:
                        nursery.start_soon(signal, record)
                    elif record.kind is StepKind.CHILD:
                        nursery.start_soon(child, record)
                    elif record.kind is StepKind.TIMER:
                        nursery.start_soon(timer, record)
                    elif record.kind is StepKind.LOCAL:  # written pending by nothing we know
                        nursery.cancel_scope.cancel()
        finally:
            for key, waiter in waiters:
                services.waiters.unwatch(key, waiter)
