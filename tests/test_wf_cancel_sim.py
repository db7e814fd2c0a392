"""Cancellation in the simulation harness (issue 18): half the runs of a saga cancelled at
random times (before, during and after the workflow's wait), two engines, engines killed and
replaced. The harness checks a cancel's invariants (``durable_trio/testing/_sim_cancels.py``);
this test checks the saga's compensation: only cancelled runs compensate, and the cancelled
runs that were delivered the cancel compensate. Kept seeds."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import attrs
import pytest

import durable_trio as dt
from durable_trio.testing import Simulation
from durable_trio.testing._sample import CHAOS

if TYPE_CHECKING:
    import random

UNDONE: Counter[str] = Counter()


async def saga(ctx: dt.WorkflowContext, plan: dict[str, Any]) -> str:
    await ctx.step("book", plan["index"])
    try:
        await ctx.sleep(plan["hold"])
        await ctx.step("pay", plan["index"])
    except dt.RunCancelled:
        await ctx.step("undo", plan["index"])  # compensation
        raise
    return f"paid {plan['index']}"


def make_app(name: str, *, remote: bool) -> dt.App:
    app = dt.App(name)
    for step in ("book", "pay"):

        @app.step(step)
        async def _(index: int) -> int:
            return index

    @app.step("undo")
    async def undo(index: int) -> int:
        UNDONE[dt.step_info().run_id] += 1
        return index

    app.workflow("saga", remote=remote)(saga)
    return app


def workload(rng: random.Random, index: int) -> tuple[str, Any]:
    return "saga", {"index": index, "hold": rng.uniform(30, 600)}


def cancels(rng: random.Random, workflow: str, plan: dict[str, Any]) -> float | None:
    del workflow, plan
    return rng.uniform(0, 700) if rng.random() < 0.5 else None


KEPT_SEEDS = [(False, 1), (False, 2), (True, 3)]


@pytest.mark.parametrize(("remote", "seed"), KEPT_SEEDS)
def test_cancelled_runs_end_cancelled_and_compensate_with_engines_killed(
    remote: bool, seed: int
) -> None:
    UNDONE.clear()
    simulation = Simulation(
        make_app("sim-cancel-remote" if remote else "sim-cancel", remote=remote),
        workload,
        seed=seed,
        runs=60,
        duration=3600,
        engines=2,
        faults=attrs.evolve(CHAOS, engine_kills_per_hour=6.0),
        expected_output=lambda _, plan: f"paid {plan['index']}",
        cancels=cancels,
        engine_options={"turn_timeout": 120.0} if remote else None,
    )
    report = simulation.run_sync()
    assert report.violations == ()
    assert report.runs_cancelled > 5
    assert report.runs_completed + report.runs_cancelled == 60
    assert report.faults["engine-kill"] >= 2
    outcomes = simulation._runs.outcomes
    cancelled = {run for run, (status, _) in outcomes.items() if status == "cancelled"}
    # Only a cancelled run compensates; one delivered the cancel inside the workflow (its
    # error says whether the compensation was cut) compensated, unless its engine died during
    # the compensation and the next one settled it from the mark (at most once, never again).
    assert set(UNDONE) <= cancelled
    delivered = {run for run in cancelled if "cut" in outcomes[run][1]}
    assert len(set(UNDONE) & delivered) >= len(delivered) - report.faults["engine-kill"]
