"""Cancellation inside a workflow (issue 18, item 6): :class:`RunCancelled` raised at the
workflow's await, its compensation shielded from the cancel and bounded.

``engine.cancel`` of a run a :class:`~._runtime.RunDriver` of this engine drives (a local
workflow): the engine writes the mark ``cancel:run`` into the run's history, then every ``ctx``
call the workflow waits on raises :class:`RunCancelled` (one not yet made raises it when
made: "at its next await"). The cancel is delivered once: from then on ``ctx`` calls run as
usual (compensation steps), until the workflow ends or ``cancel_grace`` seconds have passed
(then it is cut where it waits). The run ends ``cancelled`` whatever the workflow does: it
re-raises, swallows the error and returns, or fails. An engine resuming a run whose history
holds the mark (its engine died mid-compensation) settles it cancelled without running the
workflow: compensation runs at most once, and never again after a crash.

Here: the mark, its reading, and one run's cancel state (what the drivers use). Delivering a
cancel to a driver, local or remote, is :mod:`._cancel_delivery` (which knows the drivers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from ._errors import RunCancelled
from ._records import StepKind, StepRecord, StepState
from ._stores._wakes import CANCELS, ring

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from ._services import EngineServices
    from ._stores import RunStore

__all__ = [
    "CANCEL_MARK",
    "CancelState",
    "cancel_mark",
    "lands_on",
    "mark_in_store",
    "mark_reason",
    "write_mark",
]

CANCEL_MARK = "cancel:run"


def cancel_mark(
    run_id: str, reason: str, *, at: int = 0, interrupted: Sequence[str] = ()
) -> StepRecord:
    """The checkpoint a cancel delivered inside the workflow leaves in its history. For a
    remote workflow it also says where the cancel lands on every replay: the steps pending
    when it came (``interrupted``: awaiting one raises), or, if none was, the first call after
    step ``at`` (in ``output``: a turn's history carries outputs)."""
    return StepRecord(
        run_id=run_id,
        step_id=CANCEL_MARK,
        kind=StepKind.CANCEL,
        name="cancel",
        status=StepState.COMPLETED,
        output={"reason": reason, "at": at, "interrupted": list(interrupted)},
    )


def mark_reason(mark: StepRecord) -> str:
    """The reason a cancel mark carries."""
    value = mark.output.get("reason") if isinstance(mark.output, dict) else mark.output
    return str(value)


def lands_on(mark: StepRecord, step_id: str) -> bool:
    """Whether the cancel of ``mark`` is raised by the call ``step_id`` (remote turns)."""
    data = mark.output if isinstance(mark.output, dict) else {}
    interrupted = data.get("interrupted") or []
    if interrupted:
        return step_id in interrupted
    at = data.get("at")
    return isinstance(at, int) and step_id == str(at + 1)


class CancelState:
    """One run's cancel: requested, delivered, and the waits it interrupts."""

    __slots__ = ("delivered", "reason", "requested", "waits")

    def __init__(self) -> None:
        self.requested = False
        self.delivered = False
        self.reason = "cancelled"
        self.waits: set[trio.CancelScope] = set()

    def request(self, reason: str) -> None:
        """Deliver the cancel: every wait now in progress raises :class:`RunCancelled`."""
        self.requested, self.reason = True, reason
        for scope in list(self.waits):
            scope.cancel()

    def error(self, run_id: str) -> RunCancelled:
        self.delivered = True
        return RunCancelled(run_id, {"type": "RunCancelled", "message": self.reason})

    async def around(self, run_id: str, call: Callable[[], Awaitable[Any]]) -> Any:
        """Run one ``ctx`` call; raise :class:`RunCancelled` instead if the cancel comes
        before or while it waits (and has not been delivered yet)."""
        if self.delivered:
            return await call()
        if self.requested:
            raise self.error(run_id)
        with trio.CancelScope() as scope:
            self.waits.add(scope)
            try:
                return await call()
            finally:
                self.waits.discard(scope)
        if self.requested:  # cut by the cancel (and only by it: the scope is our own)
            raise self.error(run_id)
        raise AssertionError("unreachable")  # pragma: no cover


async def write_mark(services: EngineServices, run_id: str, reason: str) -> bool:
    """Write the cancel mark of ``run_id`` (with the steps pending now). Returns whether this
    call wrote it (``False``: a cancel is already under way)."""
    return await mark_in_store(services.store, run_id, reason, guard=services.guard)


async def mark_in_store(
    store: RunStore,
    run_id: str,
    reason: str,
    *,
    guard: Callable[[Callable[[], Awaitable[Any]], str], Awaitable[Any]] | None = None,
) -> bool:
    """:func:`write_mark` on ``store`` alone (the operator's cancel, which has no engine):
    ``guard`` wraps each store call (the engine's retries through a broker outage)."""

    async def call(fn: Callable[[], Awaitable[Any]], what: str) -> Any:
        return await (guard(fn, what) if guard is not None else fn())

    existing = await call(lambda: store.get_step(run_id, CANCEL_MARK), "reading")
    if existing is not None:
        return False
    steps = await call(lambda: store.get_steps(run_id), "reading")
    numbered = [s for s in steps if s.step_id.isdigit()]
    at = max((int(s.step_id) for s in numbered), default=0)
    pending = [s.step_id for s in numbered if s.status is StepState.PENDING]
    mark = cancel_mark(run_id, reason, at=at, interrupted=pending)
    # Only while the run is unfinished, in one atomic check: a run that ended since the
    # caller looked (completed, failed) keeps its history as it ended, with no mark a later
    # retry would deliver.
    stored = await call(lambda: store.begin_step_unless_finished(mark), "checkpointing")
    written = stored is not None and stored.output == mark.output
    if written:
        await ring(store, CANCELS)  # the owner delivers it now, not at its next look
    return written
