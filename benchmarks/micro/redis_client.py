"""A micro-benchmark of the Redis client: ``python -m benchmarks.micro.redis_client [URL]``.

Without a URL it starts a private ``redis-server`` (:mod:`benchmarks.redis_server`). Given one, it
writes a few keys under ``durable_trio:bench:`` in that database and deletes them afterwards (it
never flushes anything).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from durable_trio._redis import open_redis

from . import measure_on_redis

__all__ = ["measure"]

_PREFIX = "durable_trio:bench:"

_Execute = Callable[..., Awaitable[Any]]


async def measure(
    url: str,
    *,
    sequential: int = 2000,
    pipelines: int = 20,
    pipeline_size: int = 1000,
    tasks: int = 100,
    per_task: int = 100,
) -> dict[str, float]:
    """Measure the client against the server at ``url``.

    Args:
        url: the server (a ``redis://`` URL).
        sequential: how many ``GET`` to time one after the other.
        pipelines: how many pipelines of ``pipeline_size`` ``GET`` to time.
        pipeline_size: commands per pipeline.
        tasks: concurrent tasks sharing the client.
        per_task: sequential ``GET`` per concurrent task.

    Returns:
        microseconds per command: ``sequential_get_us``, ``pipelined_get_us``,
        ``concurrent_get_us`` (``tasks`` tasks, default pool of 2) and
        ``concurrent_one_connection_get_us`` (the same over a single connection).
    """
    key = f"{_PREFIX}k"
    results: dict[str, float] = {}
    async with open_redis(url) as client:
        await client.execute("SET", key, "x" * 16)
        for _ in range(100):  # warm up (and open the connection)
            await client.execute("GET", key)

        start = trio.current_time()
        for _ in range(sequential):
            await client.execute("GET", key)
        results["sequential_get_us"] = (trio.current_time() - start) / sequential * 1e6

        batch = [("GET", key)] * pipeline_size
        start = trio.current_time()
        for _ in range(pipelines):
            await client.pipeline(batch)
        elapsed = trio.current_time() - start
        results["pipelined_get_us"] = elapsed / (pipelines * pipeline_size) * 1e6

        results["concurrent_get_us"] = await _concurrent(client.execute, key, tasks, per_task)
    async with open_redis(url, pool_size=1) as client:
        await client.execute("GET", key)
        results["concurrent_one_connection_get_us"] = await _concurrent(
            client.execute, key, tasks, per_task
        )
        await client.execute("DEL", key)
    return results


async def _concurrent(execute: _Execute, key: str, tasks: int, per_task: int) -> float:
    async def worker() -> None:
        for _ in range(per_task):
            await execute("GET", key)

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(tasks):
            nursery.start_soon(worker)
    return (trio.current_time() - start) / (tasks * per_task) * 1e6


def main() -> None:
    """Print :func:`measure` on the URL given as the first argument, or on a private server."""
    for name, value in measure_on_redis("redis_client", measure).items():
        print(f"{name:36} {value:8.2f} µs")


if __name__ == "__main__":
    main()
