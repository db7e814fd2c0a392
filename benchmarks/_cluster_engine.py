"""An engine and a worker in one process, for the cluster scaling figures (run by
``benchmarks/redis_cluster_scaling.py``).

    python benchmarks/_cluster_engine.py URL NAMESPACE WORKFLOWS

Opens the backend, a worker (concurrency 32) and an engine on NAMESPACE, prints
``start WALLCLOCK`` once they run, starts WORKFLOWS 3-step workflows at once (the workflow of
benchmarks/engine.py), waits for every result and prints ``end WALLCLOCK``; then waits to be
killed (so its connections stay up until the parent has read both lines).
"""

from __future__ import annotations

import sys
import time

import trio

import durable_trio as dt
from benchmarks.engine import app
from durable_trio._engine import open_engine, open_worker


async def main(url: str, namespace: str, workflows: int) -> None:
    async with (
        dt.open_backend(url) as backend,
        open_worker(app, backend, namespace=namespace, concurrency=32),
        open_engine(app, backend, namespace=namespace) as engine,
    ):
        print(f"start {time.time():.6f}", flush=True)

        async def one(n: int) -> None:
            assert await engine.result(await engine.start("three", n)) == n

        async with trio.open_nursery() as nursery:
            for n in range(workflows):
                nursery.start_soon(one, n)
        print(f"end {time.time():.6f}", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]))
