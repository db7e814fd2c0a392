"""The drains with a body: S1 beside BullMQ with a step body that does something (issue 35, item 3).

The S1 of ``benchmarks/redis.py``'s ``drain_as_the_peers`` and of the peers' harness
(benchmarks/peers/README.md): 10,000 jobs queued first, ONE worker process at concurrency 10,
timed from the worker's start (imports and connecting done) to the moment its last job's body
is done. Here the body is one of:

* ``file``: append one byte to a file, on a descriptor opened once (``os.write`` for us,
  ``fs.writeSync`` for BullMQ);
* ``rpush``: one ``RPUSH`` to a list on the same Redis server, through one client per worker
  process opened at its start: ``durable_trio.redis.open_redis(url)`` (its defaults) for us,
  one ``new IORedis()`` (its defaults) awaited in BullMQ's processor.

Unlike ``drain_as_the_peers``, no done signal is written per job: each worker counts the
distinct jobs done in memory and reports the time of the last (and its CPU since its start),
so the body is the only I/O a job adds. Our worker: ``benchmarks/_drains_worker.py``; BullMQ's:
``benchmarks/peers/run_bullmq.mjs --scenario S1 --body file|rpush`` (its npm folder built by
``benchmarks/peers/venv.py``). Both on the same private redis-server, ``FLUSHALL``-ed before
each run; the runs alternate (ours, BullMQ; then BullMQ, ours; ...) ``RUNS`` times per body,
and each figure is the median.

    python -m benchmarks drains [--quick]
    python -m benchmarks.drains --profile rpush OUT.prof   # cProfile of our worker, one drain
    python -m benchmarks.drains --profile-cpu rpush OUT.prof   # the same, by the CPU clock
    python -m benchmarks.drains --instructions             # our worker's instructions per job
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

import durable_trio as dt
from durable_trio.redis import open_redis

from .peers.venv import PEERS_DIR, ensure_envs
from .redis import _fill
from .redis_server import RedisError, _info_fields, flushall, private_redis, redis_version

__all__ = ["TARGETS", "Drain", "bullmq", "ours", "section"]

Figures = dict[str, Any]

WORKER = Path(__file__).with_name("_drains_worker.py")
SRC = Path(__file__).resolve().parent.parent
CONCURRENCY = 10
RUNS = 3
#: issue 35, item 3: ours / BullMQ at concurrency 10, per body
TARGETS = {"rpush": 1.3, "file": 1.6}
BODIES = {
    "rpush": "one RPUSH (our client vs ioredis)",
    "file": "appends one byte to a file",
}
TIMEOUT = 180.0
_SCRUBBED_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")


@dataclass(frozen=True)
class Drain:
    """One drain: jobs/s from the worker's start, its CPU per job, its start-up, bodies run."""

    rate: float
    cpu_us: float
    startup_s: float
    bodies: int
    redis_us: float  # the redis-server's CPU per job, from the worker's spawn to its last job
    user_us: float = float("nan")  # of cpu_us, in user mode (ours only; 10 ms ticks)
    system_us: float = float("nan")  # of cpu_us, in the kernel (ours only)


async def _queue(url: str, namespace: str, jobs: int) -> None:
    async with dt.open_backend(url) as backend:
        async with dt.open_queue_transport(backend, namespace=namespace) as engine:
            await _fill(engine, jobs)


async def _llen(url: str, key: str) -> int:
    async with open_redis(url) as client:
        count: int = await client.execute("LLEN", key)
        await client.execute("DEL", key)
        return count


def redis_cpu(url: str) -> float:
    """The redis-server's CPU seconds so far (user + system, ``INFO cpu``)."""
    fields = _info_fields(url, "cpu")
    return float(fields["used_cpu_user"]) + float(fields["used_cpu_sys"])


def ours(
    url: str, body: str, *, jobs: int, profile: Path | None = None, cpu_clock: bool = False
) -> Drain:
    """One drain of ``jobs`` steps by our worker process with ``body`` (``profile``: under
    cProfile, its stats to that file, timed by the CPU clock with ``cpu_clock``)."""
    namespace = f"drains-{body}-{time.monotonic_ns()}"
    trio.run(_queue, url, namespace, jobs)
    with tempfile.TemporaryDirectory() as folder:
        target = str(Path(folder) / "body") if body == "file" else "bench:drains:ours"
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        if profile is not None:
            env["BENCH_PROFILE"] = str(profile)
            if cpu_clock:
                env["BENCH_PROFILE_CLOCK"] = "cpu"
        argv = [sys.executable, str(WORKER), url, namespace, str(CONCURRENCY), str(jobs), body]
        spawned, server_cpu = time.time(), redis_cpu(url)
        worker = subprocess.Popen([*argv, target], stdout=subprocess.PIPE, env=env, text=True)
        watchdog = threading.Timer(TIMEOUT, worker.kill)
        watchdog.start()
        try:
            assert worker.stdout is not None
            lines = {}
            while "done" not in lines:
                line = worker.stdout.readline()
                if not line:
                    raise RuntimeError(f"our worker exited {worker.wait()} before its drain ended")
                word, *fields = line.split()
                lines[word] = [float(f) for f in fields]
            server_cpu = redis_cpu(url) - server_cpu
        finally:
            watchdog.cancel()
            worker.kill()
            worker.wait()
            if worker.stdout is not None:
                worker.stdout.close()
        bodies = (
            Path(target).stat().st_size
            if body == "file"
            else trio.run(_llen, url, target)
            if body == "rpush"
            else jobs
        )
    (start, cpu0, user0, sys0), (done, cpu1, user1, sys1) = lines["start"], lines["done"]
    per_job = 1e6 / jobs
    return Drain(
        jobs / (done - start), (cpu1 - cpu0) * per_job, start - spawned, bodies,
        server_cpu * per_job, (user1 - user0) * per_job, (sys1 - sys0) * per_job,
    )  # fmt: skip


def bullmq(command: list[str], env: dict[str, str], url: str, body: str, *, jobs: int) -> Drain:
    """One drain of ``jobs`` BullMQ jobs by its worker process with ``body``."""
    argv = [
        *command, "--redis", url, "--scenario", "S1", "--jobs", str(jobs),
        "--concurrency", str(CONCURRENCY), "--deadline", "60", "--body", body,
    ]  # fmt: skip
    clean = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    done = subprocess.run(
        argv, capture_output=True, text=True, env={**clean, **env}, timeout=TIMEOUT,
        check=False, stdin=subprocess.DEVNULL, cwd=PEERS_DIR,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"run_bullmq.mjs exited {done.returncode}: {tail[:200]}")
    out = json.loads(lines[-1])
    if out.get("error"):
        raise RuntimeError(f"run_bullmq.mjs: {out['error']}")
    results = {r["metric"]: r for r in out["results"]}
    note = str(results["drain"]["note"])
    startup = float(note.split("worker start-up ")[1].split(" s")[0])
    bodies = int(note.split(" jobs, ")[1].split(" bodies")[0])
    return Drain(
        float(results["drain"]["value"]), float(results["cpu"]["value"]), startup, bodies,
        float(results["redis-cpu"]["value"]),
    )  # fmt: skip


def _from_spawn(drain: Drain, jobs: int) -> float:
    """The drain's jobs/s counted from the worker's spawn (its start-up included)."""
    return jobs / (jobs / drain.rate + drain.startup_s)


def _summary(runs: list[Drain]) -> tuple[float, str]:
    rate = statistics.median(d.rate for d in runs)
    cpu = statistics.median(d.cpu_us for d in runs)
    server = statistics.median(d.redis_us for d in runs)
    startup = statistics.median(d.startup_s for d in runs)
    spread = ", ".join(f"{d.rate:,.0f}" for d in runs)
    bodies = min(d.bodies for d in runs)
    return rate, (
        f"runs {spread}; CPU us/job: worker {cpu:,.0f}, redis-server {server:,.0f};"
        f" start-up {startup:.2f} s not counted; >= {bodies:,} bodies run"
    )


def run(url: str, quick: bool) -> Figures:
    """Both bodies, ours and BullMQ's, alternating, on ``url`` (a private server)."""
    jobs = 2_000 if quick else 10_000
    runs = 1 if quick else RUNS
    env = ensure_envs(["bullmq"])["bullmq"]
    measured: dict[tuple[str, str], list[Drain]] = {}
    for n in range(runs):
        for body in TARGETS:
            sides = ["ours", "bullmq"] if n % 2 == 0 else ["bullmq", "ours"]
            for side in sides:
                if side == "bullmq" and env.command is None:
                    continue
                flushall(url)
                drain = (
                    ours(url, body, jobs=jobs)
                    if side == "ours"
                    else bullmq(env.command or [], env.env, url, body, jobs=jobs)
                )
                measured.setdefault((side, body), []).append(drain)
    flushall(url)
    figures: Figures = {}
    for body, target in TARGETS.items():
        what = f"drains, body {BODIES[body]}"
        mine, note = _summary(measured[("ours", body)])
        figures[f"{what}: durable_trio (jobs/s)"] = (mine, note)
        if ("bullmq", body) not in measured:
            figures[f"{what}: bullmq"] = (float("nan"), f"skipped: {env.reason}")
            continue
        theirs, note = _summary(measured[("bullmq", body)])
        figures[f"{what}: bullmq (jobs/s)"] = (theirs, note)
        pairs = list(zip(measured[("ours", body)], measured[("bullmq", body)], strict=True))
        each = ", ".join(f"{a.rate / b.rate:.2f}" for a, b in pairs)
        spawn = statistics.median(_from_spawn(a, jobs) / _from_spawn(b, jobs) for a, b in pairs)
        figures[f"{what}: durable_trio / bullmq (x)"] = (
            mine / theirs,
            f"medians; run by run {each}; from the spawn {spawn:.2f} (want >= {target:g}x)",
        )
    return figures


def section(quick: bool) -> Figures:
    """``python -m benchmarks drains``: :func:`run` on a private redis-server."""
    try:
        with private_redis() as server:
            print(f"  (private redis-server {redis_version(server.url)} on {server.url})")
            return run(server.url, quick)
    except (RedisError, RuntimeError, subprocess.TimeoutExpired) as exc:
        return {"drains section skipped": (float("nan"), f"{type(exc).__name__}: {exc}")}


def split(url: str, *, runs: int = 5, jobs: int = 10_000) -> None:
    """Our worker's CPU per job with no body, the file body and the RPUSH body, taking turns
    ``runs`` times; per body the run of least CPU (the least disturbed), user and system."""
    measured: dict[str, list[Drain]] = {}
    for _ in range(runs):
        for body in ("none", "file", "rpush"):
            flushall(url)
            measured.setdefault(body, []).append(ours(url, body, jobs=jobs))
    for body, drains in measured.items():
        best = min(drains, key=lambda d: d.cpu_us)
        rates = ", ".join(f"{d.rate:,.0f}" for d in drains)
        print(
            f"  body {body:5}  CPU {best.cpu_us:5.1f} us/job (user {best.user_us:.0f}, system"
            f" {best.system_us:.0f}); runs' CPU {', '.join(f'{d.cpu_us:.0f}' for d in drains)};"
            f" jobs/s {rates}"
        )


def instructions(url: str, body: str, jobs: int) -> int:
    """The instructions our worker process runs, from its spawn to its ``jobs``-th job done
    (valgrind's cachegrind, no cache simulation: about 50 times slower, but steady on a
    loaded machine where the CPU time swings)."""
    namespace = f"drains-{body}-{time.monotonic_ns()}"
    trio.run(_queue, url, namespace, jobs)
    with tempfile.TemporaryDirectory() as folder:
        target = str(Path(folder) / "body") if body == "file" else "bench:drains:ours"
        out = Path(folder) / "cachegrind.out"
        argv = [
            "valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}",
            sys.executable, str(WORKER), url, namespace, str(CONCURRENCY), str(jobs), body, target,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(SRC), "BENCH_EXIT": "1"}
        subprocess.run(argv, env=env, capture_output=True, timeout=TIMEOUT * 5, check=True)
        for line in out.read_text().splitlines():
            if line.startswith("summary:"):
                return int(line.split()[1])
    raise RuntimeError("cachegrind wrote no summary")


def instructions_per_job(url: str, *, small: int = 1_000, large: int = 3_000) -> None:
    """Our worker's instructions per job by body: drains of ``small`` and ``large`` jobs, the
    difference over ``large - small`` (the start-up, imports and connecting, cancels out)."""
    for body in ("none", "file", "rpush"):
        counts = []
        for jobs in (small, large):
            flushall(url)
            counts.append(instructions(url, body, jobs))
        per_job = (counts[1] - counts[0]) / (large - small)
        print(
            f"  body {body:5}  {per_job:,.0f} instructions per job ({counts[0]:,}, {counts[1]:,})"
        )


USAGE = """usage: python -m benchmarks.drains --profile|--profile-cpu none|file|rpush OUT.prof
       python -m benchmarks.drains --split
       python -m benchmarks.drains --instructions"""


def main() -> int:
    """``--profile BODY OUT``: one drain of our worker under cProfile (stats to OUT; by the
    CPU clock with ``--profile-cpu``); ``--split``: our worker's CPU per job by body
    (:func:`split`); ``--instructions``: its instructions per job by body (needs valgrind)."""
    args = sys.argv[1:]
    profiling = (
        len(args) == 3
        and args[0] in ("--profile", "--profile-cpu")
        and args[1] in ("none", *TARGETS)
    )
    if not profiling and args not in (["--split"], ["--instructions"]):
        print(USAGE, file=sys.stderr)
        return 2
    with private_redis() as server:
        if args == ["--split"]:
            split(server.url)
            return 0
        if args == ["--instructions"]:
            instructions_per_job(server.url)
            return 0
        drain = ours(
            server.url, args[1], jobs=10_000, profile=Path(args[2]),
            cpu_clock=args[0] == "--profile-cpu",
        )  # fmt: skip
    print(f"{drain.rate:,.0f} jobs/s under cProfile; worker CPU {drain.cpu_us:,.0f} us/job")
    return 0


if __name__ == "__main__":
    sys.exit(main())
