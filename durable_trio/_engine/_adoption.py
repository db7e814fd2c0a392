"""Taking over runs nobody drives: the engine's reconcile (every orphan it may drive) and
``take_over`` (one run and its family, for an engine that reconciles nothing else).

A run is orphaned when it is pending with no owner (``retry`` leaves it so, a detached start
too) or its owner's lease lapsed (the engine died). Claiming it is one store call (a batch at a
time); adopting it starts its driver, which replays its history. A run this engine's app does
not register fails (``UnknownWorkflow``); one past its run timeout fails as timed out, never
driven again.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import trio

from ._children import check_child_steps
from ._deadline import expired, time_out
from ._errors import RunDataError, UnknownWorkflow
from ._generations import CONTINUE_STEP_ID, continuation_of
from ._records import RunStatus
from ._runtime import describe_error
from ._stores._wakes import STARTS, ring
from ._versioning import resume_blocked

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._records import RunRecord, StepRecord
    from ._services import Driver, EngineServices

__all__ = ["CLAIM_BATCH", "Adoption"]

#: Runs claimed per store call.
CLAIM_BATCH = 100


class Adoption:
    """Claims orphaned runs for one engine and starts their drivers through ``spawn``.

    Args:
        services: the engine's services (store, options, app, drivers, counters).
        spawn: starts a driver for a run and its history.
        closing: whether the engine is closing (then nothing more is claimed).
    """

    def __init__(
        self,
        services: EngineServices,
        spawn: Callable[[RunRecord, list[StepRecord]], Driver],
        closing: Callable[[], bool],
    ) -> None:
        self._services = services
        self._spawn = spawn
        self._closing = closing

    async def reconcile(self, *, include_own: bool = False) -> int:
        """:meth:`Engine.reconcile`: blocked runs this code may replay are reopened, then
        every orphan is claimed and adopted. Returns how many were taken over."""
        services = self._services
        store = services.store
        taken = 0
        if not self._closing():
            reopened = await resume_blocked(store, services.app, store.now())
            services.count("runs_unblocked", len(reopened))
        while not self._closing():
            claimed = await self._claim(include_own=include_own)
            for run in claimed:
                taken += await self.adopt(run)
            if len(claimed) < CLAIM_BATCH:
                break
        return taken

    async def _claim(self, *, include_own: bool = False) -> list[RunRecord]:
        """One claim of up to :data:`CLAIM_BATCH` orphans. A claim the store made is not lost
        to a close: shielded, bounded by the close, and its runs listed until driven, for the
        close to release (:meth:`Drivers.claiming`)."""
        services = self._services
        claimed: list[RunRecord] = []
        with services.drivers.claiming():
            claimed = await services.store.claim_runs(
                services.options.engine_id, services.options.run_lease,
                include_own=include_own, limit=CLAIM_BATCH,
            )  # fmt: skip
            services.drivers.claimed([run.run_id for run in claimed])
        await trio.lowlevel.checkpoint_if_cancelled()  # (cut at the close's bound)
        return claimed

    async def adopt(self, run: RunRecord) -> bool:
        """Drive ``run``, just claimed here (or fail it: unknown workflow, past its deadline).
        Returns whether a driver started."""
        services = self._services
        if run.run_id in services.drivers:
            return False
        if run.workflow not in services.app.workflows:
            error = describe_error(
                UnknownWorkflow(f"this engine's app does not register {run.workflow!r}")
            )
            await services.store.finish_run(run.run_id, RunStatus.FAILED, error=error)
            services.drivers.settled(run.run_id)
            services.count("runs_failed")
            return False
        if expired(services, run):  # past its deadline: fails, never driven
            await time_out(services, run)
            services.drivers.settled(run.run_id)
            return False
        try:
            history = await services.store.get_steps(run.run_id)
            # Its generation's mark (continue-as-new) read now: one of the wrong shape is
            # damaged as a checkpoint is (a driver built over it would fail the engine).
            continuation_of(next((s for s in history if s.step_id == CONTINUE_STEP_ID), None))
            check_child_steps(run.run_id, history)  # (a child step naming no child, the same)
        except RunDataError as exc:
            # A damaged checkpoint: the run cannot be replayed. Set aside (failed with what
            # is damaged), so the runs claimed beside it are still adopted.
            services.report(exc)
            await services.store.finish_run(run.run_id, RunStatus.FAILED, error=describe_error(exc))
            services.drivers.settled(run.run_id)
            services.count("runs_failed")
            return False
        services.count("runs_resumed")
        services.adopted.add(run.run_id)  # its caller may wait elsewhere (rung when it ends)
        self._spawn(run, history)
        return True

    async def take_over(self, run_id: str) -> bool:
        """:meth:`Engine.take_over` (the engine checks it is open). Returns whether this
        engine drives ``run_id`` now."""
        services = self._services
        store, engine_id = services.store, services.options.engine_id
        if run_id in services.drivers:
            return True
        run = await store.get_run(run_id)
        if run is None or run.status not in (RunStatus.PENDING, RunStatus.RUNNING):
            return False  # unknown, ended or blocked: nothing to drive
        lease = run.lease_until
        if run.owner is not None and lease is not None and store.now() <= lease < math.inf:
            # A live engine drives it: claim nothing (and release nothing). (An infinite lease
            # is no time, damaged: expired, as the claim takes it.)
            return False
        mine = {run_id}
        while not self._closing():
            claimed = await self._claim()
            family, rest = _family(claimed, mine)
            # (A run driven here whose lease lapsed is claimed again: it stays.)
            others = [run.run_id for run in rest if run.run_id not in services.drivers]
            if others:
                await store.release_runs(engine_id, others)
                for other in others:
                    services.drivers.settled(other)
                await ring(store, STARTS)  # (the reconciling engines take them now)
            for run in family:
                await self.adopt(run)
            if len(claimed) < CLAIM_BATCH:
                break
        return run_id in services.drivers


def _family(claimed: list[RunRecord], mine: set[str]) -> tuple[list[RunRecord], list[RunRecord]]:
    """Split ``claimed`` into the runs of the family ``mine`` names (grown in place: a child is
    claimed after or before its parent, so to a fixpoint) and the rest."""
    family: list[RunRecord] = []
    rest = list(claimed)
    grew = True
    while grew:
        grew = False
        for run in list(rest):
            if run.run_id in mine or run.parent in mine:
                mine.add(run.run_id)
                family.append(run)
                rest.remove(run)
                grew = True
    return family, rest
