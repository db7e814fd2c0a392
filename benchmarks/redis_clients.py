"""Our Redis client against redis-py, on one private redis-server, in the same run (issue 14).

Why the broker speaks Redis through its own client (``durable_trio._redis``, on hiredis's parser)
and not through the ``redis`` package: docs/decisions.md, "The Redis client". Each client gets
one connection for its commands (and a second one that pushes, for the blocking pop); the columns
take turns, three times, and each figure is the best of its three:

* ``PING`` round trips/s, one after the other;
* ``EVALSHA`` of a small script (one ``INCR``) round trips/s, through each client's script
  object (``EVALSHA`` with the ``NOSCRIPT`` fallback);
* pipelines of 100 ``SET`` per round trip: commands/s;
* a blocking pop: ``BLPOP`` on its own connection, woken by an ``LPUSH`` from the other one;
  milliseconds from just before the push is sent to the pop's return (p50, p99).

Three columns: ours under ``trio.run``; redis-py's asyncio client (``redis.asyncio.Redis``, with
the hiredis parser when hiredis is installed) under ``asyncio.run``; and redis-py under
``trio.run`` through trio-asyncio (an asyncio loop re-implemented on Trio), each call crossing
the bridge with ``trio_asyncio.aio_as_trio``: the only way a Trio program can use it.

redis-py is NOT a dependency of the project. Install it (and the bridge) out of the way and put
it on ``PYTHONPATH`` for this script only; without it those columns are skipped with a note::

    .venv/bin/python -m pip install --target /tmp/redispy --no-deps redis trio-asyncio greenlet
    PYTHONPATH=/tmp/redispy .venv/bin/python -m benchmarks.redis_clients [--quick]

(``--no-deps``: trio-asyncio's other dependencies, trio among them, are the project's own.)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import platform
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

import trio

from durable_trio._redis import open_redis

from .redis_server import RedisError, private_redis, redis_version

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine
    from types import ModuleType

    Job = Callable[[], Coroutine[Any, Any, None]]

Figures = dict[str, Any]

SCRIPT = "return redis.call('INCR', KEYS[1])"
PIPELINE = 100
ROUNDS = 3
# Between two pushes: long enough for the popper to be blocked in BLPOP again on the server.
POP_GAP = 0.002


class _Sizes:
    def __init__(self, quick: bool) -> None:
        self.pings = 500 if quick else 2000
        self.scripts = 500 if quick else 2000
        self.pipelines = 20 if quick else 100
        self.pops = 30 if quick else 200


def _figures(who: str, ping: float, script: float, pipe: float, pops: list[float]) -> Figures:
    cut = statistics.quantiles(pops, n=100)
    return {
        f"{who}: PING round trips/s": ping,
        f"{who}: EVALSHA round trips/s": script,
        f"{who}: pipeline of {PIPELINE} SET, commands/s": pipe,
        f"{who}: BLPOP woken by a push, p50 ms": (
            statistics.median(pops) * 1000,
            f"p99 {cut[98] * 1000:.3f} ms, {len(pops)} pops",
        ),
    }


async def _rate(count: int, call: Callable[[], Awaitable[Any]], per_call: int = 1) -> float:
    """Calls (times ``per_call``) per second of ``call``, awaited ``count`` times in a row."""
    start = time.perf_counter()
    for _ in range(count):
        await call()
    return count * per_call / (time.perf_counter() - start)


# --- ours, under trio.run -----------------------------------------------------------------------


async def ours(url: str, sizes: _Sizes) -> Figures:
    """The four figures of ``durable_trio._redis`` (one pooled connection, one dedicated)."""
    async with open_redis(url, pool_size=1) as client:
        await client.execute("PING")  # connect outside the timing
        ping = await _rate(sizes.pings, lambda: client.execute("PING"))
        script = client.script(SCRIPT)
        evalsha = await _rate(sizes.scripts, lambda: script(keys=["bench:ours:n"]))

        async def pipeline() -> Any:
            # Built per round, as redis-py's pipeline object has to be.
            return await client.pipeline([("SET", f"bench:ours:{i}", "x") for i in range(PIPELINE)])

        pipe = await _rate(sizes.pipelines, pipeline, PIPELINE)
        popped: list[float] = []
        async with client.dedicated() as popper:

            async def pop_all() -> None:
                for _ in range(sizes.pops):
                    await popper.execute("BLPOP", "bench:ours:q", 0, reply_timeout=30)
                    popped.append(time.perf_counter())

            pushed: list[float] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pop_all)
                for _ in range(sizes.pops):
                    await trio.sleep(POP_GAP)
                    pushed.append(time.perf_counter())
                    await client.execute("LPUSH", "bench:ours:q", "x")
    pops = [after - before for before, after in zip(pushed, popped, strict=True)]
    return _figures("ours", ping, evalsha, pipe, pops)


# --- redis-py, asyncio (natively, or bridged) ---------------------------------------------------


def _redis_py() -> ModuleType | None:
    # Imported by name: redis-py is no dependency, so neither installed for mypy nor typed here.
    try:
        return importlib.import_module("redis.asyncio")
    except ImportError:
        return None


async def _redis_py_figures(
    aioredis: ModuleType,
    url: str,
    sizes: _Sizes,
    who: str,
    cross: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]],
    sleep: Callable[[float], Awaitable[None]],
    concurrently: Callable[[Job, Job], Awaitable[None]],
) -> Figures:
    """The four figures of redis-py; ``cross`` awaits one redis-py call (maybe over a bridge)."""
    client = aioredis.Redis.from_url(url, single_connection_client=True)
    popper = aioredis.Redis.from_url(url, single_connection_client=True)
    try:
        await cross(client.ping)
        await cross(popper.ping)
        ping = await _rate(sizes.pings, lambda: cross(client.ping))
        script = client.register_script(SCRIPT)
        evalsha = await _rate(
            sizes.scripts, lambda: cross(lambda: script(keys=["bench:redispy:n"]))
        )

        async def pipeline() -> Any:
            pipe = client.pipeline(transaction=False)
            for i in range(PIPELINE):
                pipe.set(f"bench:redispy:{i}", "x")
            return await pipe.execute()

        pipe = await _rate(sizes.pipelines, lambda: cross(pipeline), PIPELINE)
        popped: list[float] = []
        pushed: list[float] = []

        async def pop_all() -> None:
            for _ in range(sizes.pops):
                await cross(lambda: popper.blpop(["bench:redispy:q"], 0))
                popped.append(time.perf_counter())

        async def push_all() -> None:
            for _ in range(sizes.pops):
                await sleep(POP_GAP)
                pushed.append(time.perf_counter())
                await cross(lambda: client.lpush("bench:redispy:q", "x"))

        await concurrently(pop_all, push_all)
    finally:
        await cross(client.aclose)
        await cross(popper.aclose)
    pops = [after - before for before, after in zip(pushed, popped, strict=True)]
    return _figures(who, ping, evalsha, pipe, pops)


async def _direct(call: Callable[[], Awaitable[Any]]) -> Any:
    return await call()


async def _asyncio_both(first: Job, second: Job) -> None:
    async with asyncio.TaskGroup() as group:
        group.create_task(first())
        group.create_task(second())


async def _trio_both(first: Job, second: Job) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        nursery.start_soon(second)


def redis_py_asyncio(aioredis: ModuleType, url: str, sizes: _Sizes) -> Figures:
    """redis-py's asyncio client under ``asyncio.run``."""
    return asyncio.run(
        _redis_py_figures(
            aioredis, url, sizes, "redis-py, asyncio", _direct, asyncio.sleep, _asyncio_both
        )
    )


def redis_py_trio(aioredis: ModuleType, url: str, sizes: _Sizes) -> Figures:
    """redis-py under ``trio.run`` through trio-asyncio (skipped without it)."""
    try:
        bridge = importlib.import_module("trio_asyncio")
    except ImportError:
        return {
            "redis-py under trio.run": (
                float("nan"),
                "skipped: trio-asyncio not importable; redis-py speaks asyncio only and cannot "
                "run inside trio.run without such a bridge",
            )
        }

    async def cross(call: Callable[[], Awaitable[Any]]) -> Any:
        return await bridge.aio_as_trio(call)()

    async def main() -> Figures:
        async with bridge.open_loop():
            return await _redis_py_figures(
                aioredis, url, sizes, "redis-py, trio-asyncio", cross, trio.sleep, _trio_both
            )

    return trio.run(main)


def _best(rounds: list[Figures]) -> Figures:
    """Per figure, the best of the rounds: the highest rate, the lowest p50 (with its p99)."""
    best: Figures = {}
    for figures in rounds:
        for key, value in figures.items():
            if key not in best:
                best[key] = value
            elif isinstance(value, tuple):
                if value[0] < best[key][0]:
                    best[key] = value
            elif value > best[key]:
                best[key] = value
    return best


def run(url: str, quick: bool) -> Figures:
    """Every column on ``url`` (a private server); redis-py's columns skipped without it.

    The columns take turns, ``ROUNDS`` times (once with ``quick``), and each figure is the best
    of its rounds: on a shared machine, load that comes and goes then hits every column alike.
    """
    sizes = _Sizes(quick)
    aioredis = _redis_py()
    columns: list[Callable[[], Figures]] = [lambda: trio.run(ours, url, sizes)]
    skipped: Figures = {}
    if aioredis is None:
        skipped["redis-py"] = (
            float("nan"),
            "skipped: the redis package is not importable (it is not a dependency; see "
            "python -m benchmarks.redis_clients --help)",
        )
    else:
        parser = "hiredis" if importlib.import_module("redis.utils").HIREDIS_AVAILABLE else "python"
        version = importlib.import_module("redis").__version__
        print(f"  (redis-py {version}, {parser} parser)")
        columns.append(lambda: redis_py_asyncio(aioredis, url, sizes))
        columns.append(lambda: redis_py_trio(aioredis, url, sizes))
    rounds: list[list[Figures]] = [[] for _ in columns]
    for _ in range(1 if quick else ROUNDS):
        for results, column in zip(rounds, columns, strict=True):
            results.append(column())
    figures: Figures = {}
    for results in rounds:
        figures.update(_best(results))
    return figures | skipped


def section(quick: bool) -> Figures:
    """``python -m benchmarks redis-clients``: :func:`run` on a private redis-server."""
    try:
        with private_redis() as server:
            print(f"  (private redis-server {redis_version(server.url)} on {server.url})")
            return run(server.url, quick)
    except RedisError as exc:
        return {"redis-clients section skipped": (float("nan"), f"no redis-server: {exc}")}


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.redis_clients",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="smaller runs (a smoke test)")
    args = parser.parse_args()
    print(
        f"Redis clients — Python {platform.python_version()}, {platform.machine()}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}{' (quick)' if args.quick else ''}"
    )
    start = time.perf_counter()
    figures = section(args.quick)
    width = max(map(len, figures), default=10)
    for key, value in figures.items():
        number, note = value if isinstance(value, tuple) else (value, "")
        print(f"  {key:<{width}}  {float(number):>14,.2f}  {note}")
    print(f"  ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
