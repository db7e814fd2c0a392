"""One turn of a remote workflow, on a workflow worker (T14, docs/spec.md).

The engine sends a :class:`~durable_trio.WorkflowTask` carrying the run's input and history;
the worker replays the workflow function against that history, exactly as an engine replays a
local workflow, and answers with a :class:`~durable_trio.WorkflowDecision`:

- every ``ctx.step`` / ``ctx.sleep`` the history settles returns (or raises) its outcome;
- a call history does not hold yet becomes a *command* (``{"type": "step", ...}`` or
  ``{"type": "sleep", ...}``) and that thread of the workflow waits;
- a call history holds as still pending just waits (the engine already scheduled it);
- ``ctx.run`` (a local step) runs HERE, retried in the turn per its policy; its outcome is
  streamed to the engine as :class:`~durable_trio.StepEvent`\\ s (T16) and also carried in the
  decision as a ``{"type": "local", ...}`` command (the engine checkpoints it once either way).

The turn ends when every thread of the workflow waits (decision ``continued`` with the
commands), or when the workflow returns (``completed``) or raises (``failed``). A history that
diverges from the code fails the run with ``NonDeterminismError``, as in the engine.
"""

from __future__ import annotations

import inspect
import math
import time
from typing import TYPE_CHECKING, Any

import trio
from trio_util import run_and_cancelling

from .._errors import BrokerError, DurableTrioError, PayloadError
from .._failures import report_through
from .._wire import DecisionStatus, StepError, StepEvent, StepEventKind, WorkflowDecision
from ._cancel import lands_on, mark_reason
from ._children import ChildDepthExceeded, child_error, child_run_id
from ._context import _CURRENT_STEP, Quiescence, StepInfo, WorkflowContext
from ._errors import EngineError, NonDeterminismError, RunCancelled, StepFailed
from ._payloads import call_workflow
from ._records import (
    RunRecord,
    RunStatus,
    StepKind,
    StepRecord,
    StepState,
    error_to_json,
    normalize_json,
    step_from_json,
)
from ._replay import PATCH_PREFIX, History
from ._retry import Retry
from ._runtime import describe_error, local_failure, settled_outcome
from ._versioning import code_fingerprint

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._transport._facade import QueueTransport
    from .._wire import WorkflowTask
    from ._app import App, WorkflowDefinition
    from ._step_timeouts import StepTimeouts

__all__ = ["TurnDriver", "TurnTimeout", "run_turn"]


class TurnDriver:
    """Answers a workflow's ``ctx`` calls during one turn (see the module docstring)."""

    def __init__(self, task: WorkflowTask, history: History, transport: QueueTransport) -> None:
        self.task = task
        self.history = history
        self.transport = transport
        self.tracker = Quiescence()
        self.commands: list[dict[str, Any]] = []
        self.fatal: NonDeterminismError | None = None
        self.child_ids: dict[str, str] = {}
        """Step id: the child run id of each ``ctx.child`` call this turn made."""

    def _take(self, step_id: str, kind: StepKind, name: str) -> StepRecord | None:
        try:
            record = self.history.take(step_id, kind, name)
        except NonDeterminismError as exc:
            if self.fatal is None:
                self.fatal = exc
            raise
        mark = self.history.cancel_mark
        if mark is not None and lands_on(mark, step_id):  # where the cancel landed
            error = {"type": "RunCancelled", "message": mark_reason(mark)}
            raise RunCancelled(self.task.run_id, error)
        return record

    async def remote(
        self,
        step_id: str,
        name: str,
        input: Any,
        retry: Retry | None,
        priority: int | None,
        timeouts: StepTimeouts | None = None,
    ) -> Any:
        known = self._take(step_id, StepKind.REMOTE, name)
        if known is not None:
            if known.status is not StepState.PENDING:
                return settled_outcome(known)
        else:
            command: dict[str, Any] = {
                "type": "step",
                "stepId": step_id,
                "name": name,
                "input": input,
            }
            if retry is not None:
                command["retry"] = retry.to_json()
            if priority is not None:
                command["priority"] = priority
            if timeouts is not None and timeouts.to_json():
                command["timeouts"] = timeouts.to_json()
            self.commands.append(command)
        await self.tracker.block()
        raise AssertionError("unreachable")  # pragma: no cover

    def mark_patch(self, change_id: str) -> None:
        self.commands.append(
            {"type": "patch", "stepId": PATCH_PREFIX + change_id, "name": change_id}
        )

    async def child_start(
        self,
        step_id: str,
        workflow: str,
        input: Any,
        run_id: str | None,
        on_parent_cancel: str,
    ) -> StepRecord:
        """``ctx.child`` / ``ctx.start_child``: a ``{"type": "child", ...}`` command the
        engine checkpoints and starts (issue 18); this thread waits for it."""
        child_id = run_id if run_id is not None else child_run_id(self.task.run_id, step_id)
        self.child_ids[step_id] = child_id  # the history a turn gets holds no step inputs
        known = self._take(step_id, StepKind.CHILD, workflow)
        if known is not None:
            refused = child_error(child_id, known)
            if isinstance(refused, ChildDepthExceeded):  # raised at the call, as in the engine
                raise refused
            return known
        self.commands.append(
            {
                "type": "child",
                "stepId": step_id,
                "name": workflow,
                "input": input,
                "runId": child_id,
                "onParentCancel": on_parent_cancel,
            }
        )
        await self.tracker.block()
        raise AssertionError("unreachable")  # pragma: no cover

    async def child_wait(self, record: StepRecord) -> Any:
        if record.status is StepState.PENDING:  # the engine settles it once the child ends
            await self.tracker.block()
        if record.status is StepState.COMPLETED:
            return record.output
        raise child_error(self.child_ids[record.step_id], record)

    async def timer(self, step_id: str, seconds: float) -> None:
        known = self._take(step_id, StepKind.TIMER, "sleep")
        if known is not None:
            if known.status is not StepState.PENDING:
                return
        else:
            self.commands.append({"type": "sleep", "stepId": step_id, "seconds": seconds})
        await self.tracker.block()

    async def wait_signal(
        self,
        step_id: str,
        name: str,
        seq: int,
        timeout: float | None,  # noqa: ASYNC109 (a durable deadline, not a trio one)
    ) -> Any:
        from ._signals import outcome

        known = self._take(step_id, StepKind.SIGNAL, name)
        if known is not None:
            if known.status is not StepState.PENDING:
                return outcome(known)
        else:
            self.commands.append(
                {"type": "signal", "stepId": step_id, "name": name, "seq": seq,
                 "timeout": timeout}
            )  # fmt: skip
        await self.tracker.block()
        raise AssertionError("unreachable")  # pragma: no cover

    async def set_event(self, step_id: str, key: str, value: Any) -> None:
        known = self._take(step_id, StepKind.EVENT, key)
        if known is None:
            self.commands.append({"type": "event", "stepId": step_id, "key": key, "value": value})
            await self.tracker.block()

    async def local(
        self, step_id: str, name: str, fn: Callable[[], Any], retry: Retry | None
    ) -> Any:
        known = self._take(step_id, StepKind.LOCAL, name)
        if known is not None and known.status is not StepState.PENDING:
            return settled_outcome(known)
        policy = retry if retry is not None else Retry()
        run_id = self.task.run_id
        await self._event(step_id, name, StepEventKind.STARTED, 1)
        attempt = 1
        while True:
            token = _CURRENT_STEP.set(StepInfo(run_id, step_id, attempt, name, "local"))
            try:
                value = fn()
                if inspect.isawaitable(value):
                    value = await value
                output = normalize_json(value, f"the result of local step {name!r}")
            except Exception as exc:
                error = local_failure(exc, policy)
                if error.retryable and attempt < policy.max_attempts:
                    await trio.sleep(policy.delay(attempt))
                    attempt += 1
                    continue
                self._local(step_id, name, attempt, StepState.FAILED, error=error_to_json(error))
                await self._event(step_id, name, StepEventKind.FAILED, attempt, error=error)
                raise StepFailed(name, step_id, attempt, error) from exc
            finally:
                _CURRENT_STEP.reset(token)
            self._local(step_id, name, attempt, StepState.COMPLETED, output=output)
            await self._event(step_id, name, StepEventKind.COMPLETED, attempt, output=output)
            return output

    def _local(
        self,
        step_id: str,
        name: str,
        attempt: int,
        status: StepState,
        *,
        output: Any = None,
        error: Any = None,
    ) -> None:
        command: dict[str, Any] = {
            "type": "local",
            "stepId": step_id,
            "name": name,
            "status": status.value,
            "attempt": attempt,
        }
        if output is not None:
            command["output"] = output
        if error is not None:
            command["error"] = error
        self.commands.append(command)

    async def _event(
        self,
        step_id: str,
        name: str,
        kind: StepEventKind,
        attempt: int,
        *,
        output: Any = None,
        error: StepError | None = None,
    ) -> None:
        """Stream a local step's lifecycle to the engine (T16). Best-effort: the decision
        carries the outcome too, so a failed push is reported, never fatal to the turn."""
        event = StepEvent(
            self.task.run_id, step_id, kind, attempt, time.time(), output, error, name
        )
        try:
            await self.transport.remote.dispatch_step_event(event)
        except (BrokerError, DurableTrioError) as exc:
            report_through(self.transport.options.on_error, exc)


def _failed(
    task: WorkflowTask,
    exc: BaseException,
    commands: list[dict[str, Any]],
    fingerprint: str | None = None,
) -> WorkflowDecision:
    described = describe_error(exc)
    if isinstance(exc, NonDeterminismError):  # the run is parked: say on which code
        described["fingerprint"] = fingerprint
    error = StepError(
        message=str(exc) or type(exc).__name__,
        code=type(exc).__name__,
        retryable=False,
        details=described,
    )
    return WorkflowDecision(
        task.task_id, task.run_id, DecisionStatus.FAILED, tuple(commands), error=error
    )


class TurnTimeout(EngineError):
    """A turn ran past its worker's ``turn_limit``: workflow code that awaits something other
    than ``ctx`` calls, or local steps longer than the limit. The run fails with it."""


async def run_turn(
    definition: WorkflowDefinition,
    transport: QueueTransport,
    task: WorkflowTask,
    *,
    limit: float = math.inf,
    app: App | None = None,
) -> WorkflowDecision:
    """Replay ``definition`` over ``task.history`` until every thread waits or it ends; the
    decision says which (see the module docstring). A turn still going after ``limit``
    seconds fails the run (:class:`TurnTimeout`): nothing waits forever."""
    assert definition.fn is not None
    try:
        records = [step_from_json(task.run_id, entry) for entry in task.history]
    except PayloadError as exc:
        return _failed(task, exc, [])
    history = History(task.run_id, records)
    driver = TurnDriver(task, history, transport)
    run = RunRecord(task.run_id, task.workflow, task.input, RunStatus.RUNNING, 0.0, 0.0)
    ctx = WorkflowContext(driver, run, history, app=app)
    ended: list[tuple[DecisionStatus, Any]] = []

    async def body() -> None:
        assert definition.fn is not None
        try:
            value = await call_workflow(definition.fn, ctx, task.input, task.workflow)
            history.check_exhausted()
            output = normalize_json(value, f"the return value of workflow {task.workflow!r}")
            ended.append((DecisionStatus.COMPLETED, output))
        except Exception as exc:
            failure: Exception = exc
            if not isinstance(exc, NonDeterminismError):
                try:  # code that diverged may fail before it reaches the rest of history
                    history.check_exhausted()
                except NonDeterminismError as diverged:
                    failure = diverged
            ended.append((DecisionStatus.FAILED, failure))
        finally:
            driver.tracker.finish()

    async with run_and_cancelling(body):
        with trio.move_on_after(limit) as bounded:
            await driver.tracker.settled.wait()
    if bounded.cancelled_caught and not ended and driver.fatal is None:
        stuck = TurnTimeout(
            f"the turn of workflow {task.workflow!r} was still going after {limit:g} s "
            "(workflow code must await only ctx calls; raise the worker's turn_limit for "
            "longer local steps)"
        )
        return _failed(task, stuck, [])
    if driver.fatal is not None:
        return _failed(task, driver.fatal, [], code_fingerprint(definition.fn))
    if not ended:
        return WorkflowDecision(
            task.task_id, task.run_id, DecisionStatus.CONTINUED, tuple(driver.commands)
        )
    status, value = ended[0]
    if status is DecisionStatus.FAILED:
        return _failed(task, value, driver.commands, code_fingerprint(definition.fn))
    return WorkflowDecision(
        task.task_id, task.run_id, DecisionStatus.COMPLETED, tuple(driver.commands), output=value
    )
