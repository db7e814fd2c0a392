"""``make bench`` section "signals": signal -> wake latency of a waiting workflow (issue 18),
on SQLite and on a private Redis: the time from ``engine.signal`` (through the engine that
drives the run: its bell wakes the wait) or ``Operations.signal_run`` (another process's path:
a run store of its own, whose ring reaches the waiting driver's store as it would from another
process: a datagram in ``<file>.wakes/`` on SQLite, a ``PUBLISH`` on Redis; before the wakes,
the waiting driver's 1 s store poll found it) until the ``ctx.wait_signal`` returns in the
workflow (its checkpoint written). Median of N signals, one run waiting on each in turn."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from typing import Any

import trio

import durable_trio as dt

from .ops import over_backends

Figures = dict[str, Any]

#: Signals per figure through the engine, and through another run store.
ENGINE_SIGNALS = 50
STORE_SIGNALS = 50

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


async def _from_another_process(url: str, run_id: str, count: int) -> list[float]:
    """Latencies of signals sent by a process of its own (``python -m benchmarks.signals``):
    it sends one per line it reads and prints when it sent it (``time.perf_counter`` is the
    system's monotonic clock, the same in both processes)."""
    out = []
    sender = await trio.lowlevel.open_process(
        [sys.executable, "-m", "benchmarks.signals", url, run_id],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert sender.stdin is not None
        assert sender.stdout is not None
        lines = _Lines(sender.stdout)
        assert await lines.next() == "ready"
        for _ in range(count):
            woken = trio.Event()
            WAKES.append(woken)
            await trio.sleep(0.01)  # the run waits again
            await sender.stdin.send_all(b"go\n")
            sent = float(await lines.next())
            await woken.wait()
            out.append((WOKE[-1] - sent) * 1000)
        await sender.stdin.aclose()
        with trio.fail_after(30):
            await sender.wait()
    finally:
        sender.kill()
    return out


class _Lines:
    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream, self._buffer = stream, b""

    async def next(self) -> str:
        while b"\n" not in self._buffer:
            chunk = await self._stream.receive_some()
            if not chunk:
                raise EOFError("the signalling process ended")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()


async def _sender(url: str, run_id: str) -> None:
    """The other process: one signal per line read, printing when it was sent."""
    stdin = trio.lowlevel.FdStream(0)
    async with (
        dt.open_backend(url) as backend,
        dt.open_operations(backend, namespace="bench-signals") as ops,
    ):
        print("ready", flush=True)
        buffer = b""
        while chunk := await stdin.receive_some():
            buffer += chunk
            while b"\n" in buffer:
                _, _, buffer = buffer.partition(b"\n")
                sent = time.perf_counter()
                await ops.signal_run(run_id, "go", None)
                print(repr(sent), flush=True)


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
        third = await engine.start("waiter", STORE_SIGNALS)
        via_process = await _from_another_process(url, third, STORE_SIGNALS)
        await engine.result(third)
    return {
        f"signals: {label} wake via the engine (ms)": (
            statistics.median(via_engine),
            f"median of {ENGINE_SIGNALS}",
        ),
        f"signals: {label} wake via another store's ring (ms)": (
            statistics.median(via_store),
            f"median of {STORE_SIGNALS} (the poll, every 1 s, is the safety net)",
        ),
        f"signals: {label} wake from another process (ms)": (
            statistics.median(via_process),
            f"median of {STORE_SIGNALS}; p90 {statistics.quantiles(via_process, n=10)[-1]:.2f}",
        ),
    }


def section(quick: bool) -> Figures:
    """The section's figures."""
    return over_backends("signals", _measure, quick)


if __name__ == "__main__":
    trio.run(_sender, sys.argv[1], sys.argv[2])
