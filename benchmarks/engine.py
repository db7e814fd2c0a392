"""Engine figures: completed 3-step workflows/s on memory, a SQLite file and a private
redis-server, and what a workflow costs over the raw transport's three round trips (the issue's
bar: at most 3x).

Both sides run the same topology: a worker transport serving a no-op step and a separate
transport (the engine's own, or a bare one for the baseline) dispatching and consuming results.

- *sequential*: one workflow (or three dependent round trips) at a time: the latency cost;
- *concurrent*: many workflows at once (or 3x as many round trips): the throughput cost.
"""

from __future__ import annotations

import functools
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import trio

import durable_trio as dt
from durable_trio._engine import App, WorkflowContext, open_engine, open_worker

from .redis_server import RedisError, private_redis

STEPS = 3
app = App("bench-engine")


@app.step("noop")
async def noop(value: Any) -> Any:
    return value


@app.workflow("three")
async def three(ctx: WorkflowContext, value: int) -> int:
    for _ in range(STEPS):
        value = await ctx.step("noop", value)
    return value


def _same(value: int) -> int:
    return value


@app.workflow("three_local")
async def three_local(ctx: WorkflowContext, value: int) -> int:
    """The same three no-op steps as local steps (``ctx.run``): checkpointed, run in the
    workflow's own process, as a DBOS ``@DBOS.step`` is (``postgres_queue``'s DBOS line)."""
    for _ in range(STEPS):
        value = await ctx.run("noop", functools.partial(_same, value))
    return value


async def _raw(backend: dt.Backend, *, sequential: int, concurrent: int) -> tuple[float, float]:
    """Seconds per 3 dependent round trips; seconds per 3 round trips under load."""
    namespace = f"bench-raw-{uuid.uuid4().hex[:6]}"
    waiting: dict[str, trio.Event] = {}

    async def handler(task: dt.RemoteTask) -> Any:
        return task.input

    async def on_result(result: dt.StepResult) -> None:
        waiting.pop(f"{result.run_id}:{result.step_id}").set()

    async def round_trips(run: str) -> None:
        for step in range(STEPS):
            done = waiting[f"{run}:{step}"] = trio.Event()
            await client.dispatch(
                dt.RemoteTask(run_id=run, step_id=str(step), attempt=1, name="noop")
            )
            await done.wait()

    async with dt.open_queue_transport(backend, namespace=namespace, concurrency=32) as worker:
        worker.handle("noop", handler)
        async with dt.open_queue_transport(
            backend, namespace=namespace, result_concurrency=16
        ) as client:
            client.on_result(on_result)
            await round_trips("warm-up")
            start = time.perf_counter()
            for n in range(sequential):
                await round_trips(f"s{n}")
            per_sequential = (time.perf_counter() - start) / sequential
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for n in range(concurrent):
                    nursery.start_soon(round_trips, f"c{n}")
            per_concurrent = (time.perf_counter() - start) / concurrent
    return per_sequential, per_concurrent


async def _engine(backend: dt.Backend, *, sequential: int, concurrent: int) -> tuple[float, float]:
    """Seconds per 3-step workflow, one at a time; seconds per workflow under load."""
    namespace = f"bench-engine-{uuid.uuid4().hex[:6]}"
    async with open_worker(app, backend, namespace=namespace, concurrency=32):
        async with open_engine(app, backend, namespace=namespace) as engine:
            await engine.result(await engine.start("three", 0))
            start = time.perf_counter()
            for n in range(sequential):
                assert await engine.result(await engine.start("three", n)) == n
            per_sequential = (time.perf_counter() - start) / sequential

            async def one(n: int) -> None:
                assert await engine.result(await engine.start("three", n)) == n

            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for n in range(concurrent):
                    nursery.start_soon(one, n)
            per_concurrent = (time.perf_counter() - start) / concurrent
    return per_sequential, per_concurrent


async def _compare(url: str, label: str, *, sequential: int, concurrent: int) -> dict[str, float]:
    best_raw = [float("inf"), float("inf")]
    best_engine = [float("inf"), float("inf")]
    # Best of three (as timeit does): on a shared machine the worst runs measure the neighbours.
    for _ in range(3):
        async with dt.open_backend(url) as backend:
            raw = await _raw(backend, sequential=sequential, concurrent=concurrent)
            engine = await _engine(backend, sequential=sequential, concurrent=concurrent)
        best_raw = [min(a, b) for a, b in zip(best_raw, raw, strict=True)]
        best_engine = [min(a, b) for a, b in zip(best_engine, engine, strict=True)]
    return {
        f"engine {label}: 3-step workflows/s, {concurrent} at once": 1 / best_engine[1],
        f"engine {label}: raw 3 round trips/s, {concurrent} at once": 1 / best_raw[1],
        f"engine {label}: workflow / raw 3 round trips, at once (x)": best_engine[1] / best_raw[1],
        f"engine {label}: 3-step workflow latency ms": best_engine[0] * 1000,
        f"engine {label}: raw 3 round trips latency ms": best_raw[0] * 1000,
        f"engine {label}: workflow / raw 3 round trips, one at a time (x)": (
            best_engine[0] / best_raw[0]
        ),
    }


async def run(quick: bool = False) -> dict[str, float]:
    """Memory, a SQLite file, and a private redis-server (skipped if it cannot be started)."""
    figures = await _compare(
        "memory://",
        "memory",
        sequential=200 if quick else 1000,
        concurrent=500 if quick else 2000,
    )
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{Path(folder) / 'bench.db'}".replace("///", "////", 1)
        figures |= await _compare(
            url, "sqlite", sequential=20 if quick else 100, concurrent=50 if quick else 300
        )
    try:
        with private_redis() as server:
            figures |= await _compare(
                server.url,
                "redis",
                sequential=50 if quick else 300,
                concurrent=200 if quick else 1000,
            )
    except RedisError as exc:
        print(f"engine benchmark: no redis figures ({exc})")
    return figures


if __name__ == "__main__":
    import sys

    for name, value in trio.run(run, "--quick" in sys.argv).items():
        print(f"  {name:<62}  {value:>10,.2f}")
