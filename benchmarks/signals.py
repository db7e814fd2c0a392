"""``make bench`` section "signals": signal -> wake latency of a waiting workflow (issue 18),
on SQLite and on a private Redis: the time from ``engine.signal`` (through the engine that
drives the run: its bell wakes the wait) or ``Operations.signal_run`` (another process's path:
the waiting driver's store poll finds it) until the ``ctx.wait_signal`` returns in the workflow
(its checkpoint written). Median of N signals, one run waiting on each in turn."""

from __future__ import annotations

import statistics
import time
from typing import Any

import trio

import durable_trio as dt

from .ops import over_backends

Figures = dict[str, Any]

#: Signals per figure through the engine, and through the store (the poll path is slower).
ENGINE_SIGNALS = 50
STORE_SIGNALS = 6

WOKE: list[float] = []
WAKES: list[trio.Event] = []

app = dt.App("bench-signals")


@app.workflow("waiter")
async def waiter(ctx: dt.WorkflowContext, count: int) -> int:
    for _ in range(count):
        await ctx.wait_signal("go")
        WOKE.append(time.perf_counter())  # (a benchmark: not replay-safe on purpose)
        if WAKES:
            WAKES[-1].set()
    return count


async def _latencies(signal: Any, run_id: str, count: int) -> list[float]:
    out = []
    for _ in range(count):
        woken = trio.Event()
        WAKES.append(woken)
        await trio.sleep(0.01)  # the run waits again
        sent = time.perf_counter()
        await signal(run_id, "go", None)
        await woken.wait()
        out.append((WOKE[-1] - sent) * 1000)
    return out


async def _measure(url: str, count: int, label: str) -> Figures:
    del count
    async with (
        dt.open_backend(url) as backend,
        dt.open_engine(app, backend, namespace="bench-signals") as engine,
        dt.open_operations(backend, namespace="bench-signals") as ops,
    ):
        first = await engine.start("waiter", ENGINE_SIGNALS)
        via_engine = await _latencies(engine.signal, first, ENGINE_SIGNALS)
        await engine.result(first)
        second = await engine.start("waiter", STORE_SIGNALS)
        via_store = await _latencies(ops.signal_run, second, STORE_SIGNALS)
        await engine.result(second)
    return {
        f"signals: {label} wake via the engine (ms)": (
            statistics.median(via_engine),
            f"median of {ENGINE_SIGNALS}",
        ),
        f"signals: {label} wake via the store poll (ms)": (
            statistics.median(via_store),
            f"median of {STORE_SIGNALS}, poll every 1 s",
        ),
    }


def section(quick: bool) -> Figures:
    """The section's figures."""
    return over_backends("signals", _measure, quick)
