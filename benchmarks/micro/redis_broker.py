"""A micro-benchmark of the Redis broker: ``python -m benchmarks.micro.redis_broker [URL]``.

Without a URL it starts a private ``redis-server`` (:mod:`benchmarks.redis_server`). Given one, it
uses queues named ``durable_trio-bench-<random>:...`` in that database and deletes their keys
afterwards (it never flushes anything). The idle figures count every command the server runs
(``INFO commandstats``, minus the ``INFO`` calls themselves): run it against a server nobody
else uses.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

import trio

from durable_trio._redis import open_redis
from durable_trio.brokers import ClaimedJob, Job
from durable_trio.brokers.redis import RedisBroker

from . import measure_on_redis

if TYPE_CHECKING:
    from durable_trio._redis import RedisClient

__all__ = ["measure"]

_PARTS = (
    "seq", "ready", "delayed", "active", "jobs", "meta", "stalls", "claims", "failed", "armed",
    "claimed", "quarantine", "moved",
)  # fmt: skip


async def _command_count(client: RedisClient) -> int:
    """Commands the server ran so far, not counting ``INFO``."""
    text: bytes = await client.execute("INFO", "commandstats")
    total = 0
    for line in text.decode().splitlines():
        if line.startswith("cmdstat_") and not line.startswith("cmdstat_info:"):
            fields = dict(item.split("=") for item in line.partition(":")[2].split(","))
            total += int(fields["calls"])
    return total


async def _cleanup(client: RedisClient, queues: list[str]) -> None:
    keys = [f"{{{q}}}:{part}" for q in queues for part in _PARTS]
    for start in range(0, len(keys), 500):
        await client.execute("DEL", *keys[start : start + 500])


async def _idle_rate(
    client: RedisClient, prefix: str, queues: int, seconds: float, safety_poll_interval: float
) -> float:
    """Commands per second while one broker waits on ``queues`` empty queues."""
    names = [f"{prefix}:idle{queues}:{i}" for i in range(queues)]

    async def consumer(broker: RedisBroker, queue: str) -> None:
        while True:  # the transport's poll loop, reduced to its idle path
            if not await broker.pop_many(queue, 10):
                await broker.wait_for_work(queue)

    try:
        async with (
            RedisBroker(client, safety_poll_interval=safety_poll_interval) as broker,
            trio.open_nursery() as nursery,
        ):
            for name in names:
                nursery.start_soon(consumer, broker, name)
            await trio.sleep(0.3)  # settle: first pops, subscription, peeks
            before = await _command_count(client)
            await trio.sleep(seconds)
            after = await _command_count(client)
            nursery.cancel_scope.cancel()
    finally:
        await _cleanup(client, names)
    return (after - before) / seconds


async def measure(
    url: str,
    *,
    jobs: int = 20_000,
    batch: int = 100,
    producers: int = 50,
    consumers: int = 4,
    sequential: int = 2000,
    idle_seconds: float = 3.0,
) -> dict[str, float]:
    """Measure the broker against the server at ``url``.

    Args:
        url: the server (a ``redis://`` URL).
        jobs: jobs pushed, popped and completed in the throughput runs.
        batch: ``pop_many`` count.
        producers: concurrent pushing tasks.
        consumers: concurrent ``pop_many`` loops (each completes its batch concurrently).
        sequential: pushes timed one after the other.
        idle_seconds: how long each idle measurement lasts.

    Returns:
        ``push_jobs_per_s`` (concurrent pushes), ``pop_complete_jobs_per_s`` (``pop_many`` of
        ``batch`` + one ``complete_job`` per job, on a full queue), ``end_to_end_jobs_per_s``
        (both at once), ``sequential_push_us`` / ``sequential_push_p99_us`` (one push awaited
        at a time), ``sequential_pop_complete_us`` (``pop_from`` + ``complete_job`` per job),
        ``idle_commands_per_s_1_queue`` / ``idle_commands_per_s_10_queues`` (default settings)
        and ``idle_commands_per_s_10_queues_projected`` (measured with a 0.5 s safety poll,
        scaled to the default 30 s: the steady-state cost that a short run cannot see).
    """
    prefix = f"durable_trio-bench-{secrets.token_hex(4)}"
    payload = b'{"kind":"task","payload":{"n":0}}' + b" " * 200
    results: dict[str, float] = {}
    async with open_redis(url, pool_size=2) as client:
        used: list[str] = []
        try:
            async with RedisBroker(client) as broker:
                results.update(
                    await _throughput(
                        broker, prefix, used, payload, jobs, batch, producers, consumers
                    )
                )
                results.update(await _latency(broker, prefix, used, payload, sequential))
        finally:
            await _cleanup(client, used)
        results["idle_commands_per_s_1_queue"] = await _idle_rate(
            client, prefix, 1, idle_seconds, 30.0
        )
        results["idle_commands_per_s_10_queues"] = await _idle_rate(
            client, prefix, 10, idle_seconds, 30.0
        )
        short = await _idle_rate(client, prefix, 10, idle_seconds, 0.5)
        results["idle_commands_per_s_10_queues_projected"] = short * 0.5 / 30.0
    return results


async def _throughput(
    broker: RedisBroker,
    prefix: str,
    used: list[str],
    payload: bytes,
    jobs: int,
    batch: int,
    producers: int,
    consumers: int,
) -> dict[str, float]:
    results: dict[str, float] = {}

    async def produce(queue: str, count: int) -> None:
        for i in range(count):
            await broker.push_on(queue, Job(f"{i}", payload))

    async def complete(queue: str, job: ClaimedJob) -> None:
        await broker.complete_job(job.lease, queue)

    async def consume(queue: str, total: list[int], until: int) -> None:
        while total[0] < until:
            claimed = await broker.pop_many(queue, batch)
            if not claimed:
                await trio.sleep(0.001)
                continue
            total[0] += len(claimed)
            async with trio.open_nursery() as nursery:
                for job in claimed:
                    nursery.start_soon(complete, queue, job)

    queue = f"{prefix}:throughput"
    used.append(queue)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(producers):
            nursery.start_soon(produce, queue, jobs // producers)
    pushed = jobs // producers * producers
    results["push_jobs_per_s"] = pushed / (trio.current_time() - start)

    start = trio.current_time()
    done = [0]
    async with trio.open_nursery() as nursery:
        for _ in range(consumers):
            nursery.start_soon(consume, queue, done, pushed)
    results["pop_complete_jobs_per_s"] = done[0] / (trio.current_time() - start)

    queue = f"{prefix}:end-to-end"
    used.append(queue)
    start = trio.current_time()
    done = [0]
    async with trio.open_nursery() as nursery:
        for _ in range(producers):
            nursery.start_soon(produce, queue, jobs // producers)
        for _ in range(consumers):
            nursery.start_soon(consume, queue, done, pushed)
    results["end_to_end_jobs_per_s"] = done[0] / (trio.current_time() - start)
    return results


async def _latency(
    broker: RedisBroker, prefix: str, used: list[str], payload: bytes, sequential: int
) -> dict[str, float]:
    queue = f"{prefix}:latency"
    used.append(queue)
    for i in range(50):  # warm up: scripts cached, connections open
        await broker.push_on(queue, Job(f"w{i}", payload))
    samples: list[float] = []
    for i in range(sequential):
        start = trio.current_time()
        await broker.push_on(queue, Job(f"{i}", payload))
        samples.append(trio.current_time() - start)
    samples.sort()
    start = trio.current_time()
    popped = 0
    while (job := await broker.pop_from(queue)) is not None:
        await broker.complete_job(job.lease, queue)
        popped += 1
    elapsed = trio.current_time() - start
    return {
        "sequential_push_us": sum(samples) / len(samples) * 1e6,
        "sequential_push_p99_us": samples[int(len(samples) * 0.99)] * 1e6,
        "sequential_pop_complete_us": elapsed / max(popped, 1) * 1e6,
    }


def main() -> None:
    """Print :func:`measure` on the URL given as the first argument, or on a private server."""
    for name, value in measure_on_redis("redis_broker", measure).items():
        print(f"{name:45} {value:12.2f}")


if __name__ == "__main__":
    main()
