"""One column of benchmarks/redis_cpu.py: our client's CPU per command, in a process of its own.

Run as a script (not ``-m``), so that ``PYTHONPATH`` alone picks the ``durable_trio`` measured
(this tree's, or another checkout's for a before/after)::

    PYTHONPATH=TREE python benchmarks/_redis_cpu_worker.py --redis URL --callers C --commands N

``C`` tasks share one client of one connection (``pool_size=1``, as ioredis's one connection)
and send ``N`` commands in all (``RPUSH``, or ``PING``), each task awaiting its reply before its
next command. One untimed warm-up round, then ``--rounds`` timed ones. Prints ONE JSON line:
``{"callers", "rounds": [{"cpu_us", "wall_us", "per_write"}, ...]}``: process CPU
(``time.process_time``: user + system) and wall time per command, and commands per write.
It needs only trio and ``durable_trio._redis.open_redis`` (whose API has not changed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any
from urllib.parse import urlsplit

import trio

from durable_trio._redis import open_redis


async def _measure(url: str, callers: int, commands: int, rounds: int, name: str) -> list[Any]:
    args: tuple[str, ...] = ("PING",) if name == "PING" else ("RPUSH", f"bench:ours:{callers}", "x")
    per = commands // callers
    results: list[dict[str, float]] = []
    async with open_redis(url, pool_size=1) as client:
        await client.execute("PING")

        async def loop(count: int) -> None:
            for _ in range(count):
                await client.execute(*args)

        async def round_of(count: int) -> None:
            async with trio.open_nursery() as nursery:
                for _ in range(callers):
                    nursery.start_soon(loop, count)

        await round_of(min(per, 1000))
        for _ in range(rounds):
            (conn,) = client.connections
            commands0, batches0 = conn.stats.commands, conn.stats.batches
            cpu, wall = time.process_time(), time.perf_counter()
            await round_of(per)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            total = per * callers
            writes = max(conn.stats.batches - batches0, 1)
            results.append(
                {
                    "cpu_us": cpu / total * 1e6,
                    "wall_us": wall / total * 1e6,
                    "per_write": (conn.stats.commands - commands0) / writes,
                }
            )
            await client.execute("DEL", args[1] if len(args) > 1 else "bench:none")
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis", required=True)
    parser.add_argument("--callers", type=int, default=10)
    parser.add_argument("--commands", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--command", default="RPUSH", choices=["RPUSH", "PING"])
    args = parser.parse_args()
    if (urlsplit(args.redis).port or 6379) == 6379:
        raise SystemExit("port 6379 is the machine's shared Redis: never used here")
    rounds = trio.run(_measure, args.redis, args.callers, args.commands, args.rounds, args.command)
    print(json.dumps({"callers": args.callers, "rounds": rounds}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
