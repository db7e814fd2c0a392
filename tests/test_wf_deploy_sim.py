"""A rolling deploy in the simulation harness (issue 18, versioning): runs in flight while each
of two engines in turn is replaced by new workflow code behind ``ctx.patched``, engines also
killed; every run completes (the old ones on the old branch, the new ones on the new), none
fails with NonDeterminismError. Kept seeds."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import attrs
import pytest
import trio

import durable_trio as dt
from durable_trio.testing import InvariantViolation, Simulation
from durable_trio.testing._sample import CHAOS

if TYPE_CHECKING:
    import random

SENT: Counter[str] = Counter()


def receipts(name: str, *, patched: bool, remote: bool, unguarded: bool = False) -> dt.App:
    app = dt.App(name)

    @app.step("charge")
    async def charge(index: int) -> int:
        return index

    for how in ("email", "push"):

        @app.step(how)
        async def send(index: int, how: str = how) -> str:
            SENT[how] += 1
            await trio.sleep(120)  # slow: a deploy finds runs waiting on it
            return f"receipt {index}"

    async def order(ctx: dt.WorkflowContext, plan: dict[str, Any]) -> str:
        await ctx.step("charge", plan["index"])
        await ctx.sleep(plan["wait"])  # the deploy lands meanwhile for some runs
        if unguarded or (patched and ctx.patched("push-receipts")):
            return str(await ctx.step("push", plan["index"]))
        return str(await ctx.step("email", plan["index"]))

    app.workflow("order", remote=remote)(order)
    return app


def workload(rng: random.Random, index: int) -> tuple[str, Any]:
    return "order", {"index": index, "wait": rng.uniform(10, 900)}


KEPT_SEEDS = [(False, 1), (False, 2), (True, 3)]


@pytest.mark.parametrize(("remote", "seed"), KEPT_SEEDS)
def test_a_rolling_deploy_of_a_patched_workflow_completes_old_and_new_runs(
    remote: bool, seed: int
) -> None:
    SENT.clear()
    name = "sim-deploy-remote" if remote else "sim-deploy"
    report = Simulation(
        receipts(name, patched=False, remote=remote),
        workload,
        seed=seed,
        runs=60,
        duration=3600,
        engines=2,
        faults=attrs.evolve(CHAOS, engine_kills_per_hour=4.0),
        expected_output=lambda _, plan: f"receipt {plan['index']}",
        deploy=(receipts(name, patched=True, remote=remote), 1200.0, 300.0),
        engine_options={"turn_timeout": 120.0} if remote else None,
    ).run_sync()
    assert report.violations == ()
    assert report.runs_completed == 60
    # Both branches ran: the runs past the patch point before the deploy on the old code, the
    # others on the new.
    assert SENT["email"] > 0
    assert SENT["push"] > 0


def test_the_harness_catches_a_deploy_that_changes_running_code_without_a_patch() -> None:
    """The same deploy with the new branch not behind ``ctx.patched``: runs that recorded the
    old step and replay on the new code are blocked (never ended) - the invariants say so."""
    simulation = Simulation(
        receipts("sim-deploy-bad", patched=False, remote=False),
        workload,
        seed=1,
        runs=60,
        duration=3600,
        engines=2,
        faults=attrs.evolve(CHAOS, engine_kills_per_hour=4.0),
        expected_output=lambda _, plan: f"receipt {plan['index']}",
        deploy=(
            receipts("sim-deploy-bad", patched=False, remote=False, unguarded=True),
            1200.0,
            300.0,
        ),
        drain_timeout=3600,
    )
    with pytest.raises(InvariantViolation, match="never ended"):
        simulation.run_sync()
