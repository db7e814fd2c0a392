# mypy: ignore-errors
"""pgqueuer on PostgreSQL, run with pgqueuer's own venv python (issue 32's peer).

Standard library + pgqueuer (and its asyncpg) only. One JSON line out, as the Redis peers'
runners print (``benchmarks/peers/README.md``). Scenarios, on a fresh database each:

* ``S1``: ``--jobs`` no-op jobs enqueued in bulk, then ONE worker process spawned (entrypoint
  ``concurrency_limit=--concurrency``, pgqueuer's default batch size); the figure is jobs/s from
  the spawn to the last body run (each body appends its number and ``time.monotonic()`` to a
  file).
* ``S3``: an idle worker; one job at a time, 2 ms after the last body ran; the figure is the p50
  and p99 of enqueue -> body ran (the body sends its time over UDP).
* ``S4``: an idle worker; the figure is its transactions per second (``pg_stat_database
  .xact_commit`` of the database over ``--window`` seconds, minus the two reads).
"""

# ruff: noqa: ASYNC240  (tiny local marker files, read while the peer measures nothing)
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

_PROBE = struct.Struct("<qd")


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--postgres", required=True, help="an admin URL (a database is made)")
    parser.add_argument("--scenario", choices=("S1", "S3", "S4"), required=True)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--role", default="producer")
    parser.add_argument("--database", default="")
    parser.add_argument("--done-file", default="")
    parser.add_argument("--probe-port", type=int, default=0)
    parser.add_argument("--ready-file", default="")
    return parser.parse_args()


def _with_database(url: str, name: str) -> str:
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}"


# -- the worker -------------------------------------------------------------------------------


async def _worker(args: argparse.Namespace) -> None:
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries, QueueManager

    conn = await asyncpg.connect(_with_database(args.postgres, args.database))
    manager = QueueManager(Queries(AsyncpgDriver(conn)))
    done = os.open(args.done_file, os.O_WRONLY | os.O_APPEND) if args.done_file else None
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM) if args.probe_port else None

    @manager.entrypoint("noop", concurrency_limit=args.concurrency)
    async def noop(job: Any) -> None:
        n = int(job.payload or b"0")
        record = _PROBE.pack(n, time.monotonic())
        if done is not None:
            os.write(done, record)
        if probe is not None:
            probe.sendto(record, ("127.0.0.1", args.probe_port))

    if args.ready_file:
        Path(args.ready_file).write_text("ready")
    await manager.run()


# -- the producer -----------------------------------------------------------------------------


def _spawn(args: argparse.Namespace, database: str, **extra: Any) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable, __file__, "--role", "worker", "--postgres", args.postgres,
        "--scenario", args.scenario, "--database", database,
        "--concurrency", str(args.concurrency),
    ]  # fmt: skip
    for key, value in extra.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop(worker: subprocess.Popen[bytes]) -> None:
    worker.kill()
    worker.wait()


async def _wait_file(path: str, deadline: float) -> None:
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the worker did not start")
        await asyncio.sleep(0.01)


async def _producer(args: argparse.Namespace) -> dict[str, Any]:
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries

    database = f"pgq_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(args.postgres)
    await admin.execute(f'CREATE DATABASE "{database}"')
    conn = await asyncpg.connect(_with_database(args.postgres, database))
    queries = Queries(AsyncpgDriver(conn))
    await queries.install()
    folder = tempfile.mkdtemp()
    results: list[dict[str, Any]] = []
    try:
        if args.scenario == "S1":
            jobs = args.jobs
            for start in range(0, jobs, 1000):
                batch = list(range(start, min(jobs, start + 1000)))
                await queries.enqueue(
                    ["noop"] * len(batch), [str(n).encode() for n in batch], [0] * len(batch)
                )
            done_file = os.path.join(folder, "done")
            Path(done_file).touch()
            spawned = time.monotonic()
            worker = _spawn(args, database, done_file=done_file)
            try:
                deadline = spawned + 120
                while os.path.getsize(done_file) < jobs * _PROBE.size:
                    if time.monotonic() > deadline or worker.poll() is not None:
                        raise TimeoutError("S1 did not finish")
                    await asyncio.sleep(0.02)
            finally:
                _stop(worker)
            data = Path(done_file).read_bytes()
            last = max(_PROBE.unpack_from(data, i)[1] for i in range(0, len(data), _PROBE.size))
            results.append(
                {"metric": "drain", "value": jobs / (last - spawned), "unit": "jobs/s",
                 "note": f"{jobs} jobs, spawn -> last body, concurrency {args.concurrency}"}
            )  # fmt: skip
        elif args.scenario == "S3":
            probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            probe.bind(("127.0.0.1", 0))
            probe.setblocking(False)
            ready = os.path.join(folder, "ready")
            worker = _spawn(args, database, probe_port=probe.getsockname()[1], ready_file=ready)
            loop = asyncio.get_running_loop()
            latencies: list[float] = []
            try:
                await _wait_file(ready, time.monotonic() + 60)
                await asyncio.sleep(1.0)  # its first dequeue and LISTEN
                for n in range(args.samples + args.warmup):
                    await asyncio.sleep(0.002)
                    start = time.monotonic()
                    await queries.enqueue("noop", str(n).encode())
                    while True:
                        data = await asyncio.wait_for(loop.sock_recv(probe, 64), 10)
                        got, at = _PROBE.unpack(data)
                        if got == n:
                            break
                    if n >= args.warmup:
                        latencies.append((at - start) * 1000)
            finally:
                _stop(worker)
            cuts = statistics.quantiles(latencies, n=100)
            results.append({"metric": "p50", "value": cuts[49], "unit": "ms", "note": ""})
            results.append({"metric": "p99", "value": cuts[98], "unit": "ms", "note": ""})
        else:
            ready = os.path.join(folder, "ready")
            worker = _spawn(args, database, ready_file=ready)
            try:
                await _wait_file(ready, time.monotonic() + 60)
                await asyncio.sleep(3.0)  # settled
                sql = "SELECT xact_commit FROM pg_stat_database WHERE datname = $1"
                before = await admin.fetchval(sql, database)
                await asyncio.sleep(args.window)
                await admin.execute("SELECT pg_stat_clear_snapshot()")
                after = await admin.fetchval(sql, database)
            finally:
                _stop(worker)
            results.append(
                {"metric": "idle", "value": max(0, after - before) / args.window,
                 "unit": "queries/s", "note": "an idle worker: transactions/s of its database"}
            )  # fmt: skip
    finally:
        await conn.close()
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await admin.close()
    return {"results": results}


def main() -> None:
    args = _args()
    if args.role == "worker":
        asyncio.run(_worker(args))
        return
    import pgqueuer

    out: dict[str, Any] = {"peer": "pgqueuer", "version": pgqueuer.__version__,
                           "scenario": args.scenario}  # fmt: skip
    try:
        out.update(asyncio.run(_producer(args)))
    except Exception as exc:  # one JSON line whatever happens
        out["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
