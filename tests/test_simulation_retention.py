"""Retention (issue 34) in the simulation harness: the engines prune finished runs past their
retention while runs start and finish through faults (workers and engines killed). The
invariants (``durable_trio/testing/_sim_retention.py``): nothing unfinished is ever pruned
(nor before its retention, nor a child whose parent has not ended); a pruned run is gone with
all its records (checkpoints, events, tag index entries, jobs); every run that finished longer
than its retention ago is pruned by the end. The harness is shown to catch a prune broken."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest

import durable_trio as dt
from durable_trio.testing import InvariantViolation, Simulation
from durable_trio.testing._sample import CHAOS, expected, sample_app, workload
from durable_trio.testing._sim_children import family, family_expected, family_workload

#: Short enough that most runs are pruned while the simulation still runs.
RETENTION: dict[str, Any] = {"retention": 120.0, "retention_interval": 20.0}

ENGINE_KILLS = attrs.evolve(CHAOS, engine_kills_per_hour=8.0)


def tags(workflow: str, value: Any) -> dict[str, str]:
    return {"workflow": workflow, "size": str(len(value) if isinstance(value, list) else value)}


@pytest.mark.parametrize("seed", [1, 7, 23])
def test_every_finished_run_is_pruned_and_nothing_unfinished_through_faults(seed: int) -> None:
    report = Simulation(
        sample_app("simretention"),
        workload,
        seed=seed,
        runs=40,
        duration=1800,
        faults=ENGINE_KILLS,
        expected_output=expected,
        engine_options=RETENTION,
        tags=tags,
    ).run_sync()
    assert report.runs_completed == report.runs_started == 40
    assert report.faults.get("engine-kill", 0) > 0
    assert report.engine.runs_pruned == 40  # each once (a second prune: a violation)
    assert any(event["ev"] == "linger" for event in report.history)


@pytest.mark.parametrize("seed", [2, 11])
def test_children_are_kept_while_their_parent_runs_and_pruned_after(seed: int) -> None:
    """A ``family``'s ``order`` children end long before it (a retention of 30 s, shorter
    than a child's 60 s timer): they are held while it runs, then pruned with it."""
    app = sample_app("simretchildren")
    app.workflow("family")(family)
    simulation = Simulation(
        app,
        family_workload,
        seed=seed,
        runs=30,
        duration=1200,
        faults=ENGINE_KILLS,
        expected_output=family_expected,
        engine_options={"retention": 30.0, "retention_interval": 10.0},
    )
    report = simulation.run_sync()
    assert report.runs_completed == report.runs_started == 30
    families = sum(1 for event in report.history if event.get("workflow") == "family")
    assert families > 0
    assert report.engine.runs_pruned > 30  # the children too
    prunes = simulation._store.prunes
    held = [
        p
        for p in prunes.values()
        if p.run.parent is not None
        and p.run.updated_at + 30.0 < prunes[p.run.parent].run.updated_at
    ]
    assert held  # children due long before their parent ended, pruned only after it


def test_a_workflow_kept_for_good_is_never_pruned_and_its_children_are() -> None:
    app = sample_app("simretkept")
    app.workflow("family", retention=math.inf)(family)
    simulation = Simulation(
        app,
        family_workload,
        seed=5,
        runs=24,
        duration=1200,
        expected_output=family_expected,
        engine_options={"retention": 60.0, "retention_interval": 10.0},
    )
    report = simulation.run_sync()
    store = simulation._store
    kept = {run.workflow for run in store._runs.values()}
    assert kept == {"family"}  # every order (children too) pruned, no family
    assert {p.run.workflow for p in store.prunes.values()} == {"order"}
    assert report.engine.runs_pruned == len(store.prunes)


class _Broken(Simulation):
    """A simulation whose store's prune is broken by ``breaks(store, ended_before, kw)``."""

    def __init__(self, breaks: Any, *args: Any, **kw: Any) -> None:
        self.breaks = breaks
        super().__init__(*args, **kw)

    def _reset(self) -> None:
        super()._reset()
        store, breaks = self._store, self.breaks
        prune = store.prune_finished

        async def broken(ended_before: float, **kw: Any) -> list[str]:
            return await prune(breaks(store, ended_before), **kw)

        store.prune_finished = broken  # type: ignore[method-assign]


def _broken(breaks: Any, **kw: Any) -> Simulation:
    return _Broken(
        breaks,
        sample_app("simretbroken"),
        workload,
        seed=3,
        runs=10,
        duration=600,
        faults=dt.testing.Faults(kills_per_hour=0.0, restarts_per_hour=0.0),
        expected_output=expected,
        engine_options=RETENTION,
        **kw,
    )


def test_the_harness_catches_a_run_pruned_before_its_retention() -> None:
    simulation = _broken(lambda store, ended_before: ended_before + 100.0)
    with pytest.raises(InvariantViolation, match=r"pruned .* before its retention of 120"):
        simulation.run_sync()


def test_the_harness_catches_a_pruned_run_left_in_the_tag_index() -> None:
    class Leaky(Simulation):
        def _reset(self) -> None:
            super()._reset()
            store = self._store
            prune = store.prune_finished

            async def leaking(ended_before: float, **kw: Any) -> list[str]:
                before = {tag: dict(ids) for tag, ids in store._tagged.items()}
                pruned = await prune(ended_before, **kw)
                store._tagged = before  # the index entries of the runs pruned stay
                return pruned

            store.prune_finished = leaking  # type: ignore[method-assign]

    simulation = Leaky(
        sample_app("simretleak"),
        workload,
        seed=3,
        runs=10,
        duration=600,
        expected_output=expected,
        engine_options=RETENTION,
        tags=tags,
    )
    with pytest.raises(InvariantViolation, match=r"still in the tag index"):
        simulation.run_sync()


def test_the_harness_catches_an_unfinished_run_pruned() -> None:
    class Eager(Simulation):
        def _reset(self) -> None:
            super()._reset()
            store = self._store

            def prunable(ended_before: float, workflow: str | None) -> list[Any]:
                return [run for run in store._runs.values() if run.updated_at < ended_before]

            store._prunable = prunable  # type: ignore[method-assign]

    simulation = Eager(
        sample_app("simreteager"),
        workload,
        seed=3,
        runs=10,
        duration=600,
        expected_output=expected,
        engine_options={"retention": 30.0, "retention_interval": 10.0},
    )
    with pytest.raises(InvariantViolation, match=r"was pruned (running|pending) \(unfinished\)"):
        simulation.run_sync()


def test_the_harness_catches_a_due_run_never_pruned() -> None:
    simulation = _broken(lambda store, ended_before: ended_before - 10_000.0)
    with pytest.raises(InvariantViolation, match=r"never pruned \(retention 120"):
        simulation.run_sync()


def test_the_same_seed_with_retention_gives_the_same_history() -> None:
    def run() -> str:
        return (
            Simulation(
                sample_app("simretdigest"),
                workload,
                seed=9,
                runs=15,
                duration=900,
                faults=ENGINE_KILLS,
                engine_options=RETENTION,
            )
            .run_sync()
            .digest
        )

    assert run() == run()
