"""The sample workload our own suite (``tests/test_simulation.py``) and ``make bench`` run
through the simulation harness: orders of 1-4 sequential steps, a 60 s durable timer, two steps
in parallel and a local step. Steps take 0.5-20 s of virtual time and fail one attempt in
twenty."""

from __future__ import annotations

import random
from typing import Any

import trio

from .._engine import App, Retry, WorkflowContext, step_info
from ._report import Faults

__all__ = ["CHAOS", "WORK_RETRY", "expected", "order", "sample_app", "work", "workload"]

#: The retry policy of ``work``: enough attempts that no run fails of its one-in-twenty flakes.
WORK_RETRY = Retry(max_attempts=50, initial=1.0, max_delay=30.0)

#: Every fault kind twice an hour (on top of the per-call broker faults of ``Faults()``).
CHAOS = Faults(
    kills_per_hour=2.0,
    restarts_per_hour=2.0,
    renewal_pauses_per_hour=2.0,
    stalls_per_hour=2.0,
)


async def work(x: int) -> int:
    """Takes 0.5-20 s (virtual) and fails one attempt in twenty: the draws are seeded by the
    attempt, so a replay draws the same."""
    info = step_info()
    rng = random.Random(f"{info.run_id}:{info.step_id}:{info.attempt}")
    await trio.sleep(rng.uniform(0.5, 20.0))
    if rng.random() < 0.05:
        raise RuntimeError("flaky")
    return x * 2


async def order(ctx: WorkflowContext, size: int) -> list[int]:
    head = [await ctx.step("work", n) for n in range(size)]
    await ctx.sleep(60)
    tail = await ctx.gather(ctx.step("work", 100), ctx.step("work", 101))
    total = await ctx.run("sum", lambda: sum(head) + sum(tail))
    return [*head, *tail, total]


async def beating_work(x: int) -> int:
    """``work`` that beats every second while it runs (the same draws, the same outcome)."""
    info = step_info()
    rng = random.Random(f"{info.run_id}:{info.step_id}:{info.attempt}")
    left = rng.uniform(0.5, 20.0)
    while left > 0:
        info.heartbeat({"left": left})
        await trio.sleep(min(1.0, left))
        left -= 1.0
    if rng.random() < 0.05:
        raise RuntimeError("flaky")
    return x * 2


def sample_app(
    name: str,
    *,
    remote: bool = False,
    heartbeat_timeout: float | None = None,
    retry: Retry = WORK_RETRY,
) -> App:
    """An app serving ``work`` (retried by ``retry``) and the workflow ``order`` (its code on
    the workers with ``remote``). With ``heartbeat_timeout``, ``work`` beats every second and
    is declared with that timeout."""
    app = App(name)
    if heartbeat_timeout is None:
        app.step("work", retry=retry)(work)
    else:
        app.step("work", retry=retry, heartbeat_timeout=heartbeat_timeout)(beating_work)
    app.workflow("order", remote=remote)(order)
    return app


def workload(rng: random.Random, index: int) -> tuple[str, Any]:
    """The ``index``-th run: an order of 1-4 sequential steps."""
    return "order", rng.randrange(1, 5)


def expected(workflow: str, size: int) -> list[int]:
    """The right output of an order of ``size``."""
    head = [2 * n for n in range(size)]
    return [*head, 200, 202, sum(head) + 402]
