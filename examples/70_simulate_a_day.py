"""Simulate a day: a payments app, 3 workers, 300 orders, faults; seconds of wall time, one seed.

The whole system (engine, workers, memory broker) runs in one ``trio.run`` on a virtual clock,
so a working day (8 hours) of traffic takes seconds; workers are killed, restarted, stalled and
starved of lease renewals, the engine is killed and replaced, broker calls are delayed, dropped
or lose their replies, key-store writes fail, all drawn from one seed. After the run the
harness checks its invariants (no run lost, every step settled once with a result a worker
produced, every duplicate execution explained by a fault, close bounds, liveness keys), and
this example checks its own: no card charged twice. Whatever the backend given, the simulation
runs on the memory one.
"""

from __future__ import annotations

import random
from typing import Any

import trio

import durable_trio as dt
from durable_trio.testing import Faults, Simulation, SimulationReport

app = dt.App("payments")

#: The payment provider: charges by idempotency key. A redelivered charge (a worker killed
#: after charging, before acknowledging) must not charge twice.
CHARGES: dict[str, int] = {}
ATTEMPTS: dict[str, int] = {}


@app.step("charge-card", retry=dt.Retry(max_attempts=20, initial=2.0, max_delay=60.0))
async def charge_card(order: dict[str, Any]) -> dict[str, Any]:
    info = dt.step_info()
    ATTEMPTS[info.idempotency_key] = ATTEMPTS.get(info.idempotency_key, 0) + 1
    # Draws seeded by the attempt: a replay of the seed draws the same.
    rng = random.Random(f"{info.idempotency_key}:{info.attempt}")
    await trio.sleep(rng.uniform(0.2, 3.0))  # virtual seconds: the provider's latency
    if rng.random() < 0.1:
        raise TimeoutError("the payment provider timed out")
    CHARGES.setdefault(info.idempotency_key, order["amount"])  # keyed: effectively once
    return {"charged": order["amount"]}


@app.step("ship")
async def ship(order: dict[str, Any]) -> str:
    await trio.sleep(random.Random(order["id"]).uniform(1.0, 30.0))
    return f"parcel-{order['id']}"


@app.workflow("order")
async def order_workflow(ctx: dt.WorkflowContext, order: dict[str, Any]) -> dict[str, Any]:
    payment = await ctx.step("charge-card", order)
    await ctx.sleep(600)  # a durable timer: the warehouse picks twice an hour
    parcel = await ctx.step("ship", order)
    return {"paid": payment["charged"], "parcel": parcel}


def workload(rng: random.Random, index: int) -> tuple[str, Any]:
    """The index-th order of the day (inputs drawn from ``rng`` only: it is seeded)."""
    return "order", {"id": f"o{index}", "amount": rng.randrange(5, 500)}


def expected(workflow: str, order: dict[str, Any]) -> dict[str, Any]:
    return {"paid": order["amount"], "parcel": f"parcel-{order['id']}"}


def simulate(seed: int) -> SimulationReport:
    CHARGES.clear()
    ATTEMPTS.clear()
    simulation = Simulation(
        app,
        workload,
        seed=seed,
        runs=300,
        duration=8 * 3600,
        workers=3,
        faults=Faults(
            kills_per_hour=2.0,
            restarts_per_hour=2.0,
            stalls_per_hour=2.0,
            engine_kills_per_hour=1.0,
        ),
        expected_output=expected,
    )
    # Raises InvariantViolation (with the seed and a replay command) if anything broke.
    return simulation.run_sync()


async def main(backend_url: str) -> None:
    # The simulation runs its own trio.run on a virtual clock: in a thread, from here.
    report = await trio.to_thread.run_sync(simulate, 2026)
    for line in report.summary().splitlines():
        print(f"  {line}")
    redelivered = sum(1 for n in ATTEMPTS.values() if n > 1)
    print(f"  charges: {len(CHARGES)} cards charged once each; {redelivered} charge steps ran")
    print("  more than once (retries and redeliveries), covered by their idempotency keys")
    if len(CHARGES) != report.runs_completed:
        raise SystemExit("a card was charged twice, or an order never paid")


if __name__ == "__main__":
    trio.run(main, "memory://")
