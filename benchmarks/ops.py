"""``make bench`` section "ops: list runs": ``ops.list_runs(limit=50)``, the first page and a
deep page (the last one, reached by its cursor) over 10,000 runs, on SQLite and on a private
Redis. Each figure is the median of N calls, measured around the call (the Redis figures
include the round trip to the loopback server)."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import durable_trio as dt

from .redis_server import RedisError, private_redis

Figures = dict[str, Any]

#: Calls per figure (the median is reported).
REPEAT = 25


async def _fill(store: Any, count: int) -> None:
    async def create(start: int) -> None:
        for n in range(start, count, 50):
            await store.create_run(
                dt.RunRecord(f"run-{n:06}", "order", {"n": n}, dt.RunStatus.COMPLETED, 0.0, 0.0)
            )

    async with trio.open_nursery() as nursery:
        for start in range(50):
            nursery.start_soon(create, start)


async def _median_ms(call: Any) -> float:
    times = []
    for _ in range(REPEAT):
        started = time.perf_counter()
        await call()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


async def _deepest_cursor(ops: dt.Operations, cursor: str | None) -> str | None:
    """Walk from ``cursor`` to the last page of 50: its cursor is the deepest one."""
    deep = cursor
    while cursor is not None:
        deep = cursor
        cursor = (await ops.list_runs(limit=50, cursor=cursor)).next_cursor
    return deep


def over_backends(name: str, measure: Any, quick: bool) -> Figures:
    """``measure(url, count, label)`` on a SQLite file and on a private Redis (``quick``: 2,000
    runs instead of 10,000); ``name`` labels the figure of a Redis that could not start."""
    count = 2_000 if quick else 10_000
    figures: Figures = {}
    with tempfile.TemporaryDirectory() as folder:
        url = "sqlite:///" + str(Path(folder) / "bench.db")
        figures |= trio.run(measure, url, count, "sqlite")
    try:
        with private_redis() as server:
            figures |= trio.run(measure, server.url, count, "redis")
    except RedisError as exc:
        figures[f"{name} redis skipped"] = (float("nan"), f"no redis-server: {exc}")
    return figures


async def _measure(url: str, count: int, label: str) -> Figures:
    async with (
        dt.open_backend(url) as backend,
        dt.open_operations(backend, namespace="bench") as ops,
    ):
        await _fill(ops.store, count)
        first = await ops.list_runs(limit=50)
        assert len(first.runs) == 50
        deep = await _deepest_cursor(ops, first.next_cursor)
        first_ms = await _median_ms(lambda: ops.list_runs(limit=50))
        deep_ms = await _median_ms(lambda: ops.list_runs(limit=50, cursor=deep))
    note = f"median of {REPEAT}, {count:,} runs"
    return {
        f"ops: list runs {label} first page (ms)": (first_ms, note),
        f"ops: list runs {label} deep page (ms)": (deep_ms, note),
    }


def section(quick: bool) -> Figures:
    """The section's figures (``quick``: 2,000 runs instead of 10,000)."""
    return over_backends("ops: list runs", _measure, quick)
