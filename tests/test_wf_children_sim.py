"""Child workflows in the simulation harness (issue 18, item 3): ``family`` runs fan out to
``order`` children on 2 engines that are killed and replaced; the invariants (every run and
child ends, no child orphaned, each started once, no step settled twice) hold. Kept seeds."""

from __future__ import annotations

import attrs
import pytest

from durable_trio.testing import Simulation
from durable_trio.testing._sample import CHAOS, sample_app
from durable_trio.testing._sim_children import add_family, family_expected, family_workload

app = add_family(sample_app("sim-children"))
remote_app = add_family(sample_app("sim-children-remote", remote=True), remote=True)
ENGINE_KILLS = attrs.evolve(CHAOS, engine_kills_per_hour=10.0)

#: Seeds kept in the suite (tried first: 1-8, 35-46 children each; none found a defect).
KEPT_SEEDS = [1, 2, 5]


@pytest.mark.parametrize("seed", KEPT_SEEDS)
def test_families_on_two_engines_with_kills_hold_every_invariant(seed: int) -> None:
    report = Simulation(
        app,
        family_workload,
        seed=seed,
        runs=60,
        duration=3600,
        faults=ENGINE_KILLS,
        engines=2,
        expected_output=family_expected,
    ).run_sync()
    assert report.violations == ()
    assert report.runs_completed == 60
    assert report.faults["engine-kill"] >= 2


@pytest.mark.parametrize("seed", [1, 3])
def test_remote_families_on_two_engines_with_kills_hold_every_invariant(seed: int) -> None:
    """The same with remote workflows, parents and children (tried first: 1-3)."""
    report = Simulation(
        remote_app,
        family_workload,
        seed=seed,
        runs=60,
        duration=3600,
        faults=ENGINE_KILLS,
        engines=2,
        expected_output=family_expected,
        engine_options={"turn_timeout": 120.0},
    ).run_sync()
    assert report.violations == ()
    assert report.runs_completed == 60
    assert report.faults["engine-kill"] >= 2


async def test_the_invariant_names_an_orphan_a_double_start_and_a_stray_child() -> None:
    from durable_trio._engine import RunRecord, RunStatus, StepKind, StepRecord, StepState
    from durable_trio._engine._stores.memory import MemoryRunStore
    from durable_trio.testing._sim_children import check_children

    store = MemoryRunStore()

    def run(run_id: str, status: RunStatus) -> RunRecord:
        return RunRecord(run_id=run_id, workflow="w", input=None, status=status, created_at=0.0,
                         updated_at=0.0)  # fmt: skip

    for run_id, status in (
        ("p", RunStatus.COMPLETED),
        ("p/1", RunStatus.RUNNING),
        ("p/2", RunStatus.RUNNING),
        ("q", RunStatus.RUNNING),
        ("stray/1", RunStatus.RUNNING),
    ):
        await store.create_run(run(run_id, status))
    for parent, step_id, child, mode in (
        ("p", "1", "p/1", "cancel"),  # orphaned
        ("p", "2", "p/2", "abandon"),  # left running by choice
        ("q", "1", "p/1", "cancel"),  # started twice
    ):
        await store.begin_step(
            StepRecord(run_id=parent, step_id=step_id, kind=StepKind.CHILD, name="w",
                       status=StepState.PENDING,
                       input={"runId": child, "input": None, "onParentCancel": mode})
        )  # fmt: skip
    seen: list[str] = []
    assert await check_children(store, seen.append) == 2
    assert sorted(seen) == [
        "child run p/1 is running though its parent p is completed (orphaned)",
        "child run p/1 started by p and q",
        "run stray/1 looks like a child but no parent started it",
    ]
