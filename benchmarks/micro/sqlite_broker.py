"""A micro-benchmark of the SQLite broker: round trips per second and the idle cost of waiting.

Run it with ``python -m benchmarks.micro.sqlite_broker [DIRECTORY]`` (a temporary directory
by default), or call :func:`measure` from Trio.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from typing import TYPE_CHECKING

import trio

from durable_trio.brokers import Job
from durable_trio.brokers.sqlite import SqliteBroker

if TYPE_CHECKING:
    from durable_trio.brokers.sqlite import Synchronous

__all__ = ["measure"]


async def _round_trips(broker: SqliteBroker, queue: str, count: int, tag: str) -> None:
    for n in range(count):
        await broker.push_on(queue, Job(f"{tag}-{n}", b'{"kind":"task","payload":{}}'))
        claimed = await broker.pop_from(queue, worker=tag)
        if claimed is not None:
            await broker.complete_job(claimed.lease, queue)


async def _drain(broker: SqliteBroker, queue: str) -> None:
    while (claimed := await broker.pop_from(queue)) is not None:
        await broker.complete_job(claimed.lease, queue)


async def measure(
    path: str | os.PathLike[str],
    *,
    round_trips: int = 3000,
    concurrency: int = 32,
    idle_queues: int = 10,
    idle_seconds: float = 3.0,
    wake_samples: int = 20,
    synchronous: Synchronous = "NORMAL",
    wakeup_interval: float = 0.05,
) -> dict[str, float]:
    """Measure one broker on the file ``path`` (created; use a fresh one).

    Args:
        path: the database file.
        round_trips: push + pop + complete round trips per throughput measurement.
        concurrency: tasks sharing the broker in the concurrent measurement.
        idle_queues: empty queues waited on in the idle measurement.
        idle_seconds: how long the idle measurement lasts.
        wake_samples: cross-connection wake-ups timed.
        synchronous: the broker's ``synchronous`` setting.
        wakeup_interval: the broker's ``wakeup_interval``.

    Returns:
        ``sequential_round_trips_per_s``, ``concurrent_round_trips_per_s`` (``concurrency``
        tasks), ``baseline_cpu_percent`` (this process asleep, no waiter), ``idle_cpu_percent``
        and ``idle_queries_per_s`` (``idle_queues`` tasks in ``wait_for_work``: process CPU
        time over wall time, and operations plus ticks the connection thread ran per
        second: an idle tick is one ``PRAGMA data_version``), and
        ``cross_connection_wake_ms_mean`` / ``_max`` (a push on a second connection to a
        ``wait_for_work`` on the first), plus the settings used.
    """
    results: dict[str, float] = {
        "wakeup_interval": wakeup_interval,
        "synchronous_full": float(synchronous == "FULL"),
        "concurrency": float(concurrency),
        "idle_queues": float(idle_queues),
    }
    broker = await SqliteBroker.open(path, synchronous=synchronous, wakeup_interval=wakeup_interval)
    other = await SqliteBroker.open(path, synchronous=synchronous)
    try:
        # sequential
        await _round_trips(broker, "bench:warmup", 200, "warm")
        start = time.perf_counter()
        await _round_trips(broker, "bench:seq", round_trips, "seq")
        results["sequential_round_trips_per_s"] = round_trips / (time.perf_counter() - start)

        # concurrent
        per_task = max(1, round_trips // concurrency)
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for t in range(concurrency):
                nursery.start_soon(_round_trips, broker, "bench:conc", per_task, f"c{t}")
        elapsed = time.perf_counter() - start
        await _drain(broker, "bench:conc")
        results["concurrent_round_trips_per_s"] = per_task * concurrency / elapsed

        # idle: baseline, then idle_queues waiters
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await trio.sleep(idle_seconds)
        results["baseline_cpu_percent"] = (
            100 * (time.process_time() - cpu0) / (time.perf_counter() - wall0)
        )
        async with trio.open_nursery() as nursery:
            for q in range(idle_queues):
                nursery.start_soon(broker.wait_for_work, f"bench:idle:{q}")
            await trio.sleep(0.2)  # settle: every waiter made its first look
            connection = broker.connection
            executed0 = connection.executed + connection.ticks
            cpu0, wall0 = time.process_time(), time.perf_counter()
            await trio.sleep(idle_seconds)
            wall = time.perf_counter() - wall0
            results["idle_cpu_percent"] = 100 * (time.process_time() - cpu0) / wall
            executed = connection.executed + connection.ticks - executed0
            results["idle_queries_per_s"] = executed / wall
            nursery.cancel_scope.cancel()

        # wake-up latency across connections (the path another process's push takes)
        latencies: list[float] = []
        for n in range(wake_samples):
            queue = f"bench:wake:{n}"
            woke = trio.Event()

            async def waiter(queue: str = queue, woke: trio.Event = woke) -> None:
                await broker.wait_for_work(queue)
                woke.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                await trio.sleep(0.01 + (n % 7) * 0.007)  # spread pushes across the tick
                pushed = trio.current_time()
                await other.push_on(queue, Job(f"w{n}", b"{}"))
                await woke.wait()
                latencies.append(trio.current_time() - pushed)
            await _drain(broker, queue)
        results["cross_connection_wake_ms_mean"] = 1000 * math.fsum(latencies) / len(latencies)
        results["cross_connection_wake_ms_max"] = 1000 * max(latencies)
    finally:
        await other.aclose()
        await broker.aclose()
    return results


def main() -> None:
    """Print :func:`measure` for ``synchronous`` NORMAL and FULL in ``argv[1]`` or a temp dir."""

    async def run(directory: str) -> None:
        settings: tuple[Synchronous, ...] = ("NORMAL", "FULL")
        for synchronous in settings:
            path = os.path.join(directory, f"bench-{synchronous.lower()}.db")
            result = await measure(path, synchronous=synchronous)
            print(f"synchronous={synchronous}")
            for key, value in result.items():
                print(f"  {key:34} {value:12.2f}")

    if len(sys.argv) > 1:
        trio.run(run, sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as directory:
            trio.run(run, directory)


if __name__ == "__main__":
    main()
