"""Delivering a cancel to the driver of a run (issue 18, item 6; the marks and the cancel's
state are in :mod:`._cancel`): :func:`cancel_inside` for a local workflow driven here,
:func:`cancel_remote` for a remote one, :func:`deliver_marked` for a mark another process wrote
on a run driven here. It knows both kinds of driver; the drivers only know :mod:`._cancel`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import trio

from .._errors import BrokerError
from ._cancel import CANCEL_MARK, cancel_mark, mark_reason, write_mark
from ._records import RunStatus
from ._remote_run import RemoteRunDriver
from ._runtime import RunDriver
from ._stores._wakes import CANCELS, SupportsRunWakes

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._services import EngineServices

__all__ = [
    "bound_remote",
    "cancel_elsewhere",
    "cancel_inside",
    "cancel_remote",
    "deliver_local",
    "deliver_marked",
    "deliver_marked_forever",
]


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
    # Guarded: a run settled since the caller looked (by this driver, or by another engine
    # in a split brain) keeps the history it ended with, no mark its retry would deliver.
    stored = await services.guard(lambda: store.begin_step_unless_finished(mark), "checkpointing")
    if stored is None or driver.settling or driver.done.is_set():
        # Ended first: the cancel did not reach the workflow. A mark written just before the
        # end is dropped by that end's finish_run (docs/engine.md, "A cancel racing the
        # run's end"), so it ended as it did and this call says so.
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


async def deliver_marked_forever(
    services: EngineServices,
    grace: float,
    period: float,
    nursery: trio.Nursery,
    cancel_steps: Callable[[str], Awaitable[None]],
) -> None:
    """The engine's loop for the cancels other engines or operators marked on runs driven here
    (docs/engine.md, "Cancellation inside a workflow"): it looks at once when the store rings
    :data:`CANCELS` (a store with wakes), else, and as the safety net, every ``period``
    (``run_lease / 3``). Each run found gets its cancel delivered, and once it ended its steps
    still running are cancelled on the workers (``cancel_steps``)."""
    store = services.store
    wakes = store.wakes if isinstance(store, SupportsRunWakes) else None
    while True:
        with contextlib.ExitStack() as watch:
            # Taken before the read: a mark written while it reads rings it again.
            marked = watch.enter_context(wakes.watching(CANCELS)) if wakes else None
            try:
                found = await deliver_marked(services, grace)
            except BrokerError as exc:
                services.report(exc)
                found = []
            for driver, reason in found:
                nursery.start_soon(_settle_marked, services, driver, reason, grace, cancel_steps)
            with trio.move_on_after(period):
                if marked is not None:
                    await marked.wait()
                else:
                    await trio.sleep_forever()


async def _settle_marked(
    services: EngineServices,
    driver: RunDriver | RemoteRunDriver,
    reason: str,
    grace: float,
    cancel_steps: Callable[[str], Awaitable[None]],
) -> None:
    """A cancel marked by another process, delivered here: once the run ended (its
    compensation done or cut), the workers are asked to cancel the steps it left running, as
    ``engine.cancel`` does (the process that marked it may not wait for the end)."""
    if isinstance(driver, RemoteRunDriver):
        cancelled = await bound_remote(services, driver, reason, grace)
    else:
        await driver.done.wait()
        cancelled = driver.final is not None and driver.final.status is RunStatus.CANCELLED
    if cancelled:
        await cancel_steps(driver.run.run_id)


async def cancel_elsewhere(
    services: EngineServices, run_id: str, reason: str, bound: float, period: float
) -> bool | None:
    """``engine.cancel`` of a run another engine drives: write the mark (its owner delivers it,
    its compensation bounded by its own ``cancel_grace``), or find one already there (a cancel
    under way: waited for the same way, never settled under its compensation), and wait up to
    ``bound`` for the run to end.

    Returns:
        ``True``: it ended cancelled by this call's mark; ``False``: it ended otherwise, or by
        an earlier cancel; ``None``: not ended within ``bound`` (its owner died, or ignores
        marks): the caller settles it.
    """
    wrote = await write_mark(services, run_id, reason)
    store = services.store
    with trio.move_on_after(bound):
        while True:
            run = await services.guard(lambda: store.get_run(run_id), "reading")
            if run is None or run.status.terminal:
                break
            await trio.sleep(min(1.0, period))
    run = await store.get_run(run_id)
    if run is None or not run.status.terminal:
        return None
    return wrote and run.status is RunStatus.CANCELLED
