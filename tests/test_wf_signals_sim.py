"""Signals in the simulation harness (issue 18): signals sent at random times (some before
the wait), two engines killed and replaced; each signal is consumed exactly once, in order per
name. Kept seeds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import pytest

import durable_trio as dt
from durable_trio.testing import Simulation
from durable_trio.testing._sample import CHAOS

if TYPE_CHECKING:
    import random


async def approvals(ctx: dt.WorkflowContext, plan: dict[str, Any]) -> dict[str, list[Any]]:
    await ctx.sleep(plan["nap"])  # signals sent meanwhile are buffered
    got: dict[str, list[Any]] = {"a": [], "b": []}
    for name in plan["order"]:
        got[name].append(await ctx.wait_signal(name))
    return got


app = dt.App("sim-signals")
app.workflow("approvals")(approvals)
remote_app = dt.App("sim-signals-remote")
remote_app.workflow("approvals", remote=True)(approvals)


def workload(rng: random.Random, index: int) -> tuple[str, Any]:
    order = [rng.choice("ab") for _ in range(rng.randint(1, 5))]
    return "approvals", {"nap": rng.uniform(0, 300), "order": order, "index": index}


def signals(
    rng: random.Random, workflow: str, plan: dict[str, Any]
) -> list[tuple[float, str, Any]]:
    del workflow
    counts = {"a": plan["order"].count("a"), "b": plan["order"].count("b")}
    out = []
    for name, count in counts.items():
        times = sorted(rng.uniform(0, 600) for _ in range(count))
        out += [(t, name, f"{name}-{plan['index']}-{k}") for k, t in enumerate(times)]
    return out


def expected(workflow: str, plan: dict[str, Any]) -> dict[str, list[Any]]:
    del workflow
    return {
        name: [f"{name}-{plan['index']}-{k}" for k in range(plan["order"].count(name))]
        for name in "ab"
    }


KEPT_SEEDS = [(False, 3), (False, 8), (True, 5)]


@pytest.mark.parametrize(("remote", "seed"), KEPT_SEEDS)
def test_each_signal_is_consumed_once_in_order_with_two_engines_killed(
    remote: bool, seed: int
) -> None:
    report = Simulation(
        remote_app if remote else app,
        workload,
        seed=seed,
        runs=60,
        duration=3600,
        engines=2,
        faults=attrs.evolve(CHAOS, engine_kills_per_hour=6.0),
        expected_output=expected,
        signals=signals,
        engine_options={"turn_timeout": 120.0} if remote else None,
    ).run_sync()
    assert report.violations == ()
    assert report.runs_completed == 60
    assert report.faults["engine-kill"] >= 2
    assert sum(1 for e in report.history if e["ev"] == "signal") > 60


async def test_the_invariant_catches_a_signal_consumed_out_of_order() -> None:
    from durable_trio.testing._sim_engines import RecordingStore
    from durable_trio.testing._sim_ledger import Ledger
    from durable_trio.testing._sim_signals import check_signals

    store = RecordingStore()
    ledger = Ledger(transport_options={})
    await store.create_run(dt.RunRecord("r", "approvals", None, dt.RunStatus.RUNNING, 0, 0))
    await store.append_signal("r", "a", '"one"')
    await store.append_signal("r", "a", '"two"')
    for step_id, seq, output in (("1", 2, "two"), ("2", 1, "one"), ("3", 2, "oops")):
        await store.begin_step(
            dt.StepRecord(
                "r", step_id, dt.StepKind.SIGNAL, "a", dt.StepState.COMPLETED,
                input={"seq": seq}, output=output,
            )
        )  # fmt: skip
    await check_signals(store, ["r"], ledger)
    assert ledger.violations == [
        "r: wait_signal('a') at step 1 consumed #2, expected #1 (each once, in order)",
        "r: wait_signal('a') at step 2 consumed #1, expected #2 (each once, in order)",
        "r: wait_signal('a') at step 3 consumed #2, expected #3 (each once, in order)",
        "r: step 3 holds 'oops', signal 'a' #2 is '\"two\"'",
    ]
