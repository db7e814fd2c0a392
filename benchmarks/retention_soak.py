"""Retention soak (issue 34): does a store's size stay flat while runs finish continuously?

On each run store (memory, a SQLite file, a private redis-server, a private PostgreSQL), one
engine and one worker in this process run 1-step workflows back to back (``CLIENTS`` callers,
each starting a run and awaiting its result, so runs finish as fast as they start), for
``seconds`` with ``retention`` on (``RETENTION`` s, pruned every ``INTERVAL`` s), then as long
with retention off, for contrast. The store's size is sampled at intervals and printed as it
goes:

* memory: runs held; SQLite: rows of its run tables (and the file's bytes); Redis: keys
  (``DBSIZE``, and ``used_memory`` bytes); PostgreSQL: rows of its run tables (and their bytes
  with indexes, ``pg_total_relation_size``: dead tuples are reclaimed by autovacuum, not at
  once, so bytes settle later than rows).

The verdict is on rows / keys / runs, past the warm-up (``RETENTION`` plus a prune's wait):
"flat" when the store holds at most 30 % of the runs that finished meanwhile (its growth over
the runs done, in rows per run: :func:`verdict`; about 100 % with retention off), "grows"
otherwise. Each series starts on an empty store.

    python -m benchmarks retention-soak            # the section (~25 s a store)
    python -m benchmarks.retention_soak --seconds 120 [memory sqlite redis postgres]
"""

from __future__ import annotations

import argparse
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

import durable_trio as dt
from durable_trio._engine import App, WorkflowContext, open_engine, open_run_store, open_worker

from .postgres_server import private_postgres
from .redis_server import RedisError, private_redis

if TYPE_CHECKING:
    from collections.abc import Callable

Figures = dict[str, Any]

#: Seconds a finished run is kept, and between two prunes (short: the soak is short).
RETENTION = 3.0
INTERVAL = 0.5
#: Callers starting runs back to back.
CLIENTS = 16
#: Samples per series.
SAMPLES = 8
#: The verdict's bar: at most this share of the runs finished past the warm-up still held.
FLAT = 0.3
#: Seconds per series (retention on, then off) unless told otherwise.
DEFAULT_SECONDS = 12.0
QUICK_SECONDS = 8.0

STORES = ("memory", "sqlite", "redis", "postgres")

app = App("retsoak")


@app.step("work")
async def work(n: int) -> int:
    return n


@app.workflow("order")
async def order(ctx: WorkflowContext, n: int) -> int:
    got: int = await ctx.step("work", n)
    await ctx.set_event("done", got)
    return got


_SQLITE_TABLES = ("dt_runs", "dt_steps", "dt_signals", "dt_events")
_PG_TABLES = ("runs", "run_steps", "run_signals", "run_events", "run_tags")


async def _size(kind: str, url: str, store: Any) -> tuple[int, int | None]:
    """``(rows / keys / runs, bytes or None)`` of the store now."""
    if kind == "sqlite":
        path = url.removeprefix("sqlite:///")

        def count() -> tuple[int, int]:
            with sqlite3.connect(path) as db:
                rows = sum(
                    db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
                    for table in _SQLITE_TABLES
                )
                pages = db.execute("PRAGMA page_count").fetchone()[0]
                size = db.execute("PRAGMA page_size").fetchone()[0]
            return rows, pages * size

        return await trio.to_thread.run_sync(count)
    if kind == "redis":
        keys = int(await store._client.execute("DBSIZE"))
        info = await store._client.execute("INFO", "memory")
        text = info.decode() if isinstance(info, bytes) else str(info)
        used = next(
            (
                int(line.split(":")[1])
                for line in text.splitlines()
                if line.startswith("used_memory:")
            ),
            None,
        )
        return keys, used
    if kind == "postgres":
        rows = 0
        size = 0
        for table in _PG_TABLES:
            counted = await store._fetch(
                f"SELECT count(*), pg_total_relation_size('{{schema}}.{table}')"
                f" FROM {{schema}}.{table}"
            )
            rows += int(counted[0][0])
            size += int(counted[0][1])
        return rows, size
    return sum((await store.count_runs()).values()), None


async def _series(
    kind: str, url: str, seconds: float, retention: float | None, label: str
) -> list[tuple[float, int, int | None, int]]:
    """One series: ``(elapsed, size, bytes, runs done)`` samples while runs finish."""
    samples: list[tuple[float, int, int | None, int]] = []
    done = 0
    options: dict[str, Any] = (
        {} if retention is None else {"retention": retention, "retention_interval": INTERVAL}
    )
    async with (
        dt.open_backend(url) as backend,
        open_run_store(backend, app.name) as store,
        open_worker(app, backend, concurrency=CLIENTS),
        open_engine(app, backend, store=store, **options) as engine,
    ):

        async def client(index: int) -> None:
            nonlocal done
            n = 0
            while True:
                run_id = await engine.start("order", n, run_id=f"{label}-{index}-{n}")
                await engine.result(run_id)
                done += 1
                n += 1

        async with trio.open_nursery() as nursery:
            for index in range(CLIENTS):
                nursery.start_soon(client, index)
            start = trio.current_time()
            for sample in range(1, SAMPLES + 1):
                await trio.sleep_until(start + seconds * sample / SAMPLES)
                size, used = await _size(kind, url, store)
                elapsed = trio.current_time() - start
                samples.append((elapsed, size, used, done))
                shown = f"  {used / 1024:>10,.0f} kB" if used is not None else ""
                kept = "off" if retention is None else f"{retention:g} s"
                print(
                    f"    {kind:<8} retention {kept:<5} t={elapsed:5.1f} s  runs done {done:>7,}"
                    f"  size {size:>8,}{shown}",
                    flush=True,
                )
            nursery.cancel_scope.cancel()
    return samples


#: When the store holds its steady state under retention: kept, then a prune's wait.
WARM = RETENTION + 1.5 * INTERVAL


def verdict(samples: list[tuple[float, int, int]]) -> tuple[str, float]:
    """``("flat" | "grows", kept)`` of ``(elapsed, size, runs done)`` samples.

    ``kept``: of the runs that finished past the warm-up (:data:`WARM`), the share the store
    still holds, as the growth of its size between the two halves of those samples (means, so
    a prune's sawtooth averages out) over that of the runs done, in the size one run takes (the
    first sample's size per run: taken before any prune). About 1 when everything is kept, about
    0 when the size is flat; independent of the rate of runs (a loaded machine's rate drifts).
    """
    _, first_size, first_done = samples[0]
    per_run = first_size / max(first_done, 1)
    steady = [(size, done) for elapsed, size, done in samples if elapsed >= WARM]
    if len(steady) < 2:
        steady = [(size, done) for _, size, done in samples]
    half = len(steady) // 2
    early, late = steady[:half], steady[half:]

    def mean(values: list[int]) -> float:
        return sum(values) / len(values)

    grown = mean([s for s, _ in late]) - mean([s for s, _ in early])
    finished = mean([d for _, d in late]) - mean([d for _, d in early])
    kept = grown / max(per_run * finished, 1.0)
    return ("flat" if kept <= FLAT else "grows"), kept


_UNITS = {"memory": "runs", "sqlite": "rows", "redis": "keys", "postgres": "rows"}


def _soak(kind: str, url: Callable[[str], str], seconds: float) -> Figures:
    """Both series on ``kind``: ``url(label)`` is an empty store for each."""
    figures: Figures = {}
    unit = _UNITS[kind]
    for retention in (RETENTION, None):
        label = "on" if retention is not None else "off"
        samples = trio.run(_series, kind, url(label), seconds, retention, label)
        sizes = [size for _, size, _, _ in samples]
        word, ratio = verdict([(elapsed, size, done) for elapsed, size, _, done in samples])
        runs = samples[-1][3]
        print(
            f"    {kind}: retention {label}: {word} ({unit} {sizes[0]:,} -> {sizes[-1]:,},"
            f" net growth {ratio:.0%} of the runs done past the warm-up,"
            f" {runs:,} runs in {samples[-1][0]:.0f} s)",
            flush=True,
        )
        key = f"retention soak {kind}, retention {label}"
        figures[f"{key}: {unit} at the end"] = (sizes[-1], word)
        figures[f"{key}: net growth per run done"] = (ratio, f"{word}: {runs:,} runs done")
        used = samples[-1][2]
        if used is not None:
            figures[f"{key}: kB at the end"] = (used / 1024, "")
    return figures


def run(stores: tuple[str, ...], seconds: float) -> Figures:
    """The soak on each of ``stores``, each server private and deleted after."""
    figures: Figures = {}
    with tempfile.TemporaryDirectory(prefix="dt-retsoak-") as tmp:
        for kind in stores:
            if kind == "memory":
                figures.update(_soak(kind, lambda label: "memory://", seconds))
            elif kind == "sqlite":

                def sqlite(label: str) -> str:
                    path = Path(tmp) / f"runs-{label}.db"
                    return f"sqlite:///{path}".replace("///", "////", 1)

                figures.update(_soak(kind, sqlite, seconds))
            elif kind == "redis":
                try:
                    with private_redis() as server:

                        def redis(label: str) -> str:
                            server.flushall()  # (DBSIZE counts every key of the server)
                            return server.url

                        figures.update(_soak(kind, redis, seconds))
                except (RedisError, OSError, RuntimeError) as exc:
                    figures["retention soak redis skipped"] = (float("nan"), str(exc))
            elif kind == "postgres":
                try:
                    with private_postgres() as pg_server:
                        figures.update(
                            _soak(
                                kind, lambda label: f"{pg_server.url}?schema=soak_{label}", seconds
                            )
                        )
                except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                    figures["retention soak postgres skipped"] = (float("nan"), str(exc))
    return figures


def section(quick: bool) -> Figures:
    """``python -m benchmarks retention-soak``: every store, the default duration."""
    return run(STORES, QUICK_SECONDS if quick else DEFAULT_SECONDS)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.retention_soak")
    parser.add_argument(
        "--seconds", type=float, default=DEFAULT_SECONDS, help="seconds per series (per store: 2x)"
    )
    parser.add_argument("stores", nargs="*", help=f"of {list(STORES)} (default: all)")
    args = parser.parse_args()
    unknown = set(args.stores) - set(STORES)
    if unknown:
        parser.error(f"unknown stores: {sorted(unknown)}")
    started = time.perf_counter()
    result = run(tuple(args.stores) or STORES, args.seconds)
    width = max(map(len, result), default=10)
    for name, value in result.items():
        number, note = value if isinstance(value, tuple) else (value, "")
        print(f"  {name:<{width}}  {float(number):>14,.2f}  {note}")
    print(f"  ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
