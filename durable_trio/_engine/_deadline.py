"""Run timeouts: a run started with ``engine.start(..., timeout=)`` fails at its deadline.

The deadline is ``created_at + timeout`` on the run store's clock, both stored with the run, so
it is the same for every engine that ever drives the run: a resumed run keeps it (as a durable
timer keeps its wake-up time), and a run found past it when an engine takes it over fails at
once, without being driven again.

At the deadline the engine driving the run settles it failed with a ``RunTimedOut`` error (the
first settle wins: a run that ended meanwhile is left as it ended), stops its driver where it
waits, cancels its unfinished children that were not abandoned (as any end of a parent does),
and asks the workers (best-effort, as a cancel does) to cancel the run's running steps.
What arrives for the run afterwards (a late step result, a turn's decision) finds it over and
is ignored, as for any run that ended.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from .._errors import BrokerError, TransportClosed
from .._telemetry import run_span
from .._wire import ControlMessage
from ._children import cancel_children
from ._records import RunStatus, StepState

if TYPE_CHECKING:
    from ._app import WorkflowDefinition
    from ._records import RunRecord
    from ._services import Driver, EngineServices

__all__ = ["drive_within_deadline", "expired", "time_out"]


def expired(services: EngineServices, run: RunRecord) -> bool:
    """Whether ``run`` has a deadline and the store's clock has reached it."""
    deadline = run.deadline
    return deadline is not None and services.store.now() >= deadline


async def time_out(
    services: EngineServices, run: RunRecord, driver: Driver | None = None
) -> RunRecord | None:
    """Fail ``run`` as timed out (see the module docstring); stop ``driver`` if it did.

    Returns:
        The run as settled, or ``None`` (it had ended already).
    """
    store = services.store
    steps = await services.guard(lambda: store.get_steps(run.run_id), "reading")
    pending = [
        {"stepId": s.step_id, "kind": s.kind.value, "name": s.name}
        for s in steps
        if s.status is StepState.PENDING
    ]
    timeout = run.timeout
    assert timeout is not None
    message = f"the run did not end within its timeout of {timeout:g} s"
    if pending:
        waiting = ", ".join(f"{p['name']!r} (id {p['stepId']})" for p in pending)
        message += f"; it was waiting on {waiting}"
    error: dict[str, Any] = {
        "type": "RunTimedOut",
        "message": message,
        "timeout": timeout,
        "deadline": run.deadline,
        "pending": pending,
    }
    final = await services.settle(run, RunStatus.FAILED, error=error)
    if final is None:
        return None
    services.count("runs_timed_out")
    if driver is not None:
        driver.scope.cancel()
    # No orphans: its unfinished children go as they would with any other end of the parent
    # (unless started with on_parent_cancel="abandon"), here and on a takeover after a restart.
    await services.guard(
        lambda: cancel_children(services.store, run.run_id, services.cancel_run, ended="timed out"),
        "cancelling children",
    )
    try:
        await services.transport.remote.send_control(
            ControlMessage(action="cancel", run_id=run.run_id)
        )
    except (BrokerError, TransportClosed) as exc:
        services.report(exc)
    return final


async def drive_within_deadline(
    services: EngineServices, driver: Driver, definition: WorkflowDefinition
) -> None:
    """``driver.drive(definition)``, and beside it, for a run with a deadline, a timer that
    times the run out when the deadline comes (store clock); all of it inside the run's span
    when this process traces (docs/observability.md)."""
    with run_span(driver.run):
        await _drive(services, driver, definition)


async def _drive(services: EngineServices, driver: Driver, definition: WorkflowDefinition) -> None:
    deadline = driver.run.deadline
    if deadline is None:
        await driver.drive(definition)
        return

    firing = False

    async def expire() -> None:
        nonlocal firing
        await services.sleep_until(deadline)
        firing = True
        await time_out(services, driver.run, driver)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(expire)
        await driver.drive(definition)
        if not firing:  # the run ended (or its driver stopped) before its deadline
            nursery.cancel_scope.cancel()
