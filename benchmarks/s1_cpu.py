"""S1's per-job CPU, for A/B comparisons of the worker's hot path (issue 19, item 2).

    PYTHONPATH=. python -m benchmarks.s1_cpu LABEL [RUNS]

Against a private ``redis-server``: ``RUNS`` (default 3) times, 10,000 no-op jobs queued first,
then drained at concurrency 10 by a worker *in this process*, printing jobs/s, this process's
CPU microseconds per job (``time.process_time``, the drain alone), and per job the Trio task
steps and ``epoll`` waits (counted by a Trio instrument, in a second drain, so that its own cost
stays out of the CPU figure); then one S1 as the peers and one round trip with the worker in
its own process (:func:`benchmarks.redis.drain_as_the_peers`, :func:`benchmarks.redis.drain`).
Run it from two checkouts back to back, alternating, and compare the CPU figures: under other
load on the machine they move far less than jobs/s do.
"""

from __future__ import annotations

import sys
import time

import trio

import durable_trio as dt
from benchmarks.redis import _fill, drain, drain_as_the_peers
from benchmarks.redis_server import flushall, private_redis

JOBS = 10_000
CONCURRENCY = 10


class _Count(trio.abc.Instrument):
    def __init__(self) -> None:
        self.steps = 0
        self.waits = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += 1

    def before_io_wait(self, timeout: float) -> None:
        self.waits += 1


async def in_process(url: str, *, count: bool) -> tuple[float, float, float, float]:
    """(jobs/s, CPU us/job, task steps/job, epoll waits/job) of one drain in this process."""
    namespace = f"s1cpu-{time.monotonic_ns()}"
    async with dt.open_backend(url) as backend:
        async with dt.open_queue_transport(backend, namespace=namespace) as engine:
            await _fill(engine, JOBS)
        async with dt.open_queue_transport(
            backend, namespace=namespace, concurrency=CONCURRENCY
        ) as worker:
            done = trio.Event()
            served = 0

            async def noop(task: dt.RemoteTask) -> None:
                nonlocal served
                served += 1
                if served == JOBS:
                    done.set()

            counter = _Count()
            if count:
                trio.lowlevel.add_instrument(counter)
            cpu, wall = time.process_time(), time.perf_counter()
            worker.handle("noop-0", noop)
            await done.wait()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            if count:
                trio.lowlevel.remove_instrument(counter)
    return JOBS / wall, cpu / JOBS * 1e6, counter.steps / JOBS, counter.waits / JOBS


def main(label: str, runs: int) -> None:
    with private_redis() as server:
        for _ in range(runs):
            flushall(server.url)
            rate, cpu, _, _ = trio.run(lambda: in_process(server.url, count=False))
            flushall(server.url)
            _, _, steps, waits = trio.run(lambda: in_process(server.url, count=True))
            flushall(server.url)
            peers = trio.run(
                lambda: drain_as_the_peers(server.url, jobs=JOBS, concurrency=CONCURRENCY)
            )
            flushall(server.url)
            trip = trio.run(lambda: drain(server.url, jobs=JOBS, concurrency=CONCURRENCY))
            print(
                f"{label}: in process {rate:,.0f}/s {cpu:.0f} us/job, {steps:.2f} steps "
                f"{waits:.2f} waits/job | as the peers {peers[0]:,.0f}/s worker {peers[1]:.0f} us"
                f" | round trip {trip[0]:,.0f}/s worker {trip[2]:.0f} us consumer {trip[3]:.0f} us",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3)
