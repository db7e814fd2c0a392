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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from ._errors import RunCancelled
from ._records import RunStatus, StepKind, StepRecord, StepState

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from ._remote_run import RemoteRunDriver
    from ._runtime import RunDriver
    from ._services import EngineServices

__all__ = [
    "CANCEL_MARK",
    "CancelState",
    "cancel_inside",
    "cancel_mark",
    "cancel_remote",
    "lands_on",
    "mark_reason",
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


async def cancel_inside(
    services: EngineServices, driver: RunDriver, reason: str, grace: float
) -> bool:
    """``engine.cancel`` of a run ``driver`` drives here: mark it, deliver
    :class:`RunCancelled` inside the workflow, give its compensation ``grace`` seconds, and
    return once the run settled (see the module docstring).

    Returns:
        Whether the run ended cancelled by this call (``False``: already being cancelled, or
        it settled otherwise first).
    """
    state = driver.cancel
    if state.requested:
        await driver.done.wait()
        return False
    store = services.store
    mark = cancel_mark(driver.run.run_id, reason)
    await services.guard(lambda: store.begin_step(mark), "checkpointing")
    if driver.settling or driver.done.is_set():
        await driver.done.wait()
        return False
    driver.grace.deadline = trio.current_time() + grace
    state.request(reason)
    await driver.done.wait()
    final = driver.final
    return final is not None and final.status.value == "cancelled"


async def cancel_remote(
    services: EngineServices, driver: RemoteRunDriver, reason: str, grace: float
) -> bool:
    """``engine.cancel`` of a remote workflow run ``driver`` drives here: the mark (with the
    steps pending now) goes into its history, a turn is sent at once (the workflow raises
    :class:`RunCancelled` where it waits and compensates in the next turns); after ``grace``
    seconds it is settled cancelled (cut) if it has not ended.

    Returns:
        Whether the run ended cancelled by this call.
    """
    store = services.store
    run_id = driver.run.run_id
    existing = await services.guard(lambda: store.get_step(run_id, CANCEL_MARK), "reading")
    if existing is not None:
        await driver.done.wait()
        return False
    steps = await services.guard(lambda: store.get_steps(run_id), "reading")
    numbered = [s for s in steps if s.step_id.isdigit()]
    at = max((int(s.step_id) for s in numbered), default=0)
    pending = [s.step_id for s in numbered if s.status is StepState.PENDING]
    mark = cancel_mark(run_id, reason, at=at, interrupted=pending)
    await services.guard(lambda: store.begin_step(mark), "checkpointing")
    driver.wake()
    with trio.move_on_after(grace):
        await driver.done.wait()
    if not driver.done.is_set():
        error = {"type": "RunCancelled", "message": reason, "cut": True}
        settled = await services.settle(driver.run, RunStatus.CANCELLED, error=error)
        driver.final = settled
        driver.scope.cancel()
        return settled is not None
    final = driver.final
    if final is None:
        final = await store.get_run(run_id)
    return final is not None and final.status is RunStatus.CANCELLED
