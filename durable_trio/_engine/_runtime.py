"""One run, driven: the workflow coroutine, and how each checkpoint kind executes.

A :class:`RunDriver` is one task in the engine's runs nursery. It re-executes the workflow
function from the top (replay), answering every call that history already holds from its
checkpoint and executing the first new ones:

- remote step: insert the checkpoint (attempt 1), dispatch the task, record that the dispatch
  landed, wait until the engine applies a final result (retries happen in between, driven by
  result application, see :mod:`._engine`);
- local step: run the function here, retrying with a durable backoff (the retry's start time is
  checkpointed);
- timer: checkpoint the wake-up time, sleep until then, mark it fired.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .._errors import PayloadError
from .._wire import StepError
from . import _signals
from ._cancel import CancelState, mark_reason
from ._children import (
    ChildFailed,
    OnParentCancel,
    cancel_children,
    child_error,
    start_child,
    wait_child,
)
from ._context import _CURRENT_STEP, StepInfo, WorkflowContext
from ._continue import run_generations
from ._errors import NonDeterminismError, StepFailed
from ._records import (
    Applied,
    RunRecord,
    RunStatus,
    StepKind,
    StepRecord,
    StepState,
    ended_attempt,
    error_from_json,
    error_to_json,
    normalize_json,
    patch_marker,
)
from ._replay import History
from ._step_timeouts import StepTimeouts, check_step_known, with_timeouts
from ._stream import emitter_of, fixed_store
from ._updates import UpdateServant, UpdatingDriver
from ._versioning import blocked_error
from ._versioning import code_fingerprint as fingerprint_of

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._app import WorkflowDefinition
    from ._retry import Retry
    from ._services import DriverServices
    from ._waits import StepWaiter

__all__ = [
    "UNCONFIRMED_GRACE",
    "RunDriver",
    "describe_error",
    "local_failure",
    "send_step",
    "send_unconfirmed",
    "settled_outcome",
]

#: Seconds a replayed attempt whose dispatch was never recorded waits for a result already
#: queued (its task may have gone out before its engine died) before it is sent again.
UNCONFIRMED_GRACE = 1.0


def fingerprint(definition: WorkflowDefinition) -> str | None:
    """The fingerprint of ``definition``'s code (``None``: remote)."""
    return fingerprint_of(definition.fn)


def describe_error(exc: BaseException) -> dict[str, Any]:
    """A run failure as the run store keeps it (JSON)."""
    described: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, StepFailed):
        described.update(
            step=exc.step_name,
            stepId=exc.step_id,
            attempts=exc.attempts,
            error=error_to_json(exc.error),
        )
    elif isinstance(exc, NonDeterminismError):
        described.update(stepId=exc.step_id, expected=exc.expected, found=exc.found)
    elif isinstance(exc, ChildFailed) and exc.step_id is not None:
        described.update(stepId=exc.step_id, childRunId=exc.child_run_id)
    return described


def local_failure(exc: Exception, policy: Retry) -> StepError:
    """How a local step's exception is recorded: retryable unless it says otherwise
    (``retryable = False``), is bad input, or ``policy`` names it non-retryable."""
    retryable = getattr(exc, "retryable", True) is not False and not (
        isinstance(exc, PayloadError) or policy.is_non_retryable(exc)
    )
    return StepError(
        message=f"{type(exc).__name__}: {exc}", code=type(exc).__name__, retryable=retryable
    )


def settled_outcome(record: StepRecord) -> Any:
    """A finished checkpoint's outcome: its output, or :class:`StepFailed`."""
    if record.status is StepState.COMPLETED:
        return record.output
    raise StepFailed(record.name, record.step_id, record.attempt, error_from_json(record.error))


async def send_step(
    services: DriverServices, record: StepRecord, waiter: StepWaiter | None
) -> None:
    """Dispatch ``record``'s current attempt (held back until its ``wake_at``); a task that
    cannot be sent at all (too large, ...) fails the step, since no retry can help."""
    delay = 0.0 if record.wake_at is None else max(0.0, record.wake_at - services.store.now())
    try:
        await services.dispatch(record, delay)
    except PayloadError as exc:
        await fail_unsent(services, record, waiter, exc)


async def send_unconfirmed(
    services: DriverServices, record: StepRecord, waiter: StepWaiter
) -> None:
    """Send again, replayed, a first attempt (no ``wake_at``) whose dispatch was never
    recorded: its engine died between checkpointing it and recording its dispatch. If the
    task had gone out, its result may be queued for this engine's results loop (started with
    the engine), or come soon from a worker still running it: one applied within
    :data:`UNCONFIRMED_GRACE` settles the step (``waiter``) and nothing is sent twice. Else it
    is sent (counted ``redispatched``). A retry or an operator's reopening (a ``wake_at``) is
    sent at once, as before: an operator's retry must not wait, and the window is a first
    attempt's in the common case."""
    with trio.move_on_after(UNCONFIRMED_GRACE):
        await waiter.wait()
        return
    services.count("redispatched")
    await send_step(services, record, waiter)


async def fail_unsent(
    services: DriverServices, record: StepRecord, waiter: StepWaiter | None, exc: PayloadError
) -> None:
    """Fail ``record``'s step, not retryable: its task could not be sent (too large, not
    JSON, its concurrency key function failed)."""
    code = getattr(exc, "code", "bad_input")  # (a concurrency key's: its own code)
    error = StepError(message=str(exc), code=code, retryable=False)
    stored = error_to_json(error)
    failed = attrs.evolve(
        record,
        status=StepState.FAILED,
        error=stored,
        attempts=ended_attempt(record, ended_at=services.store.now(), error=stored),
    )
    verdict = await services.guard(
        lambda: services.store.update_step(failed, expect_attempt=record.attempt),
        "checkpointing",
    )
    if verdict is Applied.APPLIED and waiter is not None:
        waiter.update(failed)


class RunDriver:
    """Drives one run (see the module docstring). Created and started by the engine."""

    continues_as_new = True
    """``ctx.continue_as_new`` works in its runs (:mod:`._continue`; a remote run's does not)."""

    def __init__(self, services: DriverServices, run: RunRecord, history: list[StepRecord]) -> None:
        self.services = services
        self.run = run
        self.history = History(run.run_id, history)
        self.scope = trio.CancelScope()
        self.done = trio.Event()
        self.final: RunRecord | None = None
        """The run as this driver settled it (``None``: it stopped without settling it)."""
        self.settling = False
        self.signal_bell: trio.Event | None = None
        """Set by ``engine.signal`` to wake a ``wait_signal`` of this run."""
        """The workflow returned; the driver is writing its outcome."""
        self.cancel = CancelState()
        """A cancel delivered inside the workflow (:mod:`._cancel`)."""
        self.grace = trio.CancelScope()
        """Around the workflow: its deadline cuts a cancelled run's compensation."""
        self.markers: list[str] = []
        """Version markers (``ctx.patched``) to write before the next checkpoint."""

        self.children = False
        """The workflow started child workflows (ended with it unless abandoned)."""
        self.updates = UpdateServant(self)
        """The run's updates (``ctx.on_update``, ``engine.update``: :mod:`._updates`)."""

    # ------------------------------------------------------------------ the workflow

    async def drive(self, definition: WorkflowDefinition) -> None:
        """:meth:`_drive`, its updates served by the engine's update desk once a request may
        have come (:mod:`._update_desk`); what their serving raised, raised here."""
        updates, desk = self.updates, self.services.update_desk
        desk.begin(updates)  # served now, or once a request may have come (._update_desk)
        try:
            await self._drive(definition)
        finally:
            desk.end(updates)
        if updates.failed is not None:
            raise updates.failed

    async def _drive(self, definition: WorkflowDefinition) -> None:
        """Run the workflow to its end and settle the run (completed or failed).

        Cancellation:
            Cancelling :attr:`scope` (a cancel, a lost lease, the engine closing) stops the run
            where it waits, writing nothing; whoever cancelled settles it (or not).
        """
        services = self.services
        run = self.run
        try:
            with self.scope:
                mark = self.history.cancel_mark
                if mark is not None:  # cancelled mid-compensation by a dead engine: ended
                    self.settling = True
                    cut = {"type": "RunCancelled", "message": mark_reason(mark), "cut": True}
                    self.final = await services.settle(run, RunStatus.CANCELLED, error=cut)
                    return
                driver = UpdatingDriver(self, self.updates)  # its calls counted (updates)
                ctx = WorkflowContext(driver, run, self.history, app=services.app)
                status = RunStatus.COMPLETED
                output: Any = None
                error = None
                try:
                    with self.grace:  # every generation (continue-as-new: ._continue)
                        value = await run_generations(self, definition, ctx)
                    if self.grace.cancelled_caught:
                        raise self.cancel.error(run.run_id)
                    self.history.check_exhausted()
                    output = normalize_json(value, f"the return value of workflow {run.workflow!r}")
                except NonDeterminismError as exc:
                    status, error = RunStatus.BLOCKED, blocked_error(exc, fingerprint(definition))
                except Exception as exc:
                    failure: Exception = exc
                    try:  # code that diverged may fail before it reaches the rest of history
                        self.history.check_exhausted()
                    except NonDeterminismError as diverged:
                        failure = diverged
                    status, error = RunStatus.FAILED, describe_error(failure)
                    if isinstance(failure, NonDeterminismError):
                        status = RunStatus.BLOCKED
                        error = blocked_error(failure, fingerprint(definition))
                if self.cancel.requested:  # ends cancelled, whatever the workflow did
                    status, output = RunStatus.CANCELLED, None
                    error = {
                        "type": "RunCancelled",
                        "message": self.cancel.reason,
                        "cut": self.grace.cancelled_caught,
                    }
                if isinstance(error, dict) and error.get("type") == "NonDeterminismError":
                    services.count("nondeterminism_failures")
                self.settling = True  # a lease renewal must not cancel the final write
                self.final = await services.settle(self.run, status, output=output, error=error)
                if self.children and self.final is not None:
                    # No orphan: children it started and never awaited end with it (issue 18).
                    await self._end_children()
        finally:
            services.forget(self)
            self.done.set()

    # ------------------------------------------------------------------ remote steps

    async def remote(
        self,
        step_id: str,
        name: str,
        input: Any,
        retry: Retry | None,
        priority: int | None,
        timeouts: StepTimeouts | None = None,
    ) -> Any:
        return await self.cancel.around(
            self.run.run_id,
            lambda: self._remote(step_id, name, input, retry, priority, timeouts),
        )

    async def local(
        self, step_id: str, name: str, fn: Callable[[], Any], retry: Retry | None
    ) -> Any:
        return await self.cancel.around(
            self.run.run_id, lambda: self._local(step_id, name, fn, retry)
        )

    async def timer(self, step_id: str, seconds: float) -> None:
        await self.cancel.around(self.run.run_id, lambda: self._timer(step_id, seconds))

    async def _remote(
        self,
        step_id: str,
        name: str,
        input: Any,
        retry: Retry | None,
        priority: int | None,
        timeouts: StepTimeouts | None = None,
    ) -> Any:
        services = self.services
        store = services.store
        run_id = self.run.run_id
        await self._flush_markers()
        known = self.history.take(step_id, StepKind.REMOTE, name)
        if known is None:
            check_step_known(name, services.app.name, services.app.steps)
        if known is not None and known.status is not StepState.PENDING:
            return settled_outcome(known)
        key = (run_id, step_id)
        # Watch BEFORE reading or writing the store: a result applied from now on reaches us.
        waiter = services.waiters.watch(key)
        try:
            if known is None:
                step = services.step_definition(name)
                fresh = StepRecord(
                    run_id=run_id,
                    step_id=step_id,
                    kind=StepKind.REMOTE,
                    name=name,
                    status=StepState.PENDING,
                    input=input,
                    retry=with_timeouts(
                        services.retry_for(name, retry).to_json(),
                        (timeouts or StepTimeouts()).over(StepTimeouts.of(step)),
                    ),
                    priority=priority if priority is not None else step.priority if step else None,
                    heartbeat_timeout=step.heartbeat_timeout if step else None,
                )
                record = await services.guard(lambda: store.begin_step(fresh), "checkpointing")
                self.history.check(record, StepKind.REMOTE, name)
            else:
                applying = services.applying.get(key)
                if applying is not None:  # a result of it being applied here: let it finish
                    await applying.wait()
                found = await services.guard(lambda: store.get_step(run_id, step_id), "reading")
                record = found if found is not None else known
            waiter.update(record)
            if record.status is StepState.PENDING and not record.dispatched:
                if known is None:
                    await send_step(services, record, waiter)
                elif record.wake_at is None:
                    await send_unconfirmed(services, record, waiter)
                else:  # a retry or an operator's reopening: at once (send_unconfirmed)
                    services.count("redispatched")
                    await send_step(services, record, waiter)
            return settled_outcome(await waiter.wait())
        finally:
            services.waiters.unwatch(key, waiter)

    # ------------------------------------------------------------------ local steps

    async def _local(
        self, step_id: str, name: str, fn: Callable[[], Any], retry: Retry | None
    ) -> Any:
        services = self.services
        store = services.store
        run_id = self.run.run_id
        await self._flush_markers()
        record = self.history.take(step_id, StepKind.LOCAL, name)
        policy = retry if retry is not None else services.default_retry
        if record is None:
            fresh = StepRecord(
                run_id=run_id,
                step_id=step_id,
                kind=StepKind.LOCAL,
                name=name,
                status=StepState.PENDING,
                retry=policy.to_json(),
                created_at=store.now(),
            )
            record = await self._first_local(fresh, fn, policy)
        while record.status is StepState.PENDING:
            if record.wake_at is not None:
                await services.sleep_until(record.wake_at)
            ok, value = self._call_local(record, fn)
            record = await self._checkpoint_local(
                record, await self._end_local(record, ok, value, policy)
            )
        return settled_outcome(record)

    async def _first_local(
        self, fresh: StepRecord, fn: Callable[[], Any], policy: Retry
    ) -> StepRecord:
        """A fresh local step's first attempt and its checkpoints: the step's record after
        them (pending again: a retry is due).

        ``fn`` is called before anything is written. When it returns (or raises) without
        awaiting, nothing of the run can have been seen between the call and the checkpoint
        of its outcome, so that outcome is the step's first write, where a pending checkpoint
        and then its outcome would be two (a sync ``fn``, as most local steps are: the time,
        an id). When it returns an awaitable, the pending checkpoint is written first and the
        awaitable awaited after it, so a long wait shows in the run's history as it runs. A
        crash before the outcome's checkpoint re-runs it on resume either way."""
        services = self.services
        store = services.store
        ok, value = self._call_local(fresh, fn)
        if not (ok and inspect.isawaitable(value)):
            following = await self._end_local(fresh, ok, value, policy)
            stored = await services.guard(
                lambda: store.begin_step_unless_finished(following), "checkpointing"
            )
            if stored is None:  # the run was settled meanwhile (cancelled by another engine)
                await self._stop()
                raise AssertionError("unreachable")  # pragma: no cover
            self.history.check(stored, StepKind.LOCAL, fresh.name)
            return stored  # (another engine's record when one was there: followed)
        try:
            record = await services.guard(lambda: store.begin_step(fresh), "checkpointing")
            self.history.check(record, StepKind.LOCAL, fresh.name)
        except BaseException:
            _close_unstarted(value)
            raise
        if record.status is not StepState.PENDING or record.attempt != fresh.attempt:
            _close_unstarted(value)  # a record was there already: it decides
            return record
        return await self._checkpoint_local(
            record, await self._end_local(record, ok, value, policy)
        )

    def _call_local(self, current: StepRecord, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """``fn()`` as ``current``'s attempt: ``(True, its value or awaitable)`` or ``(False,
        the exception it raised)``."""
        self.services.count("local_steps_run")
        token = _CURRENT_STEP.set(self._local_info(current))
        try:
            return True, fn()
        except Exception as exc:
            return False, exc
        finally:
            _CURRENT_STEP.reset(token)

    def _local_info(self, current: StepRecord) -> StepInfo:
        store = self.services.store
        emitter = emitter_of(
            partial(fixed_store, store), current.run_id, current.step_id, current.attempt
        )
        return StepInfo(
            current.run_id, current.step_id, current.attempt, current.name, "local",
            emitter=emitter,
        )  # fmt: skip

    async def _end_local(
        self, current: StepRecord, ok: bool, value: Any, policy: Retry
    ) -> StepRecord:
        """The record ``current``'s attempt ends in: ``value`` (awaited first if it is an
        awaitable) or the exception ``fn`` raised."""
        services = self.services
        store = services.store
        if ok:
            try:
                if inspect.isawaitable(value):  # (a value returned: its step's context is over)
                    token = _CURRENT_STEP.set(self._local_info(current))
                    try:
                        value = await value
                    finally:
                        _CURRENT_STEP.reset(token)
                output = normalize_json(value, f"the result of local step {current.name!r}")
            except Exception as exc:
                ok, value = False, exc
        if ok:
            return attrs.evolve(
                current,
                status=StepState.COMPLETED,
                output=output,
                attempts=ended_attempt(current, ended_at=store.now()),
            )
        failure = local_failure(value, policy)
        error = error_to_json(failure)
        # The engine runs a local step: no worker to name in its log.
        current = attrs.evolve(
            current, attempts=ended_attempt(current, ended_at=store.now(), error=error)
        )
        if failure.retryable and current.attempt < policy.max_attempts:
            delay = policy.delay(current.attempt, rng=services.rng_for(current))
            return attrs.evolve(
                current, attempt=current.attempt + 1, wake_at=store.now() + delay, error=error
            )
        return attrs.evolve(current, status=StepState.FAILED, error=error)

    async def _checkpoint_local(self, current: StepRecord, following: StepRecord) -> StepRecord:
        """Write ``following`` over ``current`` (compare-and-set on the attempt): the step's
        record after it (the store's, when someone else moved it on)."""
        services = self.services
        store = services.store
        verdict = await services.guard(
            partial(store.update_step, following, expect_attempt=current.attempt),
            "checkpointing",
        )
        if verdict is Applied.APPLIED:
            return following
        if verdict is Applied.RUN_FINISHED:
            await self._stop()
        # someone else (another engine, split brain) moved it on: follow the store
        run_id, step_id = current.run_id, current.step_id
        found = await services.guard(lambda: store.get_step(run_id, step_id), "reading")
        if found is None:
            await self._stop()
            raise AssertionError("unreachable")  # pragma: no cover
        return found

    # ------------------------------------------------------------------ timers

    async def _timer(self, step_id: str, seconds: float) -> None:
        services = self.services
        store = services.store
        await self._flush_markers()
        record = self.history.take(step_id, StepKind.TIMER, "sleep")
        if record is None:
            fresh = StepRecord(
                run_id=self.run.run_id,
                step_id=step_id,
                kind=StepKind.TIMER,
                name="sleep",
                status=StepState.PENDING,
                input=seconds,
                wake_at=store.now() + seconds,
            )
            record = await services.guard(lambda: store.begin_step(fresh), "checkpointing")
            self.history.check(record, StepKind.TIMER, "sleep")
        if record.status is not StepState.PENDING:
            return
        assert record.wake_at is not None
        await services.sleep_until(record.wake_at)
        fired = attrs.evolve(record, status=StepState.COMPLETED)
        verdict = await services.guard(
            lambda: store.update_step(fired, expect_attempt=record.attempt), "checkpointing"
        )
        if verdict is Applied.RUN_FINISHED:
            await self._stop()
        services.count("timers_fired")

    # ------------------------------------------------------------------ signals, events

    async def wait_signal(self, step_id: str, name: str, seq: int, timeout: float | None) -> Any:  # noqa: ASYNC109 (a durable deadline, not a trio one)
        # A cancel delivered inside the workflow interrupts the wait as it does a step's.
        return await self.cancel.around(
            self.run.run_id, lambda: _signals.wait_signal(self, step_id, name, seq, timeout)
        )

    async def set_event(self, step_id: str, key: str, value: Any) -> None:
        await _signals.set_event(self, step_id, key, value)

    def mark_patch(self, change_id: str) -> None:
        self.markers.append(change_id)

    async def _flush_markers(self) -> None:
        """Write the pending version markers: a later checkpoint never lands before them."""
        while self.markers:
            change_id = self.markers[0]
            store, marker = self.services.store, patch_marker(self.run.run_id, change_id)
            await self.services.guard(partial(store.begin_step, marker), "checkpointing")
            if self.markers and self.markers[0] == change_id:
                self.markers.pop(0)

    # ------------------------------------------------------------------ child workflows

    async def child_start(
        self,
        step_id: str,
        workflow: str,
        input: Any,
        run_id: str | None,
        on_parent_cancel: OnParentCancel,
    ) -> StepRecord:
        self.children = True
        record = await start_child(
            self.services, self.history, self.run, step_id, workflow, input, run_id,
            on_parent_cancel,
        )  # fmt: skip
        if record is None:  # this run ended meanwhile (cancelled): no child under it
            await self._stop()
            raise AssertionError("unreachable")  # pragma: no cover
        if record.status is StepState.FAILED:  # refused (its depth): raised here, at once
            assert isinstance(record.input, dict)
            raise child_error(str(record.input["runId"]), record)
        return record

    async def _end_children(self) -> None:
        services = self.services
        await services.guard(
            lambda: cancel_children(
                services.store,
                self.run.run_id,
                services.cancel_run,
                ended=f"ended ({self.final.status.value if self.final else 'settled'})",
                descend_ended=False,
            ),
            "cancelling children",
        )

    async def child_wait(self, record: StepRecord) -> Any:
        # A cancelled parent stops waiting (RunCancelled); its end cancels the child.
        return await self.cancel.around(
            self.run.run_id, lambda: wait_child(self.services, record, self._stop)
        )

    async def _stop(self) -> None:
        """The run was settled elsewhere (cancelled by another engine): stop driving it."""
        self.scope.cancel()
        await trio.lowlevel.checkpoint()


def _close_unstarted(value: Any) -> None:
    """Close a local step's coroutine that will not be awaited (nothing of it ran)."""
    close = getattr(value, "close", None)
    if inspect.iscoroutine(value) and close is not None:
        close()
