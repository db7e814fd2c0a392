"""Start-up (issue 35, item 2): ``import durable_trio`` beside ``import trio``, what a worker
imports, and a worker process's spawn -> first job done.

* Imports: each timed in a fresh interpreter (``time.perf_counter()`` around the import
  statement, the interpreter's own start not counted), the best of 15 (5 with ``--quick``),
  the imports taking turns (:func:`imports_best`). "A worker's
  imports" is what ``benchmarks/_redis_worker.py`` touches before it connects:
  ``durable_trio.open_backend``, ``open_queue_transport``, ``RemoteTask`` and the Redis backend;
  "an app's imports" what a workflow module and its engine process name (``App``, ``Retry``,
  ``WorkflowContext``, ``open_backend``, ``open_engine``, ``open_worker``): the whole engine.
* Spawn -> first job done: one no-op job queued first, then ``benchmarks/_redis_worker.py``
  spawned (as S1 spawns it) with its done file; the figure is the wall clock from just before
  the spawn to the first step body's done signal (interpreter start, imports, connecting, the
  first claim and the body), the median of ``runs``; the worker's own "start" line splits it
  into spawn -> run loop and run loop -> first job done. On a private redis-server (when there
  is one) and on a SQLite file.

    python -m benchmarks startup [--quick]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import durable_trio as dt

from . import redis as queue_bench
from ._redis_worker import DONE
from .redis_server import RedisError, private_redis

__all__ = ["imports_best", "section", "spawn_to_first_job"]

#: The bar of issue 35: ``import durable_trio`` at most this many times ``import trio``.
TARGET = 1.6

#: What each import figure runs (the key is the figure's name).
IMPORTS = {
    "import trio": "import trio",
    "import durable_trio": "import durable_trio",
    "a worker's imports": (
        "import durable_trio as dt; dt.open_backend; dt.open_queue_transport; dt.RemoteTask;"
        " import durable_trio.backends.redis"
    ),
    "an app's imports": (
        "from durable_trio import App, Retry, WorkflowContext, open_backend, open_engine,"
        " open_worker"
    ),
}


def imports_best(codes: dict[str, str], *, runs: int) -> dict[str, float]:
    """Per name, the best of ``runs`` fresh interpreters' time for its code, the codes taking
    turns (one interpreter each per round, the order reversed every other round): a machine
    that slows or speeds up during the section moves every figure alike, not only the ratios'
    one side."""
    env = {**os.environ, "PYTHONPATH": str(queue_bench.SRC)}
    best = dict.fromkeys(codes, float("inf"))
    names = list(codes)
    for round_ in range(runs):
        for name in names if round_ % 2 == 0 else reversed(names):
            timed = (
                f"import time; t = time.perf_counter(); {codes[name]};"
                " print(time.perf_counter() - t)"
            )
            out = subprocess.run(
                [sys.executable, "-c", timed], capture_output=True, text=True, env=env, check=True
            )
            best[name] = min(best[name], float(out.stdout))
    return best


async def spawn_to_first_job(url: str) -> tuple[float, float]:
    """(spawn -> first job done, spawn -> the worker's run loop) in seconds, one worker."""
    namespace = f"startup-{time.monotonic_ns()}"
    async with dt.open_backend(url) as backend:
        async with dt.open_queue_transport(backend, namespace=namespace) as engine:
            await engine.dispatch(dt.RemoteTask(run_id="s", step_id="0", attempt=1, name="noop-0"))
    with tempfile.TemporaryDirectory() as folder:
        done_file = Path(folder) / "done"
        done_file.touch()
        env = {"BENCH_DONE_FILE": str(done_file)}
        spawned = time.time()
        worker = await trio.to_thread.run_sync(
            lambda: queue_bench._spawn(url, namespace, 10, env=env)
        )
        try:
            assert worker.stdout is not None
            line = await trio.to_thread.run_sync(worker.stdout.readline)
            started = float(line.split()[1])
            with trio.fail_after(60):
                while done_file.stat().st_size < DONE.size:  # noqa: ASYNC110
                    await trio.sleep(0.002)
            _, when = DONE.unpack(done_file.read_bytes()[: DONE.size])
        finally:
            queue_bench._stop(worker)
    return when - spawned, started - spawned


def _spawn_figures(where: str, url: str, runs: int) -> dict[str, Any]:
    timings = [trio.run(spawn_to_first_job, url) for _ in range(runs)]
    total = statistics.median(t[0] for t in timings)
    loop = statistics.median(t[1] for t in timings)
    best = min(t[0] for t in timings)
    note = (
        f"median of {runs}; spawn -> run loop {loop * 1000:.0f} ms (interpreter, imports,"
        f" connecting), then {(total - loop) * 1000:.0f} ms to the first job;"
        f" best {best * 1000:.0f}"
    )
    return {f"startup {where}: worker spawn -> first job done (ms)": (total * 1000, note)}


def section(quick: bool) -> dict[str, Any]:
    runs = 3 if quick else 7
    figures: dict[str, Any] = {}
    imports = 5 if quick else 15
    seconds = imports_best(IMPORTS, runs=imports)
    for name, value in seconds.items():
        figures[f"startup {name} (ms)"] = (
            value * 1000,
            f"best of {imports} fresh interpreters, taking turns with the others",
        )
    figures["startup import durable_trio / import trio (x)"] = (
        seconds["import durable_trio"] / seconds["import trio"],
        f"want <= {TARGET:g}x",
    )
    figures["startup a worker's imports / import trio (x)"] = (
        seconds["a worker's imports"] / seconds["import trio"],
        "the transport, the codec, the Redis client and broker, trio",
    )
    figures["startup an app's imports / import trio (x)"] = (
        seconds["an app's imports"] / seconds["import trio"],
        "the engine (its drivers and loops), the transport, trio",
    )
    try:
        with private_redis() as server:
            figures.update(_spawn_figures("redis", server.url, runs))
    except RedisError as exc:
        figures["startup redis skipped"] = (float("nan"), f"no redis-server: {exc}")
    with tempfile.TemporaryDirectory() as folder:
        url = "sqlite:///" + str(Path(folder) / "bench.db")
        figures.update(_spawn_figures("sqlite", url, runs))
    return figures


if __name__ == "__main__":
    for key, value in section("--quick" in sys.argv).items():
        number, note = value
        print(f"  {key:<60} {number:8.2f}  {note}")
