"""The PostgreSQL backend against the PostgreSQL peers, on one private server (issue 32).

Everything runs on the same private server (``postgres_server.py``: ``fsync=off`` and
``synchronous_commit=off`` for every column alike), ours in fresh schemas, each peer in a
database of its own:

* S1, as issue 32 defines it and pgqueuer's runner (``peers/run_pgqueuer.py``) times it: 10,000
  no-op jobs queued, ONE worker process spawned at concurrency 10, the worker's spawn -> its
  last body run, its start-up (interpreter, imports, connecting) counted
  (``redis.drain_timed``, the same code as on Redis and SQLite; the note also gives the rate
  from the worker's start, as the Redis peers' S1 is timed);
* S3: one job at a time 2 ms after the last, enqueue -> body ran, p50 / p99 (``redis.latency``);
* an idle worker: the server's committed transactions per second (``pg_stat_database``) while
  only one idle worker process is connected, over ``window`` seconds;
* the engine: 3-step workflows, one at a time (ms each) and 300 at once (workflows/s), with
  ``benchmarks/engine.py``'s app and topology, twice: three local steps (``ctx.run``, run and
  checkpointed in the workflow's own process, as DBOS runs its ``@DBOS.step``: the like-for-like
  line) and three remote steps (``ctx.step``: each through the queue to a worker, with a lease,
  which DBOS's steps never leave the process for); DBOS 3.4 the same workflow
  (``peers/run_dbos.py``);
* table health: a sustained stream (push, work, delete) for ``soak`` seconds; the jobs table's
  and its indexes' sizes sampled: flat when finished jobs leave the hot table and autovacuum
  keeps up.

Run alone: ``python -m benchmarks.postgres_queue [--quick]``, or as the ``postgres-queue``
section of ``python -m benchmarks``.
"""

from __future__ import annotations

import contextlib
import operator
import statistics
import subprocess
import sys
import time
import uuid
from functools import partial
from typing import TYPE_CHECKING, Any

import trio
from trio_util import AsyncValue

import durable_trio as dt
from durable_trio._engine import open_engine, open_worker

from . import redis as queue_bench
from .engine import app as engine_app
from .peers.postgres import run_postgres_peers
from .postgres_server import PostgresServer, private_postgres

if TYPE_CHECKING:
    from collections.abc import Iterator

Figures = dict[str, Any]


def _url(server: PostgresServer) -> str:
    return f"{server.url}?schema=b_{uuid.uuid4().hex[:12]}"


def _commits(server: PostgresServer) -> int:
    rows = server.sql("SELECT sum(xact_commit)::bigint FROM pg_stat_database")
    return int(rows[0][0])


@contextlib.contextmanager
def quiet_server(server: PostgresServer) -> Iterator[None]:
    """Autovacuum off for the block (its own transactions would count as the client's), then
    back on."""
    server.sql("ALTER SYSTEM SET autovacuum = off")
    server.sql("SELECT pg_reload_conf()")
    try:
        yield
    finally:
        server.sql("ALTER SYSTEM RESET autovacuum")
        server.sql("SELECT pg_reload_conf()")


async def _idle_rate(server: PostgresServer, window: float) -> float:
    """Transactions/s of the whole server while one idle worker process is its only client
    (autovacuum off meanwhile: :func:`quiet_server`)."""
    url = _url(server)
    async with dt.open_backend(url):
        pass  # the tables exist before the worker starts (its first open migrates nothing)
    worker = await trio.to_thread.run_sync(queue_bench._spawn, url, "idle", 10, 1)
    try:
        assert worker.stdout is not None
        while (line := await trio.to_thread.run_sync(worker.stdout.readline)).strip() != b"ready":
            assert line, "the worker died"
        with quiet_server(server):
            await trio.sleep(15.0)  # settled: its first pops, LISTENs and keys, autovacuum done
            await trio.to_thread.run_sync(server.sql, "SELECT pg_stat_force_next_flush()")
            before = await trio.to_thread.run_sync(_commits, server)
            await trio.sleep(window)
            after = await trio.to_thread.run_sync(_commits, server)
    finally:
        queue_bench._stop(worker)
    # (the two reads of pg_stat_database and the flush are transactions too)
    return max(0, after - before - 2) / window


async def _engine(
    url: str, *, sequential: int, concurrent: int, workflow: str = "three"
) -> tuple[float, float]:
    """(ms per 3-step workflow one at a time, workflows/s with ``concurrent`` at once);
    ``workflow``: ``"three"`` (remote steps) or ``"three_local"`` (``ctx.run``)."""
    namespace = f"bench-engine-{uuid.uuid4().hex[:6]}"
    async with (
        dt.open_backend(url) as backend,
        open_worker(engine_app, backend, namespace=namespace, concurrency=32),
        open_engine(engine_app, backend, namespace=namespace) as engine,
    ):
        await engine.result(await engine.start(workflow, 0))
        start = time.perf_counter()
        for n in range(sequential):
            assert await engine.result(await engine.start(workflow, n)) == n
        one = (time.perf_counter() - start) / sequential * 1000

        async def run_one(n: int) -> None:
            assert await engine.result(await engine.start(workflow, n)) == n

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for n in range(concurrent):
                nursery.start_soon(run_one, n)
        return one, concurrent / (time.perf_counter() - start)


def _sizes(server: PostgresServer, schema: str) -> tuple[int, int]:
    rows = server.sql(
        f"SELECT pg_table_size('\"{schema}\".broker_jobs'), "
        f"pg_indexes_size('\"{schema}\".broker_jobs')"
    )
    return int(rows[0][0]), int(rows[0][1])


async def _soak(server: PostgresServer, seconds: float) -> dict[str, tuple[float, str]]:
    """A steady stream through one worker for ``seconds``: the jobs table's sizes over time."""
    schema = f"soak_{uuid.uuid4().hex[:10]}"
    url = f"{server.url}?schema={schema}"
    samples: list[tuple[int, int]] = []
    done = AsyncValue(0)
    async with dt.open_backend(url) as backend:
        async with dt.open_queue_transport(backend, namespace="soak") as producer:

            async def on_result(result: dt.StepResult) -> None:
                done.value += 1

            producer.on_result(on_result)
            worker = await trio.to_thread.run_sync(queue_bench._spawn, url, "soak", 10, 1)
            try:
                assert worker.stdout is not None
                while (
                    line := await trio.to_thread.run_sync(worker.stdout.readline)
                ).strip() != b"ready":
                    assert line, "the worker died"
                end = trio.current_time() + seconds
                n = 0
                next_sample = trio.current_time()
                while trio.current_time() < end:
                    tasks = [queue_bench._task(n + k) for k in range(50)]
                    n += len(tasks)
                    await producer.dispatch_many(tasks)
                    # A steady backlog, not an ever-growing one.
                    await done.wait_value(partial(operator.le, n - 500))
                    if trio.current_time() >= next_sample:
                        samples.append(await trio.to_thread.run_sync(_sizes, server, schema))
                        next_sample += seconds / 12
                with trio.fail_after(60):
                    await done.wait_value(partial(operator.le, n))
            finally:
                queue_bench._stop(worker)
    half = len(samples) // 2
    early = max(sum(sample) for sample in samples[1:half]) / 1024
    late = max(sum(sample) for sample in samples[half:]) / 1024
    return {
        "postgres soak: jobs through the hot table": (float(done.value), f"in {seconds:.0f} s"),
        "postgres soak: jobs table + indexes, peak of the first half (kB)": (early, ""),
        "postgres soak: jobs table + indexes, peak of the second half (kB)": (
            late,
            "flat when finished jobs leave the table and autovacuum keeps up",
        ),
    }


#: Its S1 line's name: its own (the redis section's S1 "as the peers" is another figure).
S1_KEY = "durable_trio on PostgreSQL: S1 spawn -> last body, concurrency 10 (jobs/s)"


async def _ours(server: PostgresServer, quick: bool) -> Figures:
    runs = 1 if quick else 3
    jobs = 2_000 if quick else 10_000
    figures: Figures = {}
    s1 = [
        await queue_bench.drain_timed(_url(server), jobs=jobs, concurrency=10) for _ in range(runs)
    ]
    figures[S1_KEY] = (
        statistics.median(r.from_spawn for r in s1),
        "runs "
        + " / ".join(f"{r.from_spawn:,.0f}" for r in s1)
        + f"; from the worker's start {statistics.median(r.rate for r in s1):,.0f} jobs/s"
        + f"; spawn -> first body {statistics.median(r.first for r in s1) * 1000:,.0f} ms"
        + f"; worker CPU {statistics.median(r.cpu_us for r in s1):,.0f} us/job",
    )
    samples = 100 if quick else 300
    s3 = [await queue_bench.latency(_url(server), samples=samples) for _ in range(runs)]
    figures["durable_trio S3 p50 (ms)"] = (statistics.median(r[0] for r in s3), "enqueue -> body")
    figures["durable_trio S3 p99 (ms)"] = (statistics.median(r[1] for r in s3), "")
    figures["durable_trio idle worker (queries/s)"] = (
        await _idle_rate(server, 5.0 if quick else 30.0),
        "the server's committed transactions/s, one idle worker its only client",
    )
    at_once = 100 if quick else 300
    for workflow, label in (("three_local", "3 local steps"), ("three", "3-step")):
        engine = [
            await _engine(
                _url(server),
                sequential=20 if quick else 100,
                concurrent=at_once,
                workflow=workflow,
            )
            for _ in range(runs)
        ]
        what = (
            "ctx.run, in the workflow's process as DBOS's steps"
            if workflow == "three_local"
            else "ctx.step, each through the queue to a worker"
        )
        figures[f"durable_trio engine: {label} workflow one at a time (ms)"] = (
            statistics.median(e[0] for e in engine),
            what,
        )
        figures[f"durable_trio engine: {label} workflows at once (workflows/s)"] = (
            statistics.median(e[1] for e in engine),
            f"{at_once} at once; runs " + " / ".join(f"{e[1]:,.0f}" for e in engine),
        )
    figures.update(await _soak(server, 10.0 if quick else 60.0))
    return figures


def run(server: PostgresServer, quick: bool) -> Figures:
    """Ours, then the peers, on ``server``."""
    figures: Figures = trio.run(_ours, server, quick)
    for row in run_postgres_peers(server.url, quick=quick, quiet=partial(quiet_server, server)):
        key = f"{row['peer']} {row['scenario']} {row['metric']} ({row['unit'] or '-'})"
        figures[key] = (float("nan") if row["value"] is None else row["value"], row["note"])
    return figures


def section(quick: bool) -> Figures:
    """``python -m benchmarks postgres-queue``: :func:`run` on a private server."""
    try:
        with private_postgres() as server:
            print(f"  (private PostgreSQL on {server.url})")
            return run(server, quick)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return {"postgres-queue section skipped": (float("nan"), f"no private PostgreSQL: {exc}")}


if __name__ == "__main__":
    started = time.perf_counter()
    result = section("--quick" in sys.argv)
    width = max(map(len, result), default=10)
    for name, value in result.items():
        number, note = value if isinstance(value, tuple) else (value, "")
        print(f"  {name:<{width}}  {float(number):>14,.2f}  {note}")
    print(f"  ({time.perf_counter() - started:.1f} s)")
