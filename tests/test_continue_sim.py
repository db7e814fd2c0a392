"""Continue-as-new in the simulation harness (issue 34, item 5): runs that continue as new a
random number of times, consuming signals sent at random times across generations, under
faults with engines killed and replaced: every run ends with every signal consumed once, in
order, and each continued run's histories chain without gap. With retention, previous
generations are pruned while their runs go on: none before its retention, every one due by the
end, those kept chained without gap (durable_trio/testing/_sim_retention.py). Kept seeds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import pytest

import durable_trio as dt
from durable_trio.testing import InvariantViolation, Simulation
from durable_trio.testing._sample import CHAOS

if TYPE_CHECKING:
    import random

app = dt.App("sim-continue")


@app.step("plus")
async def plus(terms: list[int]) -> int:
    return sum(terms)


@app.workflow("tally")
async def tally(ctx: dt.WorkflowContext, state: dict[str, Any]) -> int:
    value = await ctx.wait_signal("add")  # signals sent before are carried over
    total = await ctx.step("plus", [state["sum"], value])
    await ctx.sleep(state["nap"])
    if state["left"] > 0:
        ctx.continue_as_new({**state, "left": state["left"] - 1, "sum": total})
    return int(total)


def workload(rng: random.Random, index: int) -> tuple[str, Any]:
    return "tally", {"left": rng.randint(0, 4), "sum": 0, "nap": rng.uniform(0, 60), "index": index}


def signals(
    rng: random.Random, workflow: str, state: dict[str, Any]
) -> list[tuple[float, str, Any]]:
    del workflow
    times = sorted(rng.uniform(0, 600) for _ in range(state["left"] + 1))
    return [(t, "add", 10 * state["index"] + k) for k, t in enumerate(times)]


def expected(workflow: str, state: dict[str, Any]) -> int:
    del workflow
    return sum(10 * state["index"] + k for k in range(state["left"] + 1))


@pytest.mark.parametrize("seed", [1, 7])
def test_continued_runs_chain_their_histories_without_gap_under_engine_kills(seed: int) -> None:
    simulation = Simulation(
        app,
        workload,
        seed=seed,
        runs=40,
        duration=3600,
        engines=2,
        faults=attrs.evolve(CHAOS, engine_kills_per_hour=6.0),
        expected_output=expected,
        signals=signals,
    )
    report = simulation.run_sync()
    assert report.violations == ()
    assert report.runs_completed == 40
    assert report.faults["engine-kill"] >= 2
    assert simulation._invariants.continued >= 20


def _with_retention(seed: int) -> Simulation:
    return Simulation(
        app,
        workload,
        seed=seed,
        runs=40,
        duration=3600,
        engines=2,
        faults=attrs.evolve(CHAOS, engine_kills_per_hour=6.0),
        expected_output=expected,
        signals=signals,
        engine_options={"retention": 60.0, "retention_interval": 10.0},
    )


@pytest.mark.parametrize("seed", [1, 7])
def test_retention_prunes_previous_generations_only_past_it_under_engine_kills(seed: int) -> None:
    # Generations are pruned while their runs go on (then the runs, finished): none before
    # its retention, every one due by the end, those kept chained without gap.
    report = _with_retention(seed).run_sync()
    assert report.violations == ()
    assert report.runs_completed == 40
    assert report.engine.generations_pruned > 20
    assert report.engine.runs_pruned == 40


def test_the_invariant_catches_a_generation_pruned_before_its_retention(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from durable_trio._engine._stores._generations import MemoryGenerations

    early = MemoryGenerations.prune_generations

    async def hasty(self: Any, ended_before: float, **kwargs: Any) -> int:
        return await early(self, ended_before + 45, **kwargs)

    monkeypatch.setattr(MemoryGenerations, "prune_generations", hasty)
    with pytest.raises(InvariantViolation, match=r"before its retention of 60\.0 s"):
        _with_retention(1).run_sync()


async def test_the_invariant_catches_a_gap_between_generations() -> None:
    from durable_trio._engine._generations import Continuation
    from durable_trio._engine._stores._generations import generations_of
    from durable_trio.testing._sim_engines import RecordingStore
    from durable_trio.testing._sim_generations import check_generations

    store = RecordingStore()
    await store.create_run(dt.RunRecord("r", "tally", None, dt.RunStatus.RUNNING, 0, 0))
    for step_id in ("1", "2"):
        await store.begin_step(
            dt.StepRecord("r", step_id, dt.StepKind.LOCAL, "x", dt.StepState.COMPLETED)
        )
    # The next generation claims to start after step 3: step 3 is missing (a gap).
    assert await generations_of(store).continue_run("r", Continuation(1, 3).mark("r"), None)
    await store.begin_step(dt.StepRecord("r", "5", dt.StepKind.LOCAL, "x", dt.StepState.COMPLETED))
    found: list[str] = []
    assert await check_generations(store, ["r"], found.append) == 1
    assert found == [
        "r: generation 0 holds steps [1, 2], not 1 .. 3 (a gap, or an id reused)",
        "r: the current generation 1 starts at step 5, not 4",
    ]
