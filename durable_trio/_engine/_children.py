"""Child workflows (issue 18, item 3): ``ctx.child`` / ``ctx.start_child``.

Starting a child is a checkpointed step (:attr:`StepKind.CHILD`) whose input records the
child's run id, the child's input and what the parent's cancellation does to it. The child is
an ordinary run in the run store (``engine.start`` with that id, idempotent), so any engine of
the namespace may drive it; the parent's engine learns of its end by waiting on the child's
driver when it drives it too, else by reading the child's run every ``watch_interval``
(docs/decisions.md, "Child workflows: how the parent learns of the end"). The end is then
checkpointed on the CHILD step, so a replay never reads the child again.

Issue 36: a tree is bounded and its cancel complete. A run's ``depth`` (its ancestors) is
stored with it; a child past the engine's ``max_child_depth`` is refused (its CHILD step
settles failed with ``ChildDepthExceeded``, raised into the parent at once); a default child
run id stays bounded whatever the depth (:func:`child_run_id`); a child is never started under
a parent that ended (its CHILD step is written only while the parent is unfinished, and a
child created as the parent ends is cancelled at once); and cancelling a tree walks it
breadth-first, iteratively, from the root down (:func:`cancel_children`), so a cancel
interrupted half-way is finished by cancelling the root again.
"""

from __future__ import annotations

import hashlib
from collections import deque
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ._errors import EngineError
from ._records import (
    Applied,
    OnParentCancel,
    RunDataError,
    RunRecord,
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
    "CHILD_ID_LIMIT",
    "MAX_CHILD_DEPTH",
    "ChildDepthExceeded",
    "ChildFailed",
    "OnParentCancel",
    "cancel_children",
    "cancel_tree",
    "check_child_steps",
    "child_error",
    "child_ids",
    "child_run_id",
    "child_step",
    "depth_refusal",
    "start_child",
    "start_child_run",
    "wait_child",
]

CANCEL: OnParentCancel = "cancel"
ABANDON: OnParentCancel = "abandon"
_FINAL = (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED)

MAX_CHILD_DEPTH = 100
"""The default ``max_child_depth`` of an engine: a run has at most this many ancestors."""

CHILD_ID_LIMIT = 64
"""A default child run id ``f"{parent}/{step_id}"`` longer than this is hashed instead (see
:func:`child_run_id`)."""

#: The error type of a child refused for its depth (the CHILD step's stored error).
_TOO_DEEP = "ChildDepthExceeded"
#: The most of a child's error message a parent's ChildFailed repeats: a chain failing from
#: its bottom does not grow its messages with its depth.
_MESSAGE_LIMIT = 300


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
        message = str(described.get("message", ""))
        if len(message) > _MESSAGE_LIMIT:
            message = message[:_MESSAGE_LIMIT] + "..."
        super().__init__(
            f"child run {child_run_id!r} of workflow {workflow!r} {verb}: "
            f"{described.get('type', 'Error')}: {message}"
        )


class ChildDepthExceeded(ChildFailed):
    """A child workflow refused: it would have more ancestors than the engine's
    ``max_child_depth`` (issue 36; docs/engine.md, "Child workflows"). Raised into the parent
    by the ``ctx.child`` / ``ctx.start_child`` call, at once and on every replay; the child
    run is never created. Not retryable: a retry of the parent meets the same limit.

    Attributes:
        limit: the engine's ``max_child_depth``.
    """

    def __init__(
        self, child_run_id: str, workflow: str, error: Any, step_id: str | None = None
    ) -> None:
        super().__init__(child_run_id, workflow, error, step_id)
        limit = self.error.get("limit")
        self.limit = limit if isinstance(limit, int) else None


def child_error(child_run_id: str, record: StepRecord) -> ChildFailed:
    """The exception a failed CHILD step raises in its parent."""
    if isinstance(record.error, dict) and record.error.get("type") == _TOO_DEEP:
        return ChildDepthExceeded(child_run_id, record.name, record.error, record.step_id)
    return ChildFailed(child_run_id, record.name, record.error, record.step_id)


def depth_refusal(parent_depth: int, limit: int, workflow: str) -> dict[str, Any] | None:
    """The stored error of a child of a run with ``parent_depth`` ancestors, if ``limit``
    refuses it (``None``: it may start)."""
    if parent_depth + 1 <= limit:
        return None
    return {
        "type": _TOO_DEEP,
        "message": (
            f"child workflow {workflow!r} refused: it would be {parent_depth + 1} levels below "
            f"its root, past the engine's max_child_depth of {limit} (a workflow that starts "
            "itself as a child without end?)"
        ),
        "limit": limit,
        "retryable": False,
    }


def child_run_id(parent_run_id: str, step_id: str) -> str:
    """The default run id of the child started by step ``step_id`` of ``parent_run_id``:
    ``f"{parent_run_id}/{step_id}"`` while that is at most :data:`CHILD_ID_LIMIT` characters,
    else ``f"{head}/~{digest}"``, where ``head`` is what precedes the parent id's first ``/``
    (the root run's id, or a tenant's name: a tenant's children stay in its scope) and
    ``digest`` 32 hex digits of the SHA-256 of the plain form. Deterministic (a replay finds
    the same child), unique as the plain form is, and bounded whatever the depth (issue 36: a
    chain of 21,500 levels had 43 KB ids)."""
    plain = f"{parent_run_id}/{step_id}"
    if len(plain) <= CHILD_ID_LIMIT:
        return plain
    head = parent_run_id.partition("/")[0]
    return f"{head}/~{hashlib.sha256(plain.encode()).hexdigest()[:32]}"


def check_child_steps(run_id: str, steps: list[StepRecord]) -> None:
    """Raise :class:`RunDataError` if a CHILD step of ``steps`` (run ``run_id``'s history) does
    not name its child run (damaged data: replayed, it met a ``KeyError`` or an assertion)."""
    for step in steps:
        if step.kind is StepKind.CHILD and not (
            isinstance(step.input, dict) and isinstance(step.input.get("runId"), str)
        ):
            raise RunDataError(
                f"run {run_id!r}: its stored checkpoint {step.step_id!r} cannot be read "
                f"(a child step whose input names no child run: {step.input!r:.80})"
            )


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


def child_step(
    parent_run_id: str,
    parent_depth: int,
    limit: int,
    step_id: str,
    workflow: str,
    input: Any,
    run_id: str,
    on_parent_cancel: str,
) -> StepRecord:
    """A fresh CHILD checkpoint: pending, or failed at once if ``limit`` refuses the child."""
    refused = depth_refusal(parent_depth, limit, workflow)
    return StepRecord(
        run_id=parent_run_id,
        step_id=step_id,
        kind=StepKind.CHILD,
        name=workflow,
        status=StepState.PENDING if refused is None else StepState.FAILED,
        input={"runId": run_id, "input": input, "onParentCancel": on_parent_cancel},
        error=refused,
    )


async def start_child(
    services: DriverServices,
    history: History,
    parent: RunRecord,
    step_id: str,
    workflow: str,
    input: Any,
    run_id: str | None,
    on_parent_cancel: OnParentCancel,
) -> StepRecord | None:
    """Checkpoint the CHILD step (or replay it), then start the child run (idempotent: on replay
    after a crash between the two, the existing run is returned, never a second one).

    Returns:
        The CHILD step (failed with ``ChildDepthExceeded`` if refused for its depth), or
        ``None``: the parent has ended (cancelled meanwhile): its driver stops.
    """
    store = services.store
    record = history.take(step_id, StepKind.CHILD, workflow)
    if record is None:
        fresh = child_step(
            parent.run_id,
            parent.depth,
            services.options.max_child_depth,
            step_id,
            workflow,
            input,
            run_id if run_id is not None else child_run_id(parent.run_id, step_id),
            on_parent_cancel,
        )
        # Only while the parent is unfinished: a cancelled tree grows no new branch.
        found = await services.guard(
            lambda: store.begin_step_unless_finished(fresh), "checkpointing"
        )
        if found is None:
            return None
        record = found
        history.check(record, StepKind.CHILD, workflow)
    if record.status is StepState.PENDING:
        record = await start_child_run(services, record)
    return record


async def start_child_run(services: DriverServices, record: StepRecord) -> StepRecord:
    """Start the child of the pending CHILD checkpoint ``record`` (idempotent: again after a
    crash), and cancel it at once if its parent ended meanwhile (a cancel walking the tree
    read the parent's steps before the child existed: without this, it would run on under a
    cancelled parent).

    Returns:
        ``record``, or the step failed with ``ChildDepthExceeded``: a step reopened by a retry
        meets the engine's limit again (a retry under a raised limit starts the child).
    """
    assert isinstance(record.input, dict)
    store = services.store
    parent = await services.guard(lambda: store.get_run(record.run_id), "reading")
    limit = services.options.max_child_depth
    refused = None if parent is None else depth_refusal(parent.depth, limit, record.name)
    if refused is not None:
        failed = attrs.evolve(
            record,
            status=StepState.FAILED,
            error=refused,
            attempts=ended_attempt(record, ended_at=store.now(), error=refused),
        )
        verdict = await services.guard(
            lambda: store.update_step(failed, expect_attempt=record.attempt), "checkpointing"
        )
        return failed if verdict is Applied.APPLIED else record
    child_id = str(record.input["runId"])
    await services.start_run(record.name, record.input.get("input"), child_id, record.run_id)
    if record.input.get("onParentCancel") == ABANDON:
        return record
    parent = await services.guard(lambda: store.get_run(record.run_id), "reading")
    if parent is not None and parent.status.terminal:
        reason = f"parent run {record.run_id!r} ended ({parent.status.value})"
        await services.cancel_run(child_id, reason)
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
    raise child_error(child_id, record)


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
    descend_ended: bool = True,
) -> int:
    """Cancel the unfinished descendants of run ``run_id`` (cancelled, or ended: ``ended`` says
    how, in the children's reason) that did not choose ``abandon`` (nor descend from one that
    did), through ``cancel(child_run_id, reason)``, which cancels that ONE run.

    Breadth-first and iterative (issue 36: a recursion met ``RecursionError`` ~330 levels
    down, leaving the rest running): a run is cancelled before its children are read, and a
    child is started only under an unfinished parent (or cancelled at once), so the walk
    misses no run the tree grows meanwhile. With ``descend_ended`` it also walks below the
    children that had already ended: cancelling the root again finishes a walk that was
    interrupted (``False``: a driver ending its own children, whose own ended children did
    the same).

    Returns:
        How many runs were asked to cancel.
    """
    queue = deque([run_id])
    seen = {run_id}
    asked = 0
    while queue:
        parent = queue.popleft()
        for child in child_ids(await store.get_steps(parent), abandoned=False):
            if child in seen:
                continue
            seen.add(child)
            record = await store.get_run(child)
            if record is None:
                continue
            if record.status in _FINAL:
                if descend_ended:
                    queue.append(child)
                continue
            await cancel(child, f"parent run {parent!r} {ended}")
            asked += 1
            queue.append(child)
    return asked


async def cancel_tree(store: RunStore, run_id: str, reason: str) -> bool:
    """Cancel run ``run_id`` in the store and its non-abandoned descendants (the operator's
    cancel with no engine: the owners stop the drivers at their next lease renewal).
    Iterative, and finishing an interrupted one when called again (:func:`cancel_children`).

    Returns:
        Whether this call cancelled ``run_id`` itself.
    """

    async def settle(target: str, why: str) -> None:
        error = {"type": "RunCancelled", "message": why}
        await store.finish_run(target, RunStatus.CANCELLED, error=error)

    error = {"type": "RunCancelled", "message": reason}
    cancelled = await store.finish_run(run_id, RunStatus.CANCELLED, error=error)
    await cancel_children(store, run_id, settle)
    return cancelled
