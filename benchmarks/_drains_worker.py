"""A durable_trio worker process for the drains with a body (run by ``benchmarks/drains.py``).

    python benchmarks/_drains_worker.py URL NAMESPACE CONCURRENCY JOBS BODY TARGET

Serves the step ``noop-0`` at CONCURRENCY; each step's body is BODY:

* ``file``: append one byte to the file TARGET (``os.write`` on a descriptor opened once);
* ``rpush``: one ``RPUSH TARGET x`` through ONE client of ``durable_trio.redis`` on URL (its
  defaults), opened and connected at the worker's start;
* ``none``: nothing (the drain's own cost, for profiles).

It prints ``start WALL CPU USER SYSTEM`` when it enters its run loop (imports and connecting
done: as the peers' S1 is timed), counts the distinct steps done in memory, and at the JOBS-th
prints ``done WALL CPU USER SYSTEM``; then serves until killed. With ``BENCH_PROFILE=PATH``,
cProfile runs from the start line to the done line and its stats are dumped to PATH (timed by
the process's CPU clock with ``BENCH_PROFILE_CLOCK=cpu``, else the wall clock). With
``BENCH_EXIT=1`` it exits at the done line (for ``valgrind``, which reports at the exit).
"""

from __future__ import annotations

import cProfile
import os
import sys
import time
from contextlib import AsyncExitStack

import trio

import durable_trio as dt
from durable_trio.redis import open_redis


def _clocks() -> str:
    """Wall clock, CPU seconds, and of them user and system seconds."""
    times = os.times()
    return f"{time.time():.6f} {time.process_time():.6f} {times.user:.2f} {times.system:.2f}"


async def main(
    url: str, namespace: str, concurrency: int, jobs: int, body: str, target: str
) -> None:
    async with AsyncExitStack() as stack:
        backend = await stack.enter_async_context(dt.open_backend(url))
        transport = await stack.enter_async_context(
            dt.open_queue_transport(backend, namespace=namespace, concurrency=concurrency)
        )
        seen: set[str] = set()
        profile_path = os.environ.get("BENCH_PROFILE")
        profiler = (
            None
            if not profile_path
            else cProfile.Profile(time.process_time)
            if os.environ.get("BENCH_PROFILE_CLOCK") == "cpu"
            else cProfile.Profile()
        )

        def counted(task: dt.RemoteTask) -> None:
            seen.add(task.step_id)
            if len(seen) == jobs:
                if profiler is not None and profile_path:
                    profiler.disable()
                    profiler.dump_stats(profile_path)
                print(f"done {_clocks()}", flush=True)
                if os.environ.get("BENCH_EXIT") == "1":
                    os._exit(0)

        if body == "file":
            fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            stack.callback(os.close, fd)

            async def step(task: dt.RemoteTask) -> None:
                os.write(fd, b"x")
                counted(task)

        elif body == "rpush":
            client = await stack.enter_async_context(open_redis(url))
            await client.execute("PING")  # connected before the start line, as the broker is

            async def step(task: dt.RemoteTask) -> None:
                await client.execute("RPUSH", target, b"x")
                counted(task)

        elif body == "none":  # (for profiles: the drain's own cost, no body)

            async def step(task: dt.RemoteTask) -> None:
                counted(task)

        else:
            raise SystemExit(f"unknown body {body!r}")
        print(f"start {_clocks()}", flush=True)
        if profiler is not None:
            profiler.enable()
        transport.handle("noop-0", step)
        await trio.sleep_forever()


if __name__ == "__main__":
    url, namespace, concurrency, jobs, body, target = sys.argv[1:7]
    trio.run(main, url, namespace, int(concurrency), int(jobs), body, target)
