"""S1 drain with ``durable-trio worker --processes N`` (issue 19): N worker processes under
the supervisor against one, back to back on the same private redis-server.

Timed as the peers' S1: from the worker's spawn (here the supervisor's, so the N children's
start is counted) to the last of ``jobs`` done signals (a datagram each step body sends, as
the peers' jobs do; results are left in their queue, no one consumes them); the note gives the
rate from the first child's banner (imports and connecting done) and the CPU seconds of the
workers, this process and Redis. Each child serves the no-op step of
``benchmarks/_bench_app.py`` at concurrency 10, through ``open_worker``.

    python -m benchmarks.processes [--quick]
"""

from __future__ import annotations

import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import trio

import durable_trio as dt

from .redis_server import _info_fields, flushall, private_redis, redis_version

APP = f"{Path(__file__).with_name('_bench_app.py')}:app"
SRC = Path(__file__).resolve().parent.parent


def _spawn(url: str, namespace: str, processes: int, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "BENCH_DONE_PORT": str(port)}
    argv = [
        sys.executable, "-m", "durable_trio", "worker", APP, "--backend", url,
        "--namespace", namespace, "--concurrency", "10", "--processes", str(processes),
    ]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)


def _redis_cpu(url: str) -> float:
    fields = _info_fields(url, "cpu")
    return float(fields["used_cpu_user"]) + float(fields["used_cpu_sys"])


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


async def drain_processes(
    url: str, *, jobs: int, processes: int, step: str = "noop-0"
) -> tuple[float, float, float, float, float]:
    """(jobs/s from the spawn, jobs/s from the first child's banner, and the CPU seconds of the
    workers (supervisor included), of this process (dispatch, done signals) and of Redis)."""
    namespace = f"s1p{processes}-{time.monotonic_ns()}"
    udp = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    udp.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 1 << 22)  # drop none
    await udp.bind(("127.0.0.1", 0))
    port = udp.getsockname()[1]
    async with (
        dt.open_backend(url) as backend,
        dt.open_queue_transport(backend, namespace=namespace, result_concurrency=64) as engine,
    ):
        for first in range(0, jobs, 1000):
            await engine.dispatch_many(
                [
                    dt.RemoteTask(run_id="bench", step_id=str(n), attempt=1, name=step)
                    for n in range(first, min(first + 1000, jobs))
                ]
            )
        done = trio.Event()

        async def count_done_signals() -> None:
            seen: set[bytes] = set()
            while len(seen) < jobs:
                seen.add((await udp.recvfrom(64))[0])
            done.set()

        mine, children, server = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), 0.0
        server = _redis_cpu(url)
        spawned = time.time()
        worker = await trio.to_thread.run_sync(_spawn, url, namespace, processes, port)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(count_done_signals)
                assert worker.stdout is not None
                await trio.to_thread.run_sync(worker.stdout.readline)
                banner = time.time()
                with trio.fail_after(300):
                    await done.wait()
                end = time.time()
            mine, server = _cpu(resource.RUSAGE_SELF) - mine, _redis_cpu(url) - server
        finally:
            worker.send_signal(signal.SIGTERM)
            try:
                await trio.to_thread.run_sync(worker.wait, 20)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
            if worker.stdout is not None:
                worker.stdout.close()
            udp.close()
    # the supervisor waited for its children, this process for the supervisor: all counted
    workers = _cpu(resource.RUSAGE_CHILDREN) - children
    return jobs / (end - spawned), jobs / (end - banner), workers, mine, server


async def _pair(
    url: str, *, jobs: int, runs: int, step: str, label: str
) -> dict[str, tuple[float, str]]:
    """1 then 2 processes, alternated ``runs`` times on ``url`` (flushed between): medians."""
    measured: dict[int, list[tuple[float, ...]]] = {1: [], 2: []}
    for _ in range(runs):
        for processes in (1, 2):
            flushall(url)
            measured[processes].append(
                await drain_processes(url, jobs=jobs, processes=processes, step=step)
            )
    figures: dict[str, tuple[float, str]] = {}
    cpu_per_job = 0.0
    for processes, rates in measured.items():
        spawn = statistics.median(r[0] for r in rates)
        ready = statistics.median(r[1] for r in rates)
        workers, mine, server = (statistics.median(r[i] for r in rates) for i in (2, 3, 4))
        if processes == 1:
            cpu_per_job = (workers + mine + server) / jobs
        figures[f"{label}, --processes {processes} (round trips/s)"] = (
            spawn,
            f"{ready:,.0f}/s from the first child's banner; CPU s: workers {workers:.1f}, "
            f"dispatcher {mine:.1f}, redis {server:.1f}",
        )
    one = figures[f"{label}, --processes 1 (round trips/s)"][0]
    two = figures[f"{label}, --processes 2 (round trips/s)"][0]
    cores = os.cpu_count() or 1
    ceiling = cores / cpu_per_job / one
    figures[f"{label}, --processes 2 / 1 (ratio)"] = (two / one, f"{cores} core(s)")
    figures[f"{label}, the machine's ceiling for 2 / 1 (ratio)"] = (
        ceiling,
        f"{cores} core(s) / {cpu_per_job * 1e6:,.0f} us of CPU per job in all (workers, "
        "collector, redis; one process) as a multiple of the one-process rate",
    )
    return figures


async def run(url: str, quick: bool) -> dict[str, tuple[float, str]]:
    """The no-op drain, then the ``cpu-1ms`` one, each as :func:`_pair`."""
    runs = 1 if quick else 3
    figures = await _pair(
        url, jobs=2_000 if quick else 10_000, runs=runs, step="noop-0", label="S1 drain"
    )
    cpu_jobs = 500 if quick else 6_000
    label = "S1 drain of 1 ms CPU steps"
    figures.update(await _pair(url, jobs=cpu_jobs, runs=runs, step="cpu-1ms", label=label))
    return figures


def main() -> None:
    quick = "--quick" in sys.argv
    with private_redis() as server:
        print(f"  (private redis-server {redis_version(server.url)} on {server.url})")
        for name, (value, note) in trio.run(run, server.url, quick).items():
            print(f"  {name:<45} {value:>12,.2f}  {note}")


if __name__ == "__main__":
    main()
