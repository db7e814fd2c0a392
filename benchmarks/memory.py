"""Memory broker figures: no-op round trips/s, dispatch->result latency, idle polls/s."""

from __future__ import annotations

import statistics
import time
from typing import Any

import trio

import durable_trio as dt
from durable_trio.keys.memory import MemoryKeyStore


async def round_trips(backend: dt.Backend, *, jobs: int, concurrency: int) -> float:
    """No-op round trips per second: dispatch -> handler -> result consumed, one worker."""
    done = trio.Event()
    count = 0

    async def noop(task: dt.RemoteTask) -> None:
        return None

    async def on_result(result: dt.StepResult) -> None:
        nonlocal count
        count += 1
        if count == jobs:
            done.set()

    async with dt.open_queue_transport(
        backend, concurrency=concurrency, result_concurrency=concurrency, namespace="bench-rt"
    ) as transport:
        transport.handle("noop", noop)
        transport.on_result(on_result)
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            # dispatchers run beside the worker, as an engine would
            for part in range(4):

                async def dispatch_part(part: int = part) -> None:
                    for n in range(part, jobs, 4):
                        await transport.dispatch(
                            dt.RemoteTask(run_id="r", step_id=str(n), attempt=1, name="noop")
                        )

                nursery.start_soon(dispatch_part)
        await done.wait()
        return jobs / (time.perf_counter() - start)


async def latency_under_load(
    backend: dt.Backend, *, clients: int, per_client: int
) -> tuple[float, float]:
    """dispatch -> result latency (ms) with ``clients`` callers each waiting for its result
    before the next dispatch (a closed loop: ``clients`` round trips in flight): p50, p99."""
    waiting: dict[str, trio.Event] = {}

    async def noop(task: dt.RemoteTask) -> None:
        return None

    async def on_result(result: dt.StepResult) -> None:
        waiting.pop(result.step_id).set()

    timings: list[float] = []
    async with dt.open_queue_transport(
        backend, namespace="bench-load", concurrency=clients, result_concurrency=clients
    ) as transport:
        transport.handle("noop", noop)
        transport.on_result(on_result)

        async def client(c: int) -> None:
            for n in range(per_client):
                step_id = f"{c}-{n}"
                arrived = waiting[step_id] = trio.Event()
                start = time.perf_counter()
                await transport.dispatch(
                    dt.RemoteTask(run_id="r", step_id=step_id, attempt=1, name="noop")
                )
                await arrived.wait()
                timings.append((time.perf_counter() - start) * 1000)

        async with trio.open_nursery() as nursery:
            for c in range(clients):
                nursery.start_soon(client, c)
    cuts = statistics.quantiles(timings, n=100)
    return cuts[49], cuts[98]


async def latency(backend: dt.Backend, *, samples: int) -> tuple[float, float]:
    """dispatch -> result latency (ms), one job at a time, idle worker: p50, p99."""
    arrived = trio.Event()

    async def noop(task: dt.RemoteTask) -> None:
        return None

    async def on_result(result: dt.StepResult) -> None:
        arrived.set()

    timings: list[float] = []
    async with dt.open_queue_transport(backend, namespace="bench-lat") as transport:
        transport.handle("noop", noop)
        transport.on_result(on_result)
        await trio.sleep(0.05)
        for n in range(samples):
            arrived = trio.Event()
            start = time.perf_counter()
            await transport.dispatch(
                dt.RemoteTask(run_id="r", step_id=str(n), attempt=1, name="noop")
            )
            await arrived.wait()
            timings.append((time.perf_counter() - start) * 1000)
    cuts = statistics.quantiles(timings, n=100)
    return cuts[49], cuts[98]


class _PollCounter:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.pops = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def pop_from(self, queue: str, *, worker: str = "") -> Any:
        self.pops += 1
        return await self.inner.pop_from(queue, worker=worker)


async def idle_polls(broker: Any, *, names: int, seconds: float) -> float:
    """Broker polls per second of an idle transport serving ``names`` step names (after start)."""
    counter = _PollCounter(broker)
    backend = dt.Backend(url="bench://", broker=counter, keys=MemoryKeyStore())

    async def noop(task: dt.RemoteTask) -> None:
        return None

    async with dt.open_queue_transport(backend, namespace="bench-idle") as transport:
        for n in range(names):
            transport.handle(f"step-{n}", noop)
        await trio.sleep(0.1)
        before = counter.pops
        await trio.sleep(seconds)
        return (counter.pops - before) / seconds


async def run(quick: bool = False) -> dict[str, float]:
    jobs = 5_000 if quick else 30_000
    figures: dict[str, float] = {}
    # Throughput is the best of three runs (as timeit takes the best): on a shared 2-core machine
    # the worst runs measure the neighbours, not us.
    async with dt.open_backend("memory://") as backend:
        for concurrency, count in ((1, jobs // 3), (32, jobs)):
            figures[f"memory round trips/s, concurrency {concurrency}"] = max(
                [await round_trips(backend, jobs=count, concurrency=concurrency) for _ in range(3)]
            )
        p50, p99 = await latency(backend, samples=500 if quick else 2000)
        figures["memory latency p50 ms, concurrency 1"] = p50
        figures["memory latency p99 ms, concurrency 1"] = p99
        p50, p99 = await latency_under_load(backend, clients=32, per_client=50 if quick else 300)
        figures["memory latency p50 ms, concurrency 32"] = p50
        figures["memory latency p99 ms, concurrency 32"] = p99
        figures["memory idle polls/s, 10 names"] = await idle_polls(
            backend.broker, names=10, seconds=1.0 if quick else 3.0
        )
    return figures
