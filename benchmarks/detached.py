"""``make bench`` section "detached": start -> result of a one-step run started from another
process (issue 30, item 1), on SQLite, on a private Redis and on a private PostgreSQL.

This process runs an engine (reconciling, its default ``reconcile_interval`` of 5 s) and a
worker; another process (``python -m benchmarks.detached URL``: its own backend and an engine
opened with ``reconcile=False``, as a web handler's or ``durable-trio run --detach``'s) starts
each run with ``detach=True`` and waits for its result. The figure is that process's time from
the start to the result. Before the store's ``STARTS`` wake, the owner took the run at its next
reconcile tick (p50 about 5 s) and the starter saw the end at its next 1 s poll.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

import trio

import durable_trio as dt

from .ops import over_backends
from .postgres_server import private_postgres
from .signals import _Lines

Figures = dict[str, Any]

#: Runs per figure (the issue measured 25).
RUNS = 25
NAMESPACE = "bench-detached"

app = dt.App("bench-detached")


@app.step("double")
async def double(n: int) -> int:
    return 2 * n


@app.workflow("once")
async def once(ctx: dt.WorkflowContext, n: int) -> Any:
    return await ctx.step("double", n)


async def _measure(url: str, count: int, label: str) -> Figures:
    del count
    async with (
        dt.open_backend(url) as backend,
        dt.open_worker(app, backend, namespace=NAMESPACE),
        dt.open_engine(app, backend, namespace=NAMESPACE),
    ):
        starter = await trio.lowlevel.open_process(
            [sys.executable, "-m", "benchmarks.detached", url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        took: list[float] = []
        try:
            assert starter.stdin is not None
            assert starter.stdout is not None
            lines = _Lines(starter.stdout)
            assert await lines.next() == "ready"
            for n in range(RUNS):
                await trio.sleep(0.05)  # one run at a time, the owner idle when it starts
                await starter.stdin.send_all(f"{n}\n".encode())
                with trio.fail_after(60):
                    took.append(float(await lines.next()))
            await starter.stdin.aclose()
            with trio.fail_after(30):
                await starter.wait()
        finally:
            starter.kill()
    return {
        f"detached: {label} start -> result across processes p50 (ms)": (
            statistics.median(took),
            f"{RUNS} one-step runs; p90 {statistics.quantiles(took, n=10)[-1]:.2f} ms",
        ),
    }


async def _starter(url: str) -> None:
    """The other process: per line read, start a run detached, wait for its result, print the
    milliseconds it took."""
    stdin = trio.lowlevel.FdStream(0)
    async with (
        dt.open_backend(url) as backend,
        dt.open_engine(app, backend, namespace=NAMESPACE, reconcile=False) as engine,
    ):
        print("ready", flush=True)
        buffer = b""
        while chunk := await stdin.receive_some():
            buffer += chunk
            while b"\n" in buffer:
                line, _, buffer = buffer.partition(b"\n")
                began = time.perf_counter()
                run_id = await engine.start("once", int(line), detach=True)
                assert await engine.result(run_id) == 2 * int(line)
                print(f"{(time.perf_counter() - began) * 1000:.3f}", flush=True)


def section(quick: bool) -> Figures:
    """The section's figures: SQLite and Redis (:func:`over_backends`), then PostgreSQL."""
    figures = over_backends("detached", _measure, quick)
    try:
        with private_postgres() as server:
            url = f"{server.url}?schema=bench_{uuid.uuid4().hex[:12]}"
            figures |= trio.run(_measure, url, 0, "postgres")
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        figures["detached postgres skipped"] = (float("nan"), f"no private PostgreSQL: {exc}")
    return figures


if __name__ == "__main__":
    trio.run(_starter, sys.argv[1])
