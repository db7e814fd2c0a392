"""The simulation harness (durable_trio.testing): a seeded day of production with faults, the
same seed twice giving the same history byte for byte, invariant violations naming their seed
and replay command, and each fault kind at an exact virtual time."""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio

import durable_trio as dt
from durable_trio.testing import (
    BrokerFaults,
    Faults,
    InvariantViolation,
    Simulation,
    SimulationReport,
)

# --------------------------------------------------------------------------- the workload

app = dt.App("sim")


@app.step("work", retry=dt.Retry(max_attempts=50, initial=1.0, max_delay=30.0))
async def work(x: int) -> int:
    """Takes 0.5-20 s (virtual) and fails one attempt in twenty: the draws are seeded by the
    attempt, so a replay draws the same."""
    info = dt.step_info()
    rng = random.Random(f"{info.run_id}:{info.step_id}:{info.attempt}")
    await trio.sleep(rng.uniform(0.5, 20.0))
    if rng.random() < 0.05:
        raise RuntimeError("flaky")
    return x * 2


@app.workflow("order")
async def order(ctx: dt.WorkflowContext, size: int) -> list[int]:
    head = [await ctx.step("work", n) for n in range(size)]
    await ctx.sleep(60)
    tail = await ctx.gather(ctx.step("work", 100), ctx.step("work", 101))
    total = await ctx.run("sum", lambda: sum(head) + sum(tail))
    return [*head, *tail, total]


def workload(rng: random.Random, index: int) -> tuple[str, Any]:
    return "order", rng.randrange(1, 5)


def expected(workflow: str, size: int) -> list[int]:
    head = [2 * n for n in range(size)]
    return [*head, 200, 202, sum(head) + 402]


CHAOS = Faults(
    kills_per_hour=2.0,
    restarts_per_hour=2.0,
    renewal_pauses_per_hour=2.0,
    stalls_per_hour=2.0,
)


def simulation(seed: int, **options: Any) -> Simulation:
    return Simulation(app, workload, seed=seed, expected_output=expected, **options)


# --------------------------------------------------------------------------- determinism


def test_the_same_seed_twice_gives_the_same_history_byte_for_byte() -> None:
    first = simulation(7, runs=60, duration=3600, faults=CHAOS).run_sync()
    second = simulation(7, runs=60, duration=3600, faults=CHAOS).run_sync()
    other = simulation(8, runs=60, duration=3600, faults=CHAOS).run_sync()
    assert first.history_bytes() == second.history_bytes()
    assert first.digest == second.digest
    assert other.digest != first.digest
    assert sum(first.faults.values()) > 0
    assert first.runs_completed == first.runs_started == 60
