"""Simulation figures (issue 9): a seeded day of production with faults, in one ``trio.run`` on a
virtual clock — its wall time (the bar: under 60 s), what it covered, and that every invariant
held; the same for an hour of remote workflows (issue 7's turns through the same storms), for
an hour with the engine itself killed ten times, and for an hour of remote workflows on two
engines killed and replaced.

The workload is the suite's (``durable_trio.testing._sample``, also run by
``tests/test_simulation.py``): 2,000 runs of a workflow of 1-4 sequential steps, a 60 s durable
timer, two steps in parallel and a local step; steps take 0.5-20 s of virtual time and fail one
attempt in twenty.
"""

from __future__ import annotations

from typing import Any

import attrs

from durable_trio.testing import Faults, InvariantViolation, Simulation, SimulationReport
from durable_trio.testing._sample import CHAOS, expected, sample_app, workload

DAY_SEED = 20261


def _report(simulation: Simulation) -> SimulationReport:
    """The report, violations included (they are figures here, not an exception)."""
    try:
        return simulation.run_sync()
    except InvariantViolation as violation:
        return violation.report


def _hour(
    name: str, runs: int, faults: Faults, *, remote: bool = False, engines: int = 1
) -> SimulationReport:
    """An hour of ``runs`` runs of the sample workload (remote workflows with ``remote``)."""
    return _report(
        Simulation(
            sample_app(name, remote=remote),
            workload,
            seed=DAY_SEED,
            runs=runs,
            duration=3600,
            engines=engines,
            faults=faults,
            expected_output=expected,
            engine_options={"turn_timeout": 120.0} if remote else None,
        )
    )


def _takeovers(report: SimulationReport) -> str:
    return (
        f"{report.faults.get('engine-kill', 0)} engine kills, "
        f"{report.engine.runs_resumed} runs taken over"
    )


def run(quick: bool) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    runs, hours = (500, 6) if quick else (2000, 24)
    report = _report(
        Simulation(
            sample_app("bench-sim"),
            workload,
            seed=DAY_SEED,
            runs=runs,
            duration=hours * 3600,
            faults=CHAOS,
            expected_output=expected,
        )
    )
    faults = sum(report.faults.values())
    figures[f"{hours} h simulation wall time (s)"] = (
        report.wall_seconds,
        f"{runs} runs, {report.step_executions} step executions, {faults} faults, seed {DAY_SEED}",
    )
    figures[f"{hours} h simulation invariant violations"] = (
        float(len(report.violations)),
        f"{report.duplicate_executions} duplicates, each explained by a fault",
    )
    figures[f"{hours} h simulation virtual s per wall s"] = (
        report.virtual_seconds / report.wall_seconds,
        "",
    )
    hour_runs = 200 if quick else 500
    remote = _hour("bench-sim-remote", hour_runs, CHAOS, remote=True)
    figures["1 h remote-workflow simulation wall time (s)"] = (
        remote.wall_seconds,
        f"{remote.runs_started} runs, {remote.engine.turns_dispatched} turns, "
        f"{len(remote.violations)} violations",
    )
    two = _hour(
        "bench-sim-two-engines",
        hour_runs,
        attrs.evolve(CHAOS, engine_kills_per_hour=4.0),
        remote=True,
        engines=2,
    )
    figures["1 h simulation with two engines: invariant violations"] = (
        float(len(two.violations)),
        f"remote workflows, {_takeovers(two)}, {two.engine.turns_moved_on} turns moved on, "
        f"{two.runs_completed}/{two.runs_started} runs completed, {two.wall_seconds:.1f} s wall",
    )
    killed = _hour(
        "bench-sim-engine-kills", hour_runs, attrs.evolve(CHAOS, engine_kills_per_hour=10.0)
    )
    figures["1 h simulation with engine kills: invariant violations"] = (
        float(len(killed.violations)),
        f"{_takeovers(killed)}, {killed.runs_completed}/{killed.runs_started} runs completed, "
        f"{killed.wall_seconds:.1f} s wall",
    )
    return figures
