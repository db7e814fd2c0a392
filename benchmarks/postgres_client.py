"""Our PostgreSQL driver against psycopg's own asyncio connection, on one private server (issue 32).

The same work for each column: ``CONNECTIONS`` connections, one task per connection, each task
running ``SELECT $1::int`` round trips (a fresh parameter each, checked) until the total is
done; the figure is round trips per second, the best of ``ROUNDS`` turns (the columns take
turns). Columns:

* ours under ``trio.run``: one :func:`~durable_trio._postgres._pool.open_pool` of
  ``CONNECTIONS``, each task holding one connection (``pool.connection()``);
* ours, through the pool per call: ``4 * CONNECTIONS`` tasks calling ``pool.fetchval`` (a
  connection taken and given back per round trip, as the broker and stores will);
* psycopg's ``AsyncConnection`` under ``asyncio.run`` (in a subprocess), with its defaults
  (``prepare_threshold=5``: the statement is prepared on the server after five runs), and again
  with ``prepare_threshold=None`` (unprepared, as ours);
* ours again, with psycopg's pure-Python libpq binding (``PSYCOPG_IMPL=python``, the system's
  libpq) instead of ``psycopg[binary]`` (in a subprocess): what the extra's choice is worth.

Run it alone with ``python -m benchmarks.postgres_client [--quick]``, or as the ``postgres``
section of ``python -m benchmarks``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import trio

from durable_trio._postgres._pool import open_pool

from .postgres_server import private_postgres

if TYPE_CHECKING:
    from collections.abc import Callable

Figures = dict[str, Any]

CONNECTIONS = 8
ROUNDS = 3


async def _ours_held(url: str, total: int) -> float:
    async with open_pool(url, size=CONNECTIONS) as pool:
        share = total // CONNECTIONS

        async def worker(base: int) -> None:
            async with pool.connection() as conn:
                for n in range(base, base + share):
                    if await conn.fetchval("SELECT $1::int", n) != n:
                        raise AssertionError("wrong answer")

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for k in range(CONNECTIONS):
                nursery.start_soon(worker, k * share)
        return share * CONNECTIONS / (time.perf_counter() - start)


async def _ours_per_call(url: str, total: int) -> float:
    async with open_pool(url, size=CONNECTIONS) as pool:
        tasks = 4 * CONNECTIONS
        share = total // tasks
        for _ in range(CONNECTIONS):  # open them all before the clock starts
            await pool.execute("SELECT 1")

        async def worker(base: int) -> None:
            for n in range(base, base + share):
                if await pool.fetchval("SELECT $1::int", n) != n:
                    raise AssertionError("wrong answer")

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for k in range(tasks):
                nursery.start_soon(worker, k * share)
        return share * tasks / (time.perf_counter() - start)


async def _psycopg_asyncio(url: str, total: int, prepare: bool) -> float:
    import psycopg

    threshold = 5 if prepare else None
    conns = [
        await psycopg.AsyncConnection.connect(url, autocommit=True, prepare_threshold=threshold)
        for _ in range(CONNECTIONS)
    ]
    share = total // CONNECTIONS

    async def worker(conn: psycopg.AsyncConnection[Any], base: int) -> None:
        for n in range(base, base + share):
            cursor = await conn.execute("SELECT %s::int", (n,))
            row = await cursor.fetchone()
            if row is None or row[0] != n:
                raise AssertionError("wrong answer")

    try:
        start = time.perf_counter()
        await asyncio.gather(*(worker(conn, k * share) for k, conn in enumerate(conns)))
        return share * CONNECTIONS / (time.perf_counter() - start)
    finally:
        for conn in conns:
            await conn.close()


def _child(kind: str, url: str, total: int) -> float:
    """Run one column in a subprocess (its own event loop, or its own psycopg binding)."""
    env = dict(os.environ)
    if kind == "pure":
        env["PSYCOPG_IMPL"] = "python"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.postgres_client", "--child", kind, url, str(total)],
        capture_output=True, text=True, timeout=600, check=True, env=env,
    )  # fmt: skip
    return float(json.loads(done.stdout.strip().splitlines()[-1])["rate"])


def run(url: str, quick: bool) -> Figures:
    """Every column on the server at ``url``, ``ROUNDS`` turns each, the best kept."""
    total = 4_000 if quick else 40_000
    best: dict[str, float] = {}
    columns: dict[str, Callable[[], float]] = {
        "ours (trio), a held connection per task": lambda: trio.run(_ours_held, url, total),
        "ours (trio), the pool per call, 32 tasks": lambda: trio.run(_ours_per_call, url, total),
        "psycopg AsyncConnection (asyncio), defaults": lambda: _child("prepared", url, total),
        "psycopg AsyncConnection (asyncio), unprepared": lambda: _child("asyncio", url, total),
        "ours, pure-Python psycopg binding": lambda: _child("pure", url, total),
    }
    for _ in range(ROUNDS):
        for name, column in columns.items():
            best[name] = max(best.get(name, 0.0), column())
    figures: Figures = {f"{name}: SELECT $1 round trips/s": rate for name, rate in best.items()}
    ours = best["ours (trio), a held connection per task"]
    theirs = best["psycopg AsyncConnection (asyncio), defaults"]
    figures["ours / psycopg asyncio (defaults)"] = (ours / theirs, f"{CONNECTIONS} connections")
    return figures


def section(quick: bool) -> Figures:
    """``python -m benchmarks postgres``: :func:`run` on a private server."""
    try:
        with private_postgres() as server:
            print(f"  (private PostgreSQL on {server.url})")
            return run(server.url, quick)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return {"postgres section skipped": (float("nan"), f"no private PostgreSQL: {exc}")}


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.postgres_client",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="smaller runs (a smoke test)")
    parser.add_argument(
        "--child", nargs=3, metavar=("KIND", "URL", "TOTAL"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        kind, url, total = args.child[0], args.child[1], int(args.child[2])
        if kind == "pure":
            rate = trio.run(_ours_held, url, total)
        else:
            rate = asyncio.run(_psycopg_asyncio(url, total, prepare=kind == "prepared"))
        print(json.dumps({"rate": rate}))
        return 0
    print(
        f"PostgreSQL clients — Python {platform.python_version()}, {platform.machine()}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}{' (quick)' if args.quick else ''}"
    )
    start = time.perf_counter()
    figures = section(args.quick)
    width = max(map(len, figures), default=10)
    for key, value in figures.items():
        number, note = value if isinstance(value, tuple) else (value, "")
        print(f"  {key:<{width}}  {float(number):>14,.2f}  {note}")
    print(f"  ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
