"""Updates in the simulation harness (issue 34): each run takes updates at random times while it
sleeps, from callers that wait for each outcome, two engines killed and replaced meanwhile (a
caller whose engine died calls again through the next one with the same update id); each
update is applied once, in order, its caller gets the value its handler returned, and the
run's output holds every update once. Kept seeds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import pytest

import durable_trio as dt
from durable_trio.testing import Simulation
from durable_trio.testing._sample import CHAOS

if TYPE_CHECKING:
    import random

app = dt.App("sim-updates")


@app.workflow("basket")
async def basket(ctx: dt.WorkflowContext, plan: dict[str, Any]) -> list[Any]:
    items: list[Any] = []

    def add(item: Any) -> int:
        items.append(item)
        return len(items)

    ctx.on_update("add", add)
    for nap in plan["naps"]:  # updates land at any of these awaits
        await ctx.sleep(nap)
    return items


def workload(rng: random.Random, index: int) -> tuple[str, Any]:
    naps = [rng.uniform(60, 300) for _ in range(rng.randint(4, 8))]
    return "basket", {"naps": naps, "updates": rng.randint(1, 4), "index": index}


def updates(
    rng: random.Random, workflow: str, plan: dict[str, Any]
) -> list[tuple[float, str, Any, Any]]:
    """Sent within the run's first 200 s: it sleeps 240 s at least, so each lands while it is
    alive, however long a killed engine delays a caller."""
    del workflow
    times = sorted(rng.uniform(0, 200) for _ in range(plan["updates"]))
    return [(t, "add", f"i{plan['index']}-{k}", k + 1) for k, t in enumerate(times)]


def expected(workflow: str, plan: dict[str, Any]) -> list[Any]:
    del workflow
    return [f"i{plan['index']}-{k}" for k in range(plan["updates"])]


KEPT_SEEDS = [2, 7]


@pytest.mark.parametrize("seed", KEPT_SEEDS)
def test_each_update_is_applied_once_in_order_with_two_engines_killed(seed: int) -> None:
    report = Simulation(
        app,
        workload,
        seed=seed,
        runs=60,
        duration=3600,
        engines=2,
        faults=attrs.evolve(CHAOS, engine_kills_per_hour=6.0),
        expected_output=expected,
        updates=updates,
    ).run_sync()
    assert report.violations == ()
    assert report.runs_completed == 60
    assert report.faults["engine-kill"] >= 2
    assert sum(1 for e in report.history if e["ev"] == "update") >= 60


async def test_the_invariant_catches_an_update_applied_twice_or_out_of_order() -> None:
    from durable_trio._engine._context import UPDATE_DONE
    from durable_trio.testing._sim_engines import RecordingStore
    from durable_trio.testing._sim_ledger import Ledger
    from durable_trio.testing._sim_updates import check_updates

    store = RecordingStore()
    ledger = Ledger(transport_options={})
    await store.create_run(dt.RunRecord("r", "basket", None, dt.RunStatus.RUNNING, 0, 0))
    for update_id, status in (("r:u2", "ok"), ("r:u1", "ok"), ("r:u1", "ok"), ("r:u3", "failed")):
        text = f'{{"id": "{update_id}", "status": "{status}"}}'
        await store.append_signal("r", UPDATE_DONE, text)
    await check_updates(store, ["r"], ledger)
    assert ledger.violations == [
        "r: update r:u1 has two outcomes (applied twice)",
        "r: update r:u3 ended 'failed'",
        "r: updates applied out of order: ['r:u2', 'r:u1', 'r:u1', 'r:u3']",
    ]
