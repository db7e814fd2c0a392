"""``make bench``: every benchmark section, one report, with the issues' targets checked.

Sections: ``memory`` (the transport on the memory broker), ``adaptive`` (adaptive concurrency
against fixed limits), ``engine`` (3-step workflows against raw round trips), ``redis`` (the race:
ours and the peers', on one private redis-server, in the same run), ``redis-clients`` (our Redis
client against redis-py, when redis-py is on ``PYTHONPATH``: see benchmarks/redis_clients.py),
``redis-cpu`` (our Redis client's CPU per command beside ioredis's, 1 and 10 callers on one
connection, issue 35: benchmarks/redis_cpu.py),
``postgres`` (our PostgreSQL driver against psycopg's asyncio connection, on a private server:
benchmarks/postgres_client.py),
``redis-cluster`` (S1 drain and 3-step workflows on a private 3-master Redis Cluster beside one
node, and the scaling with one worker process per master, issue 17), ``sqlite`` (the embedded
default), ``simulation`` (a seeded day of production with faults, issue 9), ``soak`` (memory of
one worker over a million steps and of an engine over 100,000 runs, issue 13; several minutes),
``detached`` (start -> result of a run started detached by another process, issue 30),
``limits`` (S1 with a fleet-wide step limit against without, on Redis and SQLite, issue 33),
``startup`` (``import durable_trio`` beside ``import trio``, a worker's spawn -> first job done,
issue 35),
``drains`` (S1 beside BullMQ with a body: one RPUSH, or one byte appended to a file, issue 35:
benchmarks/drains.py), ``retention-soak`` (each run store's size while runs finish
continuously, with retention on and off, issue 34: benchmarks/retention_soak.py).
``--quick`` runs smaller versions of each (a smoke test; the peers then run once each).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from . import (
    adaptive,
    console,
    detached,
    drains,
    engine,
    limits,
    memory,
    ops,
    postgres_client,
    postgres_queue,
    redis_clients,
    redis_cluster,
    redis_cpu,
    replicas,
    retention_soak,
    signals,
    simulation,
    soak,
    startup,
)
from . import redis as ours_on_redis
from .redis_server import RedisError, private_redis, redis_version

if TYPE_CHECKING:
    from collections.abc import Callable

Figures = dict[str, Any]


def _memory(quick: bool) -> Figures:
    return trio.run(memory.run, quick)


def _adaptive(quick: bool) -> Figures:
    return adaptive.run()


def _engine(quick: bool) -> Figures:
    return trio.run(engine.run, quick)


def _simulation(quick: bool) -> Figures:
    return {f"simulation {key}": value for key, value in simulation.run(quick).items()}


def _sqlite(quick: bool) -> Figures:
    with tempfile.TemporaryDirectory() as folder:
        url = "sqlite:///" + str(Path(folder) / "bench.db")
        figures = trio.run(lambda: ours_on_redis.run(url, quick, redis=False))
    return {f"sqlite {key}": value for key, value in figures.items()}


def _redis(quick: bool) -> Figures:
    from .peers import run_peers

    try:
        with private_redis() as server:
            print(f"  (private redis-server {redis_version(server.url)} on {server.url})")
            ours = trio.run(lambda: ours_on_redis.run(server.url, quick))
            figures: Figures = {f"durable_trio {key}": value for key, value in ours.items()}
            print("  (the peers: SAQ, arq, rq, Dramatiq, Celery, taskiq, BullMQ ...)")
            rows = run_peers(server.url, quick=quick, scenarios=["S1", "S2", "S3", "S4"])
    except RedisError as exc:
        return {"redis section skipped": (float("nan"), f"no redis-server: {exc}")}
    for row in rows:
        key = f"{row['peer']} {row['scenario']} {row['metric']} ({row['unit']})"
        value = float("nan") if row["value"] is None else float(row["value"])
        figures[key] = (value, str(row["note"])[:90])
    figures["_peer_rows"] = rows
    return figures


def _soak(quick: bool) -> Figures:
    return {f"soak {key}": value for key, value in soak.run(quick).items()}


SECTIONS: dict[str, Callable[[bool], Figures]] = {
    "memory": _memory,
    "adaptive": _adaptive,
    "engine": _engine,
    "redis": _redis,
    "redis-clients": redis_clients.section,
    "redis-cpu": redis_cpu.section,
    "postgres": postgres_client.section,
    "postgres-queue": postgres_queue.section,
    "redis-cluster": redis_cluster.section,
    "replicas": replicas.section,
    "sqlite": _sqlite,
    "limits": limits.section,
    "drains": drains.section,
    "ops": ops.section,
    "signals": signals.section,
    "detached": detached.section,
    "console": console.section,
    "startup": startup.section,
    "simulation": _simulation,
    "soak": _soak,
    "retention-soak": retention_soak.section,
}


def _value(figure: Any) -> float:
    return float(figure[0]) if isinstance(figure, tuple) else float(figure)


def _best_peer(
    rows: list[dict[str, Any]],
    scenario: str,
    metric: str,
    *,
    lowest: bool,
    python_only: bool = False,
) -> tuple[str, float] | None:
    found = [
        (row["peer"], float(row["value"]))
        for row in rows
        if row["scenario"] == scenario
        and row["metric"] == metric
        and row["value"] is not None
        and not (python_only and row["peer"] == "bullmq")
        and "poll" not in str(row["peer"])
    ]
    if not found:
        return None
    return (min if lowest else max)(found, key=lambda pair: pair[1])


def _first_job_check(f: Figures, rows: list[dict[str, Any]]) -> list[tuple[str, bool | None]]:
    """Issue 35, item 2: our worker's spawn -> first job done against BullMQ's, both from the
    redis section's S1 of this run (BullMQ's in its S1 drain's note)."""
    key = "durable_trio S1 as the peers, concurrency 10: spawn -> first job done (ms)"
    theirs = [
        float(found.group(1)) * 1000
        for r in rows
        if r["peer"] == "bullmq" and r["scenario"] == "S1"
        and (found := re.search(r"spawn -> 1st job done ([0-9.]+) s", str(r.get("note"))))
    ]  # fmt: skip
    if key not in f or not theirs:
        return []
    ours, bull = _value(f[key]), theirs[0]
    return [
        (f"[35] a worker's spawn -> first job done: ours {ours:,.0f} ms vs BullMQ's {bull:,.0f} ms"
         " (want <= BullMQ's)", ours <= bull)
    ]  # fmt: skip


def _targets(f: Figures) -> list[tuple[str, bool | None]]:
    """The must-show figures of the issues, checked against this run."""
    checks: list[tuple[str, bool | None]] = []

    def have(*keys: str) -> bool:
        return all(k in f for k in keys)

    if have("memory round trips/s, concurrency 32"):
        rt = _value(f["memory round trips/s, concurrency 32"])
        checks.append(
            (f"[2] memory, concurrency 32: {rt:,.0f} >= 25,000 round trips/s", rt >= 25_000)
        )
        idle = _value(f["memory idle polls/s, 10 names"])
        checks.append((f"[2] idle transport, 10 names: {idle:g} polls/s (want 0)", idle == 0))
    if have("downstream C=8, adaptive 1..64: calls/s"):
        best = max(
            _value(v)
            for k, v in f.items()
            if k.startswith("downstream C=8, fixed") and k.endswith("calls/s")
        )
        a_rt = _value(f["downstream C=8, adaptive 1..64: calls/s"])
        a_p95 = _value(f["downstream C=8, adaptive 1..64: p95 ms"])
        base = _value(f["downstream unloaded latency ms"])
        wide = _value(f["downstream C=8, fixed 8C=64: p95 ms"])
        checks.append(
            (
                f"[5] adaptive: {a_rt / best:.0%} of the best fixed limit's throughput"
                " (want >= 90%)",
                a_rt >= 0.9 * best,
            )
        )
        checks.append(
            (
                f"[5] adaptive: p95 {a_p95 / base:.2f}x the unloaded latency (want <= 1.5x)",
                a_p95 <= 1.5 * base,
            )
        )
        checks.append(
            (
                f"[5] adaptive: p95 {wide / a_p95:.1f}x lower than fixed 8C's (want >= 3x)",
                wide >= 3 * a_p95,
            )
        )
    for backend in ("memory", "sqlite", "redis"):
        for how in ("at once", "one at a time"):
            key = f"engine {backend}: workflow / raw 3 round trips, {how} (x)"
            if key in f:
                ratio = _value(f[key])
                text = f"[6] engine on {backend}, {how}: a 3-step workflow costs {ratio:.2f}x"
                checks.append((f"{text} three raw round trips (want <= 3x)", ratio <= 3))
    rows = f.get("_peer_rows")
    if rows and have("durable_trio S1 drain, concurrency 10 (round trips/s)"):
        ours10 = _value(f["durable_trio S1 drain, concurrency 10 (round trips/s)"])
        ours32 = _value(f["durable_trio S1 drain, concurrency 32 (round trips/s)"])
        python = _best_peer(rows, "S1", "drain", lowest=False, python_only=True)
        bull = [
            float(r["value"])
            for r in rows
            if r["peer"] == "bullmq" and r["scenario"] == "S1" and r["value"] is not None
        ]
        ours = max(ours10, ours32)
        if python:
            checks.append(
                (
                    f"[3] S1: ours {ours:,.0f} round trips/s = {ours / python[1]:.1f}x the"
                    f" fastest Python peer ({python[0]}, {python[1]:,.0f} jobs/s; want >= 2x)",
                    ours >= 2 * python[1],
                )
            )
        if bull:
            checks.append(
                (
                    f"[3] S1: ours {ours:,.0f} vs BullMQ {bull[0]:,.0f} jobs/s (want >= BullMQ)",
                    ours >= bull[0],
                )
            )
        peers10 = "durable_trio S1 as the peers, concurrency 10 (jobs/s)"
        if bull and have(peers10):
            mine = _value(f[peers10])
            checks.append(
                (
                    f"[19] S1 as the peers at concurrency 10 (the peers' own setting): ours "
                    f"{mine:,.0f} vs BullMQ {bull[0]:,.0f} jobs/s = {mine / bull[0]:.2f}x "
                    "(want >= 1.3x)",
                    mine >= 1.3 * bull[0],
                )
            )
        checks += _first_job_check(f, rows)
    pairs = (("S1 drain", "no-op steps"), ("S1 drain of 1 ms CPU steps", "1 ms CPU steps"))
    for label, what in pairs:
        ratio_key = f"durable_trio {label}, --processes 2 / 1 (ratio)"
        ceiling_key = f"durable_trio {label}, the machine's ceiling for 2 / 1 (ratio)"
        if have(ratio_key, ceiling_key):
            ratio, ceiling = _value(f[ratio_key]), _value(f[ceiling_key])
            checks.append(
                (
                    f"[19] --processes 2 / 1, {what}: {ratio:.2f}x (want >= 1.5x; this "
                    f"machine's ceiling {ceiling:.2f}x, {os.cpu_count()} core(s))",
                    ratio >= 1.5,
                )
            )
    if have("durable_trio S3 latency p50 (ms)"):
        p50 = _value(f["durable_trio S3 latency p50 (ms)"])
        p99 = _value(f["durable_trio S3 latency p99 (ms)"])
        checks.append((f"[3] S3: p50 {p50:.2f} ms (want <= 0.8)", p50 <= 0.8))
        checks.append((f"[3] S3: p99 {p99:.2f} ms (want <= 3)", p99 <= 3))
        for queues in (1, 10):
            idle = _value(f[f"durable_trio S4 idle worker, {queues} queue(s) (commands/s)"])
            checks.append(
                (
                    f"[3] S4: {idle:.2f} commands/s, idle worker on {queues} queue(s)"
                    " (want <= 0.5)",
                    idle <= 0.5,
                )
            )
        k1, k1m = (
            "durable_trio S5 drain with 1,000 pending (round trips/s)",
            "durable_trio S5 drain with 1,000,000 pending (round trips/s)",
        )
        if have(k1, k1m):
            ratio = _value(f[k1m]) / _value(f[k1])
            checks.append(
                (
                    f"[3] S5: with 1M pending {ratio:.0%} of the throughput with 1k (want >= 80%)",
                    ratio >= 0.8,
                )
            )
    if have("durable_trio pod request -> reply p50 (ms)"):
        pod = _value(f["durable_trio pod request -> reply p50 (ms)"])
        checks.append((f"[7] pod request -> reply p50 {pod:.2f} ms on Redis (want <= 2)", pod <= 2))
    if have("durable_trio pod status() via the engine p50 (ms)"):
        via = _value(f["durable_trio pod status() via the engine p50 (ms)"])
        checks.append(
            (f"[7] pod status() via the engine p50 {via:.2f} ms on Redis (want <= 2)", via <= 2)
        )
    day, broken = (
        "simulation 24 h simulation wall time (s)",
        "simulation 24 h simulation invariant violations",
    )
    if have(day, broken):
        wall, violations = _value(f[day]), _value(f[broken])
        checks.append(
            (
                f"[9] a simulated day with faults in {wall:.1f} s wall, {violations:g} invariant "
                "violations (want < 60 s, 0)",
                wall < 60 and violations == 0,
            )
        )
    remote = "simulation 1 h remote-workflow simulation wall time (s)"
    if have(remote):
        note = f[remote][1] if isinstance(f[remote], tuple) else ""
        checks.append(
            (
                f"[7] remote workflows under faults: {note} (want 0 violations)",
                note.endswith(" 0 violations"),
            )
        )
    for key, what in (
        ("two engines", "two engines, killed and replaced"),
        ("engine kills", "the engine killed 10 times an hour"),
    ):
        name = f"simulation 1 h simulation with {key}: invariant violations"
        if have(name):
            violations = _value(f[name])
            checks.append(
                (f"[9] {what}: {violations:g} invariant violations (want 0)", violations == 0)
            )
    if have(
        "sqlite S1 drain, concurrency 32 (round trips/s)",
        "durable_trio S1 drain, concurrency 32 (round trips/s)",
    ):
        lite = _value(f["sqlite S1 drain, concurrency 32 (round trips/s)"])
        red = _value(f["durable_trio S1 drain, concurrency 32 (round trips/s)"])
        checks.append(
            (
                f"[8] SQLite round trips/s {lite / red:.0%} of the Redis broker's (want >= 30%)",
                lite >= 0.3 * red,
            )
        )
    if have("sqlite S3 latency p50 (ms)", "sqlite S3 round trip p50 (ms)"):
        p50 = _value(f["sqlite S3 latency p50 (ms)"])
        rt50 = _value(f["sqlite S3 round trip p50 (ms)"])
        checks.append((f"[19] SQLite S3: p50 {p50:.2f} ms (want <= 2)", p50 <= 2))
        checks.append((f"[19] SQLite S3: round trip p50 {rt50:.2f} ms (want <= 4)", rt50 <= 4))
        for queues in (1, 10):
            key = f"sqlite idle worker, {queues} queue(s) (% of a core)"
            if have(key):
                idle = _value(f[key])
                checks.append(
                    (
                        f"[19] SQLite idle worker on {queues} queue(s): {idle:.2f}% of a core"
                        " (want <= 1%)",
                        idle <= 1,
                    )
                )
    checks += _postgres_targets(f)
    checks += _retention_targets(f)
    for what in ("import durable_trio", "a worker's imports", "an app's imports"):
        # (the bare import is lazy and loads nothing: what a worker or an app touches is the
        # figure that counts, so it is held to the same bar)
        startup_ratio = f"startup {what} / import trio (x)"
        if have(startup_ratio):
            ratio = _value(f[startup_ratio])
            checks.append(
                (f"[35] {what}: {ratio:.2f}x import trio (want <= {startup.TARGET:g}x)",
                 ratio <= startup.TARGET)
            )  # fmt: skip
    cpu_ratio = "ours / ioredis CPU per command, 10 caller(s) (x)"
    if have(cpu_ratio):
        ratio = _value(f[cpu_ratio])
        checks.append(
            (f"[35] Redis client, 10 callers on one connection: {ratio:.2f}x ioredis's CPU per"
             f" command (want <= {redis_cpu.TARGET:g}x)", ratio <= redis_cpu.TARGET)
        )  # fmt: skip
    for key, value in f.items():
        if key.startswith("detached: ") and "start -> result across processes" in key:
            p50 = _value(value)
            what = key.removeprefix("detached: ").split(" start")[0]
            checks.append(
                (f"[30.1] {what}: start -> result across processes p50 {p50:.1f} ms"
                 " (want <= 50)", p50 <= 50)
            )  # fmt: skip
        if key.startswith("limits ") and key.endswith(": limited / unlimited (ratio)"):
            ratio = _value(value)
            where = key.removeprefix("limits ").split(":")[0]
            checks.append(
                (f"[33] S1 on {where} with max_concurrency=10 at concurrency 10: {ratio:.0%} of"
                 " the drain without a limit (want >= 90%)", ratio >= 0.9)
            )  # fmt: skip
        if key.startswith("drains, body ") and key.endswith(": durable_trio / bullmq (x)"):
            ratio = _value(value)
            body = key.removeprefix("drains, body ").split(":")[0]
            want = drains.TARGETS["rpush" if "RPUSH" in body else "file"]
            checks.append(
                (f"[35] S1 at concurrency 10, body {body}: {ratio:.2f}x BullMQ (want >= {want:g}x)",
                 ratio >= want)
            )  # fmt: skip
        if key.startswith("sqlite S3 back-to-back round trip p50"):
            p50 = _value(value)
            checks.append(
                (f"[30.8] SQLite request/reply back to back p50 {p50:.2f} ms (want <= 2)",
                 p50 <= 2)
            )  # fmt: skip
        if key.startswith("cluster / one node, "):
            ratio = _value(value)
            what = key.removeprefix("cluster / one node, ").removesuffix(" (x)")
            checks.append(
                (f"[17] {what} on a 3-master cluster: {ratio:.2f}x one node (want >= 0.85x)",
                 ratio >= 0.85)
            )  # fmt: skip
        if key.startswith("soak ") and " RSS growth, " in key:
            growth = _value(value)
            who, span = key.removeprefix("soak ").removesuffix(" (MB)").split(" RSS growth, ")
            checks.append(
                (
                    f"[13] {who} RSS grew {growth:.2f} MB over {span}"
                    f" (want < {soak.GROWTH_TARGET_MB:g} MB)",
                    growth < soak.GROWTH_TARGET_MB,
                )
            )
    return checks


def _retention_targets(f: Figures) -> list[tuple[str, bool | None]]:
    """Issue 34's bar: each store's size flat under retention in a sustained run."""
    checks: list[tuple[str, bool | None]] = []
    for store in retention_soak.STORES:
        key = f"retention soak {store}, retention on: net growth per run done"
        if key in f:
            kept = _value(f[key])
            checks.append(
                (f"[34] {store} store under retention: grows by {kept:.0%} of the runs done"
                 f" (want flat: <= {retention_soak.FLAT:.0%}; all kept: 100%)",
                 kept <= retention_soak.FLAT)
            )  # fmt: skip
    return checks


def _postgres_targets(f: Figures) -> list[tuple[str, bool | None]]:
    """Issue 32's bars, where the postgres-queue section measured both sides."""
    checks: list[tuple[str, bool | None]] = []

    def value(key: str) -> float | None:
        number = _value(f[key]) if key in f else float("nan")
        return None if math.isnan(number) else number

    ours = value(postgres_queue.S1_KEY)
    pgq = value("pgqueuer S1 drain (jobs/s)")
    if ours is not None and pgq:
        checks.append(
            (f"[32] PostgreSQL S1, spawn -> last body: {ours:,.0f} jobs/s = {ours / pgq:.1f}x"
             f" pgqueuer's {pgq:,.0f} (want >= 3x)", ours >= 3 * pgq)
        )  # fmt: skip
    p50 = value("durable_trio S3 p50 (ms)")
    if p50 is not None:
        theirs = value("pgqueuer S3 p50 (ms)")
        beside = f"; pgqueuer {theirs:.2f} ms" if theirs is not None else ""
        checks.append((f"[32] PostgreSQL S3 p50 {p50:.2f} ms (want <= 1.5{beside})", p50 <= 1.5))
    idle = value("durable_trio idle worker (queries/s)")
    if idle is not None:
        checks.append((f"[32] PostgreSQL idle worker: {idle:.2f} queries/s (want <= 0.5)",
                       idle <= 0.5))  # fmt: skip
    dbos = value("dbos workflows concurrent (workflows/s)")
    local = value("durable_trio engine: 3 local steps workflows at once (workflows/s)")
    if local is not None and dbos:
        # Like for like: DBOS runs its steps in the workflow's process, as ctx.run does.
        checks.append(
            (f"[32] PostgreSQL engine, local steps as DBOS's: {local:,.0f} 3-step workflows/s ="
             f" {local / dbos:.1f}x DBOS's {dbos:,.0f} (want >= 10x)", local >= 10 * dbos)
        )  # fmt: skip
    wf = value("durable_trio engine: 3-step workflows at once (workflows/s)")
    if wf is not None and dbos:
        checks.append(
            (f"[32] PostgreSQL engine, remote steps (each through the queue to a worker): {wf:,.0f}"
             f" 3-step workflows/s = {wf / dbos:.1f}x DBOS's local ones (no bar: DBOS's steps"
             " never leave the workflow's process, the line above is the like-for-like one;"
             " docs/decisions.md)", None)
        )  # fmt: skip
    early = value("postgres soak: jobs table + indexes, peak of the first half (kB)")
    late = value("postgres soak: jobs table + indexes, peak of the second half (kB)")
    if early is not None and late is not None:
        checks.append(
            (f"[32] PostgreSQL jobs table under a sustained stream: {late:,.0f} kB at most in the"
             f" second half, {early:,.0f} kB in the first (want flat: <= 1.25x)",
             late <= 1.25 * early)
        )  # fmt: skip
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("--quick", action="store_true", help="smaller runs (a smoke test)")
    parser.add_argument(
        "sections", nargs="*", help=f"sections to run (default: all of {list(SECTIONS)})"
    )
    args = parser.parse_args()
    chosen = args.sections or list(SECTIONS)
    print(
        f"durable_trio benchmarks — Python {platform.python_version()}, {platform.machine()}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}{' (quick)' if args.quick else ''}"
    )
    figures: Figures = {}
    for name in chosen:
        print(f"\n[{name}]", flush=True)
        start = time.perf_counter()
        section = SECTIONS[name](args.quick)
        clash = sorted(set(section) & set(figures))
        if clash:  # one figure's name in two sections: the targets would read the later one
            raise SystemExit(f"section {name!r} names figures another section named: {clash}")
        figures.update(section)
        shown = {k: v for k, v in section.items() if not k.startswith("_")}
        width = max(map(len, shown), default=10)
        for key, value in shown.items():
            number, note = value if isinstance(value, tuple) else (value, "")
            print(f"  {key:<{width}}  {float(number):>14,.2f}  {note}")
        print(f"  ({time.perf_counter() - start:.1f} s)", flush=True)
    checks = _targets(figures)
    if checks:
        print("\n[targets]")
        for text, ok in checks:
            print(f"  {'INFO' if ok is None else 'PASS' if ok else 'MISS'}  {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
