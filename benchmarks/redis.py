"""durable_trio on Redis, the scenarios of the race (issue 3), on a private redis-server.

* S1: drain N pre-enqueued no-op tasks with one worker PROCESS: our full round trip (dispatch
  -> handler -> result consumed by this process), at concurrency 1, 10 and 32. Timed like the
  peers': from the moment the worker enters its run loop (imports and connecting done) to the
  last result consumed (the note gives the rate from the first result).
* S2: enqueue N tasks one by one, and in bulk (``dispatch_many``).
* S3: dispatch -> result latency, one at a time, idle worker process: p50 / p99 ms.
* S4: Redis commands/s of an idle worker process serving 1 and 10 queues (INFO commandstats),
  everything counted: polls, the wake-up doorbell and the liveness keys (T11, docs/spec.md).
* S5: throughput of the same drain with 1k, 100k and 1M tasks pending.
* S1 with ``durable-trio worker --processes 2`` against ``--processes 1`` (issue 19), back to
  back: see ``benchmarks/processes.py``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import trio

import durable_trio as dt

from . import processes
from ._redis_worker import DONE
from .redis_server import commandstats_total, flushall

WORKER = Path(__file__).with_name("_redis_worker.py")
SRC = Path(__file__).resolve().parent.parent


def _spawn(
    url: str,
    namespace: str,
    concurrency: int,
    queues: int = 1,
    udp_port: int = 0,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(SRC), **(env or {})}
    return subprocess.Popen(
        [sys.executable, str(WORKER), url, namespace, str(concurrency), str(queues), str(udp_port)],
        stdout=subprocess.PIPE,
        env=env,
    )


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    process.wait()
    if process.stdout is not None:
        process.stdout.close()


def _task(n: int, name: str = "noop-0") -> dt.RemoteTask:
    return dt.RemoteTask(run_id="bench", step_id=str(n), attempt=1, name=name)


async def _fill(transport: dt.QueueTransport, count: int, start: int = 0) -> None:
    for first in range(start, start + count, 1000):
        await transport.dispatch_many(
            [_task(n) for n in range(first, min(first + 1000, start + count))]
        )


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drain(
    url: str, *, jobs: int, concurrency: int, pending: int = 0
) -> tuple[float, float, float, float]:
    """S1/S5: (jobs/s from the worker's start, jobs/s from its first result, the worker
    process's CPU microseconds per job, this process's CPU microseconds per job: the engine
    side's dispatch-free share, consuming the results), the CPU counted from the worker's
    start to the last result."""
    namespace = f"s1-{concurrency}-{time.monotonic_ns()}"
    async with dt.open_backend(url) as backend:
        async with dt.open_queue_transport(
            backend, namespace=namespace, result_concurrency=64
        ) as engine:
            await _fill(engine, jobs + pending)
            done = trio.Event()
            count = 0
            first_at = 0.0

            async def on_result(result: dt.StepResult) -> None:
                nonlocal count, first_at
                count += 1
                if count == 1:
                    first_at = time.perf_counter()
                if count == jobs:
                    done.set()

            engine.on_result(on_result)
            worker = await trio.to_thread.run_sync(_spawn, url, namespace, concurrency)
            try:
                assert worker.stdout is not None
                line = await trio.to_thread.run_sync(worker.stdout.readline)
                engine_cpu = time.process_time()
                started = float(line.split()[1])  # wall clock, in the worker
                worker_cpu = float(line.split()[2])  # its CPU seconds at that moment
                with trio.fail_after(300):
                    await done.wait()
                end_wall, end = time.time(), time.perf_counter()
                engine_cpu = time.process_time() - engine_cpu
                worker_cpu = process_cpu(worker.pid) - worker_cpu
            finally:
                _stop(worker)
    return (
        jobs / (end_wall - started),
        (jobs - 1) / max(end - first_at, 1e-9),
        worker_cpu / jobs * 1e6,
        engine_cpu / jobs * 1e6,
    )


async def drain_as_the_peers(
    url: str, *, jobs: int, concurrency: int, queue_limit: int | None = None
) -> tuple[float, float]:
    """(jobs/s, the worker's CPU microseconds per job) of :func:`drain_timed`."""
    rate, cpu, *_ = await drain_timed(
        url, jobs=jobs, concurrency=concurrency, queue_limit=queue_limit
    )
    return rate, cpu


class Timed(NamedTuple):
    """One S1 drain of :func:`drain_timed`."""

    rate: float
    """jobs/s from the worker's start (imports and connecting done) to its last done signal"""
    cpu_us: float
    """the worker's CPU microseconds per job"""
    first: float
    """seconds from the worker's spawn to its first job done"""
    from_spawn: float
    """jobs/s from the worker's spawn, its start-up counted"""


async def drain_timed(
    url: str, *, jobs: int, concurrency: int, queue_limit: int | None = None
) -> Timed:
    """S1 timed exactly as the peers' (benchmarks/peers/_common.py): ``jobs`` tasks queued
    first, one worker process spawned, each step's body appends its done signal to a file, and
    the rate is the jobs over the time from the worker's start to the last done signal. No
    process consumes the results meanwhile (they wait in the result queue, as a peer's results
    wait in its result store). (jobs/s, the worker's CPU microseconds per job, seconds from
    the worker's spawn to its first job done, as BullMQ's note gives it: issue 35, item 2; and
    jobs/s from the worker's spawn, its start-up counted, as pgqueuer's runner times its S1).
    With ``queue_limit``, the worker stores that fleet-wide limit on its queue before
    serving."""
    namespace = f"s1p-{concurrency}-{time.monotonic_ns()}"
    with tempfile.TemporaryDirectory() as folder:
        done_file = Path(folder) / "done"
        done_file.touch()
        async with dt.open_backend(url) as backend:
            async with dt.open_queue_transport(backend, namespace=namespace) as engine:
                await _fill(engine, jobs)
        env = {"BENCH_DONE_FILE": str(done_file)}
        if queue_limit is not None:
            env["BENCH_QUEUE_LIMIT"] = str(queue_limit)
        spawned = time.time()
        worker = await trio.to_thread.run_sync(lambda: _spawn(url, namespace, concurrency, env=env))
        try:
            assert worker.stdout is not None
            line = await trio.to_thread.run_sync(worker.stdout.readline)
            started, cpu_at_start = float(line.split()[1]), float(line.split()[2])
            with trio.fail_after(300):
                # polled as the peers' harness polls it (a file has no waiter to wake)
                while done_file.stat().st_size < DONE.size * jobs:  # noqa: ASYNC110
                    await trio.sleep(0.005)
            cpu = process_cpu(worker.pid) - cpu_at_start
            data = done_file.read_bytes()
        finally:
            _stop(worker)
    times = [when for _, when in DONE.iter_unpack(data)]
    last = max(times)
    return Timed(
        jobs / (last - started), cpu / jobs * 1e6, min(times) - spawned, jobs / (last - spawned)
    )


async def enqueue(url: str, *, jobs: int) -> tuple[float, float]:
    """S2: (one by one, bulk) tasks/s."""
    async with dt.open_backend(url) as backend:
        async with dt.open_queue_transport(backend, namespace=f"s2-{time.monotonic_ns()}") as t:
            start = time.perf_counter()
            for n in range(jobs):
                await t.dispatch(_task(n))
            one_by_one = jobs / (time.perf_counter() - start)
            start = time.perf_counter()
            await _fill(t, jobs, start=jobs)
            bulk = jobs / (time.perf_counter() - start)
    return one_by_one, bulk


async def latency(
    url: str, *, samples: int, pause: float = 0.002
) -> tuple[float, float, float, float]:
    """S3, one job at a time, idle worker process: (p50, p99) ms of enqueue -> job done (the
    step's body reports over UDP, as the peers' do), and (p50, p99) of the full round trip
    (the result consumed by this process). ``pause``: seconds between a result and the next
    job (0: request/reply back to back, issue 30 item 8)."""
    namespace = f"s3-{time.monotonic_ns()}"
    udp = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    await udp.bind(("127.0.0.1", 0))
    port = udp.getsockname()[1]
    worker = await trio.to_thread.run_sync(lambda: _spawn(url, namespace, 10, 1, port))
    try:
        assert worker.stdout is not None
        while (line := await trio.to_thread.run_sync(worker.stdout.readline)).strip() != b"ready":
            assert line, "the worker died"
        async with dt.open_backend(url) as backend:
            async with dt.open_queue_transport(backend, namespace=namespace) as engine:
                arrived = trio.Event()

                async def on_result(result: dt.StepResult) -> None:
                    arrived.set()

                engine.on_result(on_result)
                one_way, round_trip = [], []
                for n in range(samples + 30):
                    arrived = trio.Event()
                    await trio.sleep(pause)  # the worker is idle when each job arrives
                    start = time.perf_counter()
                    await engine.dispatch(_task(n))
                    with trio.fail_after(10):
                        while (await udp.recv(64)) != str(n).encode():
                            pass
                        done = time.perf_counter()
                        await arrived.wait()
                    if n >= 30:
                        one_way.append((done - start) * 1000)
                        round_trip.append((time.perf_counter() - start) * 1000)
    finally:
        udp.close()
        _stop(worker)
    a, b = statistics.quantiles(one_way, n=100), statistics.quantiles(round_trip, n=100)
    return a[49], a[98], b[49], b[98]


async def idle_commands(url: str, *, queues: int, window: float) -> float:
    """S4: commands/s of an idle worker process serving ``queues`` queues."""
    namespace = f"s4-{queues}-{time.monotonic_ns()}"
    worker = await trio.to_thread.run_sync(_spawn, url, namespace, 10, queues)
    try:
        assert worker.stdout is not None
        while (line := await trio.to_thread.run_sync(worker.stdout.readline)).strip() != b"ready":
            assert line, "the worker died"
        await trio.sleep(1.0)  # its first pops and subscriptions
        before = commandstats_total(url)
        await trio.sleep(window)
        after = commandstats_total(url)
    finally:
        _stop(worker)
    return (after - before) / window


async def _median(runs: int, measure: Any) -> tuple[float, ...]:
    """Each figure the median of ``runs`` runs (as the peers' are)."""
    results = [await measure() for _ in range(runs)]
    return tuple(statistics.median(r[i] for r in results) for i in range(len(results[0])))


async def run(url: str, quick: bool, *, redis: bool = True) -> dict[str, tuple[float, str]]:
    """Every scenario on ``url`` (Redis, or a SQLite file with ``redis=False``: S4 then measures
    the idle worker's CPU instead of Redis commands, and S2 and S5 are left out)."""
    jobs = 2_000 if quick else 10_000
    runs = 1 if quick else 3
    figures: dict[str, tuple[float, str]] = {}

    def clean() -> None:
        if redis:
            flushall(url)

    for concurrency in (1, 10, 32):
        n = jobs // 5 if concurrency == 1 else jobs

        async def s1(
            n: int = n, concurrency: int = concurrency
        ) -> tuple[float, float, float, float]:
            clean()
            return await drain(url, jobs=n, concurrency=concurrency)

        rate, warm, worker_us, engine_us = await _median(runs, s1)
        figures[f"S1 drain, concurrency {concurrency} (round trips/s)"] = (
            rate,
            f"{warm:,.0f}/s from the first result",
        )
        figures[f"S1 CPU per job, concurrency {concurrency} (us)"] = (
            worker_us + engine_us,
            f"worker process {worker_us:,.0f} + result consumer {engine_us:,.0f}",
        )
    for concurrency in (10, 32):

        async def s1p(concurrency: int = concurrency) -> Timed:
            clean()
            return await drain_timed(url, jobs=jobs, concurrency=concurrency)

        rate, worker_us, first, _ = await _median(runs, s1p)
        figures[f"S1 as the peers, concurrency {concurrency} (jobs/s)"] = (
            rate,
            f"worker start -> last done signal; worker CPU {worker_us:,.0f} us/job",
        )
        figures[f"S1 as the peers, concurrency {concurrency}: spawn -> first job done (ms)"] = (
            first * 1000,
            "the worker's spawn (its interpreter, imports, connecting) to its first done signal",
        )
    if redis:  # issue 19: the same drain by `durable-trio worker --processes 2` against 1
        figures.update(await processes.run(url, quick))
        clean()
        one, bulk = await enqueue(url, jobs=jobs)
        figures["S2 enqueue one by one (tasks/s)"] = (one, "")
        figures["S2 enqueue in bulk (tasks/s)"] = (bulk, "dispatch_many")

    async def s3() -> tuple[float, float, float, float]:
        clean()
        return await latency(url, samples=100 if quick else 300)

    p50, p99, rt50, rt99 = await _median(runs, s3)
    figures["S3 latency p50 (ms)"] = (p50, "enqueue -> job done, as the peers'")
    figures["S3 latency p99 (ms)"] = (p99, "")
    figures["S3 round trip p50 (ms)"] = (rt50, "enqueue -> result consumed (ours only)")
    figures["S3 round trip p99 (ms)"] = (rt99, "")
    if not redis:  # issue 30, item 8: one request at a time, back to back (no pause)

        async def s3b() -> tuple[float, float, float, float]:
            return await latency(url, samples=100 if quick else 300, pause=0.0)

        _, _, rt50, rt99 = await _median(runs, s3b)
        figures["S3 back-to-back round trip p50 (ms)"] = (
            rt50,
            "request -> reply consumed, the next at once",
        )
        figures["S3 back-to-back round trip p99 (ms)"] = (rt99, "")
    window = 3.0 if quick else 30.0
    for queues in (1, 10):
        clean()
        if redis:
            rate = await idle_commands(url, queues=queues, window=window)
            figures[f"S4 idle worker, {queues} queue(s) (commands/s)"] = (
                rate,
                "everything counted, liveness keys included",
            )
        else:
            cpu = await idle_cpu(url, queues=queues, window=window)
            figures[f"idle worker, {queues} queue(s) (% of a core)"] = (cpu, "wake-up checks")
    if redis:
        clean()
        p50, p99 = await pod_round_trip(url, samples=100 if quick else 300)
        figures["pod request -> reply p50 (ms)"] = (p50, "issue 7: store-less pod -> control plane")
        figures["pod request -> reply p99 (ms)"] = (p99, "")
        clean()
        p50, p99 = await pod_status_via_engine(url, samples=100 if quick else 300)
        figures["pod status() via the engine p50 (ms)"] = (
            p50,
            "TenantClient -> engine control plane -> run store -> reply",
        )
        figures["pod status() via the engine p99 (ms)"] = (p99, "")
        sizes = (1_000, 100_000) if quick else (1_000, 100_000, 1_000_000)
        for pending in sizes:
            clean()
            _, warm, _, _ = await drain(url, jobs=5_000, concurrency=32, pending=pending)
            figures[f"S5 drain with {pending:,} pending (round trips/s)"] = (
                warm,
                "from the first result",
            )
        clean()
    return figures


async def pod_round_trip(url: str, *, samples: int) -> tuple[float, float]:
    """Issue 7: a store-less pod's run request -> the control plane's reply, one at a time (the
    two in this process, over the broker): (p50, p99) ms."""
    namespace = f"pods-{time.monotonic_ns()}"
    async with dt.open_backend(url) as backend:
        async with (
            dt.open_queue_transport(backend, namespace=namespace, instance_id="control") as cp,
            dt.open_queue_transport(backend, namespace=namespace, instance_id="pod") as pod,
        ):

            async def answer(request: dt.RunRequest) -> None:
                await cp.remote.publish_run_reply(dt.RunReply(request.request_id, True, "running"))

            replied = trio.Event()

            def on_reply(reply: dt.RunReply) -> None:
                replied.set()

            cp.remote.on_run_request(answer)
            pod.remote.on_run_reply(on_reply)
            timings = []
            for n in range(samples + 30):
                replied = trio.Event()
                await trio.sleep(0.002)
                start = time.perf_counter()
                await pod.remote.dispatch_run_request(dt.RunRequest(f"q{n}", "status", run_id="r"))
                with trio.fail_after(10):
                    await replied.wait()
                if n >= 30:
                    timings.append((time.perf_counter() - start) * 1000)
    cuts = statistics.quantiles(timings, n=100)
    return cuts[49], cuts[98]


async def pod_status_via_engine(url: str, *, samples: int) -> tuple[float, float]:
    """Issue 7, end to end: a store-less pod's ``TenantClient.status()`` answered by an engine
    serving as control plane (a run store read on Redis in between): (p50, p99) ms."""
    name = f"plane-{time.monotonic_ns()}"
    app = dt.App(name)

    @app.workflow("wait")
    async def wait(ctx: dt.WorkflowContext, _: Any) -> None:
        await ctx.sleep(3600)

    async with (
        dt.open_backend(url) as backend,
        dt.open_engine(app, backend, serve_tenants=True),
        dt.open_tenant_client(
            dt.Backend(url=backend.url, broker=backend.broker, keys=None), "acme", namespace=name
        ) as pod,
    ):
        await pod.start("wait", None, run_id="r")
        timings = []
        for n in range(samples + 30):
            await trio.sleep(0.002)
            start = time.perf_counter()
            with trio.fail_after(10):
                await pod.status("r")
            if n >= 30:
                timings.append((time.perf_counter() - start) * 1000)
    cuts = statistics.quantiles(timings, n=100)
    return cuts[49], cuts[98]


async def idle_cpu(url: str, *, queues: int, window: float) -> float:
    """The CPU an idle worker process uses (percent of one core) over ``window`` seconds."""
    namespace = f"idle-{queues}-{time.monotonic_ns()}"
    worker = await trio.to_thread.run_sync(lambda: _spawn(url, namespace, 10, queues))
    try:
        assert worker.stdout is not None
        while (line := await trio.to_thread.run_sync(worker.stdout.readline)).strip() != b"ready":
            assert line, "the worker died"
        await trio.sleep(1.0)
        before = _cpu_seconds(worker.pid)
        await trio.sleep(window)
        after = _cpu_seconds(worker.pid)
    finally:
        _stop(worker)
    return (after - before) / window * 100


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
