"""The app ``durable-trio worker benchmarks/_bench_app.py:app`` serves in the S1 drain with
``--processes`` (``benchmarks/processes.py``): one no-op step, ``noop-0``, as
``benchmarks/_redis_worker.py`` serves it, and ``cpu-1ms``, whose body first keeps the CPU busy
for one millisecond of the thread's CPU time (a CPU-heavy step, blocking the loop as pure-Python
work does). With ``$BENCH_DONE_PORT`` set, each body ends by sending its step id to
127.0.0.1:BENCH_DONE_PORT (the "done signal" the peers' S1 counts)."""

from __future__ import annotations

import os
import time

import trio

import durable_trio as dt

app = dt.App("bench")
_PORT = int(os.environ.get("BENCH_DONE_PORT", "0"))
_udp: list[trio.socket.SocketType] = []


async def _signal_done() -> None:
    if _PORT:
        if not _udp:
            _udp.append(trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM))
        await _udp[0].sendto(dt.step_info().step_id.encode(), ("127.0.0.1", _PORT))


@app.step("noop-0")
async def noop(_: object) -> None:
    await _signal_done()


@app.step("cpu-1ms")
async def cpu_1ms(_: object) -> None:
    end = time.thread_time() + 0.001
    while time.thread_time() < end:
        pass
    await _signal_done()
