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
    from ._stores import RunStore

__all__ = [
    "CANCEL_MARK",
    "CancelState",
    "cancel_inside",
    "cancel_mark",
    "cancel_remote",
    "lands_on",
    "mark_in_store",
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
    deliver_local(driver, reason, grace)
    await driver.done.wait()
    final = driver.final
    return final is not None and final.status.value == "cancelled"


def deliver_local(driver: RunDriver, reason: str, grace: float) -> None:
    """Raise :class:`RunCancelled` inside ``driver``'s workflow, its compensation bounded."""
    if driver.cancel.requested:
        return
    driver.grace.deadline = trio.current_time() + grace
    driver.cancel.request(reason)


async def bound_remote(
    services: EngineServices, driver: RemoteRunDriver, reason: str, grace: float
) -> bool:
    """Wake ``driver`` (its history holds the cancel mark) and cut it after ``grace``."""
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
        final = await services.store.get_run(driver.run.run_id)
    return final is not None and final.status is RunStatus.CANCELLED


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
    stored = await call(lambda: store.begin_step(mark), "checkpointing")
    return bool(stored.output == mark.output)


async def deliver_marked(
    services: EngineServices, grace: float
) -> list[tuple[RunDriver | RemoteRunDriver, str]]:
    """The owner's side of a cancel written by another engine or an operator: the local runs
    driven here whose history holds the mark get it delivered (called every ``run_lease / 3``).

    Returns:
        The runs driven here newly found marked, with the reason: a local one already has the
        cancel delivered; for a remote one the caller runs :func:`bound_remote`. For each, the
        caller asks the workers to cancel its steps once it ended (after its compensation).
    """
    from ._remote_run import RemoteRunDriver
    from ._runtime import RunDriver

    found: list[tuple[RunDriver | RemoteRunDriver, str]] = []
    drivers = dict(services.drivers)
    keys = [(run_id, CANCEL_MARK) for run_id in drivers]
    if not keys:
        return found
    marks = await services.store.get_steps_many(keys)
    for (run_id, _), mark in zip(keys, marks, strict=True):
        driver = drivers[run_id]
        if mark is None or driver.settling or driver.done.is_set():
            continue
        if isinstance(driver, RunDriver) and not driver.cancel.requested:
            deliver_local(driver, mark_reason(mark), grace)
            found.append((driver, mark_reason(mark)))
        elif isinstance(driver, RemoteRunDriver) and not driver.cancel_seen:
            driver.cancel_seen = True
            found.append((driver, mark_reason(mark)))
    return found


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
    if driver.cancel_seen or not await write_mark(services, driver.run.run_id, reason):
        await driver.done.wait()
        return False
    driver.cancel_seen = True
    return await bound_remote(services, driver, reason, grace)
