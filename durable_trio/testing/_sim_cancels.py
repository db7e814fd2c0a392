"""Cancellation in a simulation (issue 18): some runs cancelled at seeded times through a live
engine (again through the next one if that engine dies), and the invariants of a cancel:

- a cancel that said it cancelled the run (``engine.cancel`` returned ``True``) left the run
  ``cancelled``;
- a run that ended ``cancelled`` was cancelled by the workload (nothing cancels a run by
  itself), and its stored error is a ``RunCancelled``;
- a cancelled run's history holds the cancel mark when an engine delivered it inside the
  workflow (``"cut"`` present in the error), so a replay of it ends cancelled too;
- no cancel mark is written into the history of a run that had already ended (a cancel racing
  the run's end: a failed run with a mark would be cancelled by its own retry);
- no run that ended completed or failed holds a cancel mark (issue 36: one written while it was
  unfinished is dropped by the end that beat the cancel to the workflow).

A cancel goes through a live engine (``engine.cancel``: the owner's delivery, or another
engine's mark and wait), or, for a run the plan marks so, through the operator's route: the
mark written straight into the store, as ``runs cancel --no-wait`` does, for the owner's watch
(or the engine that takes the run over) to deliver.

What the workflow's compensation did is the app's to check (its ``expected`` callables see
completed runs only): ``tests/test_wf_cancel_sim.py`` checks its own saga's.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import trio

from .._engine import RunNotFound
from .._engine._cancel import CANCEL_MARK, mark_in_store

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._sim_engines import Engines, RecordingStore
    from ._sim_ledger import Ledger

__all__ = ["CancelPlan", "cancel_later", "check_cancels"]

if TYPE_CHECKING:
    CancelPlan = Callable[[random.Random, str, Any], float | None]
    """``(rng, workflow, input) -> delay after the start`` of the run's cancel (``None``: the
    run is not cancelled); a negative delay ``-d``: the operator's cancel after ``d``."""

#: The reason the simulation's cancels give.
REASON = "cancelled by the simulation"


async def cancel_later(
    plan: CancelPlan,
    seed: int,
    run_id: str,
    workflow: str,
    value: Any,
    engines: Engines,
    ledger: Ledger,
    asked: dict[str, bool],
) -> None:
    """Cancel ``run_id`` at its planned time; ``asked[run_id]`` is what the (last) call said.
    A call whose engine died is made again through the next one (it then finds the mark under
    way, and waits for it)."""
    delay = plan(random.Random(f"{seed}:cancels:{run_id}"), workflow, value)
    if delay is None:
        return
    operator = delay < 0
    await trio.sleep(abs(delay))
    ledger.event("cancel", run=run_id, operator=operator)
    asked[run_id] = False
    if operator:  # requested only: whether it cancels is the run's race to run
        requested = await mark_in_store(engines.store, run_id, REASON)
        ledger.event("cancel-requested", run=run_id, requested=requested)
        return
    try:
        cancelled = await engines.call(lambda engine: engine.cancel(run_id, reason=REASON))
    except RunNotFound:  # pragma: no cover - every run is started before its cancel
        ledger.violation(f"{run_id}: not found by its cancel")
        return
    asked[run_id] = asked[run_id] or cancelled
    ledger.event("cancelled", run=run_id, cancelled=cancelled)


async def check_cancels(
    store: RecordingStore,
    outcomes: dict[str, tuple[str, Any]],
    asked: dict[str, bool],
    ledger: Ledger,
) -> None:
    """The invariants of the module docstring, over every run the workload started."""
    for run_id in store.late_marks:
        ledger.violation(f"{run_id}: a cancel mark was written after the run had ended")
    for run_id, (status, error) in sorted(outcomes.items()):
        if status in ("completed", "failed") and await store.get_step(run_id, CANCEL_MARK):
            ledger.violation(f"{run_id}: ended {status} with a cancel mark in its history")
        if asked.get(run_id) and status != "cancelled":
            ledger.violation(f"{run_id}: its cancel returned True but it ended {status}")
        if status != "cancelled":
            continue
        if run_id not in asked:
            ledger.violation(f"{run_id}: ended cancelled, but nothing cancelled it")
        if not isinstance(error, dict) or error.get("type") != "RunCancelled":
            ledger.violation(f"{run_id}: cancelled with the error {error!r}")
            continue
        if "cut" in error and await store.get_step(run_id, CANCEL_MARK) is None:
            ledger.violation(f"{run_id}: cancelled inside the workflow without its cancel mark")
