"""Child workflows (issue 18, item 3): ``ctx.child`` / ``ctx.start_child``.

Starting a child is a checkpointed step (:attr:`StepKind.CHILD`) whose input records the
child's run id, the child's input and what the parent's cancellation does to it. The child is
an ordinary run in the run store (``engine.start`` with that id, idempotent), so any engine of
the namespace may drive it; the parent's engine learns of its end by waiting on the child's
driver when it drives it too, else by reading the child's run every ``watch_interval``
(docs/decisions.md, "Child workflows: how the parent learns of the end"). The end is then
checkpointed on the CHILD step, so a replay never reads the child again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import trio

from ._errors import EngineError
from ._records import (
    Applied,
    OnParentCancel,
    RunStatus,
    StepKind,
    StepRecord,
    StepState,
    ended_attempt,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._replay import History
    from ._services import DriverServices
    from ._stores._contract import RunStore

__all__ = [
    "ABANDON",
    "CANCEL",
    "ChildFailed",
    "OnParentCancel",
    "cancel_children",
    "cancel_tree",
    "child_ids",
    "child_run_id",
    "start_child",
    "wait_child",
]

CANCEL: OnParentCancel = "cancel"
ABANDON: OnParentCancel = "abandon"
_FINAL = (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED)


class ChildFailed(EngineError):
    """A child workflow (``ctx.child`` / ``ctx.start_child``) failed or was cancelled; raised
    INTO the parent, where its code may catch it (and compensate).

    Attributes:
        child_run_id: the child's run id.
        workflow: the child's workflow name.
        error: the child's stored error (``{"type": ..., "message": ..., ...}``).
        cancelled: the child was cancelled rather than failed.
        step_id: the parent's CHILD step that started it (a parent failed by it names it in
            its error, so that ``runs retry`` of the parent retries the child first).
    """

    def __init__(
        self, child_run_id: str, workflow: str, error: Any, step_id: str | None = None
    ) -> None:
        described = error if isinstance(error, dict) else {"message": str(error)}
        self.child_run_id = child_run_id
        self.step_id = step_id
        self.workflow = workflow
        self.error: dict[str, Any] = described
        self.cancelled = described.get("type") == "RunCancelled"
        verb = "was cancelled" if self.cancelled else "failed"
        super().__init__(
            f"child run {child_run_id!r} of workflow {workflow!r} {verb}: "
            f"{described.get('type', 'Error')}: {described.get('message', '')}"
        )


def child_run_id(parent_run_id: str, step_id: str) -> str:
    """The default run id of the child started by step ``step_id`` of ``parent_run_id``."""
    return f"{parent_run_id}/{step_id}"


def child_ids(steps: list[StepRecord], *, abandoned: bool = True) -> list[str]:
    """The run ids of the children started by the steps ``steps`` of one run (``abandoned=False``:
    only those the parent's cancellation cancels)."""
    found = []
    for step in steps:
        if step.kind is not StepKind.CHILD or not isinstance(step.input, dict):
            continue
        if not abandoned and step.input.get("onParentCancel") == ABANDON:
            continue
        run_id = step.input.get("runId")
        if isinstance(run_id, str):
            found.append(run_id)
    return found


async def start_child(
    services: DriverServices,
    history: History,
    parent_run_id: str,
    step_id: str,
    workflow: str,
    input: Any,
    run_id: str | None,
    on_parent_cancel: OnParentCancel,
    start_run: Callable[[str, Any, str, str], Awaitable[str]],
) -> StepRecord:
    """Checkpoint the CHILD step (or replay it), then start the child run (idempotent: on replay
    after a crash between the two, the existing run is returned, never a second one)."""
    store = services.store
    record = history.take(step_id, StepKind.CHILD, workflow)
    if record is None:
        fresh = StepRecord(
            run_id=parent_run_id,
            step_id=step_id,
            kind=StepKind.CHILD,
            name=workflow,
            status=StepState.PENDING,
            input={
                "runId": run_id if run_id is not None else child_run_id(parent_run_id, step_id),
                "input": input,
                "onParentCancel": on_parent_cancel,
            },
        )
        record = await services.guard(lambda: store.begin_step(fresh), "checkpointing")
        history.check(record, StepKind.CHILD, workflow)
    if record.status is StepState.PENDING:
        assert isinstance(record.input, dict)
        child_id = str(record.input["runId"])
        await start_run(workflow, record.input.get("input"), child_id, parent_run_id)
    return record


async def wait_child(
    services: DriverServices, record: StepRecord, stop: Callable[[], Awaitable[None]]
) -> Any:
    """Wait for the child of CHILD step ``record`` to end, checkpoint its end, and return its
    output (or raise :class:`ChildFailed`)."""
    assert isinstance(record.input, dict)
    child_id = str(record.input["runId"])
    if record.status is StepState.PENDING:
        record = await _settle(services, record, child_id, stop)
    if record.status is StepState.COMPLETED:
        return record.output
    raise ChildFailed(child_id, record.name, record.error, record.step_id)


async def _settle(
    services: DriverServices,
    record: StepRecord,
    child_id: str,
    stop: Callable[[], Awaitable[None]],
) -> StepRecord:
    store = services.store
    interval = services.options.watch_interval or 1.0
    while True:
        driver = services.drivers.get(child_id)
        if driver is not None:  # driven here: its end is an event, no polling
            await driver.done.wait()
        child = await services.guard(lambda: store.get_run(child_id), "reading")
        if child is None:
            error: Any = {"type": "RunNotFound", "message": f"child run {child_id!r} is gone"}
            ended = attrs.evolve(record, status=StepState.FAILED, error=error)
            break
        if child.status in _FINAL:
            if child.status is RunStatus.COMPLETED:
                ended = attrs.evolve(record, status=StepState.COMPLETED, output=child.output)
            else:
                ended = attrs.evolve(record, status=StepState.FAILED, error=child.error)
            break
        if driver is None:
            await trio.sleep(interval)
    ended = attrs.evolve(ended, attempts=ended_attempt(ended, ended_at=store.now()))
    verdict = await services.guard(
        lambda: store.update_step(ended, expect_attempt=record.attempt), "checkpointing"
    )
    if verdict is Applied.RUN_FINISHED:
        await stop()
    elif verdict is not Applied.APPLIED:
        found = await services.guard(
            lambda: store.get_step(record.run_id, record.step_id), "reading"
        )
        if found is not None and found.status is not StepState.PENDING:
            return found
    return ended


async def cancel_children(
    store: RunStore,
    run_id: str,
    cancel: Callable[[str, str], Awaitable[Any]],
    *,
    ended: str = "was cancelled",
) -> int:
    """Cancel the running children of run ``run_id`` (cancelled, or ended: ``ended`` says how,
    in the children's reason) that did not choose ``abandon``, through ``cancel(child_run_id,
    reason)`` (which cancels their own children in turn). Returns how many were asked."""
    steps = await store.get_steps(run_id)
    asked = 0
    for child in child_ids(steps, abandoned=False):
        record = await store.get_run(child)
        if record is None or record.status in _FINAL:
            continue
        await cancel(child, f"parent run {run_id!r} {ended}")
        asked += 1
    return asked


async def cancel_tree(store: RunStore, run_id: str, reason: str) -> bool:
    """Cancel run ``run_id`` in the store and, recursively, its non-abandoned children (the
    operator's cancel: the owners stop the drivers at their next lease renewal)."""
    error = {"type": "RunCancelled", "message": reason}
    cancelled = await store.finish_run(run_id, RunStatus.CANCELLED, error=error)
    await cancel_children(store, run_id, lambda child, why: cancel_tree(store, child, why))
    return cancelled
