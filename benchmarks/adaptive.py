"""Adaptive concurrency against fixed limits, over a downstream of limited capacity (issue 5).

The downstream serves up to C calls at once in ``BASE`` seconds each; past C it shares itself,
so every call slows in proportion (latency = BASE x max(1, calls / C)). A worker with a fixed
limit of 1 leaves capacity idle, a limit of 8C queues inside the downstream (same throughput,
8x the latency), and the adaptive controller should find about C by itself.

Runs under trio's MockClock (virtual time): the downstream is simulated, so the figures are
exact and repeatable, and two virtual minutes take a few real seconds.
"""

from __future__ import annotations

import math

import trio
import trio.testing

import durable_trio as dt

CAPACITY = 8
BASE = 0.05
WARMUP = 60.0
MEASURE = 60.0


async def _one(concurrency: int | dt.Adaptive) -> tuple[float, float]:
    calls = 0
    latencies: list[tuple[float, float]] = []  # (finished at, seconds)
    async with dt.open_backend("memory://") as backend:
        async with dt.open_queue_transport(
            backend, concurrency=concurrency, result_concurrency=64, namespace="adaptive-bench"
        ) as transport:

            async def call_downstream(task: dt.RemoteTask) -> None:
                nonlocal calls
                calls += 1
                start = trio.current_time()
                try:
                    await trio.sleep(BASE * max(1.0, calls / CAPACITY))
                finally:
                    calls -= 1
                latencies.append((trio.current_time(), trio.current_time() - start))

            async def ignore(result: dt.StepResult) -> None:
                return None

            transport.handle("call", call_downstream)
            transport.on_result(ignore)
            async with trio.open_nursery() as nursery:

                async def keep_queue_full() -> None:
                    n = 0
                    while True:
                        if (await transport.health.queue_depth("call") or 0) < 500:
                            for _ in range(500):
                                n += 1
                                await transport.dispatch(
                                    dt.RemoteTask(
                                        run_id="r", step_id=str(n), attempt=1, name="call"
                                    )
                                )
                        await trio.sleep(0.25)

                nursery.start_soon(keep_queue_full)
                await trio.sleep(WARMUP + MEASURE)
                nursery.cancel_scope.cancel()
    window = sorted(d for at, d in latencies if at > WARMUP)
    p95 = window[min(len(window) - 1, math.ceil(0.95 * len(window)) - 1)]
    return len(window) / MEASURE, p95 * 1000


def run() -> dict[str, float]:
    """Throughput (calls/s) and p95 (ms) per policy, measured over the second virtual minute."""
    figures: dict[str, float] = {}
    policies: dict[str, int | dt.Adaptive] = {
        "fixed 1": 1,
        f"fixed C={CAPACITY}": CAPACITY,
        f"fixed 8C={8 * CAPACITY}": 8 * CAPACITY,
        "adaptive 1..64": dt.Adaptive(min=1, max=64),
    }
    for name, policy in policies.items():
        throughput, p95 = trio.run(_one, policy, clock=trio.testing.MockClock(autojump_threshold=0))
        figures[f"downstream C={CAPACITY}, {name}: calls/s"] = throughput
        figures[f"downstream C={CAPACITY}, {name}: p95 ms"] = p95
    figures["downstream unloaded latency ms"] = BASE * 1000
    return figures
