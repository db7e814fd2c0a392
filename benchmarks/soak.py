"""Soak: does a long-running worker's (and engine's) memory stay flat?

* transport: 1,000,000 no-op steps through ONE Redis worker process (``_redis_worker.py``,
  concurrency 32), dispatched in batches of 1,000 from this process, which consumes the results
  (at most 20,000 steps outstanding). The worker's RSS is read at 100k and at 1M steps.
* engine: 100,000 runs of a 1-step workflow, on a SQLite file and on a private redis-server,
  the engine and the worker each in its own process (200 runs in flight). The engine's RSS and
  the worker's are read at 10k and at 100k runs.

The first reading is taken once the process is warm (its pools, caches and allocator arenas
grown to their working size): the target is on what comes after, the growth.

RSS comes from ``/proc/PID/statm`` (as
:func:`durable_trio._transport._adaptive.read_rss_bytes` reads its own): resident pages x page size.

    python -m benchmarks soak            # the section, in the report's format
    python -m benchmarks.soak engine URL RUNS FIRST WORKER_PID   # one engine process (internal)
    python -m benchmarks.soak worker URL                         # one engine worker (internal)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import durable_trio as dt
from durable_trio._engine import App, WorkflowContext, open_engine, open_worker

from .redis import _spawn as spawn_transport_worker
from .redis import _stop as stop_process
from .redis_server import RedisError, private_redis

ROOT = Path(__file__).resolve().parent.parent
MB = 1024 * 1024
#: The issue's bar: what a worker or an engine may grow by between the two readings.
GROWTH_TARGET_MB = 5.0

app = App("soak")


@app.step("noop")
async def noop(value: Any) -> Any:
    return value


@app.workflow("one-step")
async def one_step(ctx: WorkflowContext, value: int) -> int:
    result: int = await ctx.step("noop", value)
    return result


def rss_bytes(pid: int) -> int:
    """A process's resident memory, from ``/proc/PID/statm`` (pages x page size)."""
    with open(f"/proc/{pid}/statm", "rb") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _spawn_module(*args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.soak", *args],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env=env,
    )


def _read_line(process: subprocess.Popen[bytes]) -> str:
    assert process.stdout is not None
    line = process.stdout.readline().decode().strip()
    if not line:
        raise RuntimeError(f"soak process {process.args!r} ended (exit {process.wait()})")
    return line


# -- the transport: one worker process, a million steps ---------------------------------------


async def transport_soak(url: str, *, steps: int, first: int) -> dict[str, tuple[float, str]]:
    """Worker RSS after ``first`` steps and after ``steps``."""
    namespace = f"soak-{time.monotonic_ns()}"
    readings: dict[int, int] = {}
    async with dt.open_backend(url) as backend:
        async with dt.open_queue_transport(
            backend, namespace=namespace, result_concurrency=64
        ) as dispatcher:
            received = 0
            progressed = trio.Event()

            async def on_result(result: dt.StepResult) -> None:
                nonlocal received, progressed
                received += 1
                if received % 1000 == 0 or received == steps:
                    progressed.set()
                    progressed = trio.Event()

            dispatcher.on_result(on_result)
            worker = await trio.to_thread.run_sync(spawn_transport_worker, url, namespace, 32)
            try:
                assert worker.stdout is not None
                while (await trio.to_thread.run_sync(_read_line, worker)) != "ready":
                    pass
                start = time.perf_counter()
                sent = 0
                with trio.fail_after(3600):
                    while received < steps:
                        while sent < steps and sent - received < 20_000:
                            batch = min(1000, steps - sent)
                            await dispatcher.dispatch_many(
                                [
                                    dt.RemoteTask(
                                        run_id="soak", step_id=str(n), attempt=1, name="noop-0"
                                    )
                                    for n in range(sent, sent + batch)
                                ]
                            )
                            sent += batch
                        await progressed.wait()
                        for mark in (first, steps):
                            if received >= mark and mark not in readings:
                                readings[mark] = rss_bytes(worker.pid)
                elapsed = time.perf_counter() - start
            finally:
                stop_process(worker)
    growth = (readings[steps] - readings[first]) / MB
    note = f"{steps:,} steps in {elapsed:.0f} s ({steps / elapsed:,.0f}/s)"
    return {
        f"transport worker RSS at {first:,} steps (MB)": (readings[first] / MB, ""),
        f"transport worker RSS at {steps:,} steps (MB)": (readings[steps] / MB, note),
        f"transport worker RSS growth, {first:,} -> {steps:,} steps (MB)": (growth, ""),
    }


# -- the engine: its own process and a worker process, 100k runs ------------------------------


async def _engine_process(url: str, runs: int, first: int, worker_pid: int) -> None:
    """Drive ``runs`` runs, 200 at a time; print ``rss RUNS ENGINE_BYTES WORKER_BYTES`` at
    ``first`` and at ``runs``, then ``done SECONDS``."""
    completed = 0
    started = 0
    marks = sorted({first, runs})
    async with dt.open_backend(url) as backend:
        async with open_engine(app, backend) as engine:
            start = time.perf_counter()

            async def client() -> None:
                nonlocal started, completed
                while started < runs:
                    n = started
                    started += 1
                    assert await engine.result(await engine.start("one-step", n)) == n
                    completed += 1
                    if marks and completed >= marks[0]:
                        mark = marks.pop(0)
                        own, theirs = rss_bytes(os.getpid()), rss_bytes(worker_pid)
                        print(f"rss {mark} {own} {theirs}", flush=True)

            async with trio.open_nursery() as nursery:
                for _ in range(200):
                    nursery.start_soon(client)
            print(f"done {time.perf_counter() - start:.3f}", flush=True)


async def _worker_process(url: str) -> None:
    async with dt.open_backend(url) as backend:
        async with open_worker(app, backend, concurrency=32):
            print("ready", flush=True)
            await trio.sleep_forever()


def engine_soak(url: str, label: str, *, runs: int, first: int) -> dict[str, tuple[float, str]]:
    """Engine and worker RSS after ``first`` runs and after ``runs``."""
    worker = _spawn_module("worker", url)
    try:
        while _read_line(worker) != "ready":
            pass
        engine = _spawn_module("engine", url, str(runs), str(first), str(worker.pid))
        try:
            readings: dict[int, tuple[int, int]] = {}
            while True:
                word, *rest = _read_line(engine).split()
                if word == "done":
                    elapsed = float(rest[0])
                    break
                mark, own, theirs = map(int, rest)
                readings[mark] = (own, theirs)
            engine.wait()
        finally:
            stop_process(engine)
    finally:
        stop_process(worker)
    figures: dict[str, tuple[float, str]] = {}
    note = f"{runs:,} runs in {elapsed:.0f} s ({runs / elapsed:,.0f}/s)"
    for index, who in enumerate(("engine", "worker")):
        at_first, at_end = readings[first][index] / MB, readings[runs][index] / MB
        figures[f"{label} {who} RSS at {first:,} runs (MB)"] = (at_first, "")
        figures[f"{label} {who} RSS at {runs:,} runs (MB)"] = (at_end, note)
        figures[f"{label} {who} RSS growth, {first:,} -> {runs:,} runs (MB)"] = (
            at_end - at_first,
            "",
        )
    return figures


def run(quick: bool = False) -> dict[str, tuple[float, str]]:
    """The three soaks (the Redis ones skipped when no redis-server can be started)."""
    steps, first_step = (100_000, 10_000) if quick else (1_000_000, 100_000)
    runs, first_run = (10_000, 1_000) if quick else (100_000, 10_000)
    figures: dict[str, tuple[float, str]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as folder:
        url = "sqlite:///" + str(Path(folder) / "soak.db")
        figures |= engine_soak(url, "engine on SQLite:", runs=runs, first=first_run)
    try:
        with private_redis() as server:
            figures |= trio.run(lambda: transport_soak(server.url, steps=steps, first=first_step))
            figures |= engine_soak(server.url, "engine on Redis:", runs=runs, first=first_run)
    except RedisError as exc:
        figures["soak on redis skipped"] = (float("nan"), f"no redis-server: {exc}")
    return figures


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "engine":
        trio.run(_engine_process, sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    elif role == "worker":
        trio.run(_worker_process, sys.argv[2])
    else:
        raise SystemExit(__doc__)
