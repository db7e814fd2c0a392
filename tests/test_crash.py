"""Crash tests with real processes (issue 4): worker processes killed with SIGKILL mid-step.

Every step's result arrives; no step is lost; double executions only for steps whose worker was
killed; the time from a kill to the redelivery of the killed worker's claims (the steps it ran
and the ones it had prefetched) is measured and must stay under threshold +
stalled_check_interval + 1 s.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

import durable_trio as dt
from _crash_worker import CHECK_INTERVAL, THRESHOLD

STEPS = 2000
WORKERS = 3
WORKER_SCRIPT = Path(__file__).with_name("_crash_worker.py")


def start_worker(url: str, namespace: str, instance: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(WORKER_SCRIPT.parent.parent)}
    process = subprocess.Popen(
        [sys.executable, str(WORKER_SCRIPT), url, namespace, instance, str(log)],
        stdout=subprocess.PIPE,
        env=env,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == b"ready"
    return process


def read_logs(folder: Path) -> tuple[list[tuple[str, str, float]], list[tuple[str, str, float]]]:
    """(executions, claims) as (step, instance, unix time) rows, oldest first."""
    executions, claims = [], []
    for log in folder.glob("*.log"):
        for line in log.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] != "LEASE-LOST":
                executions.append((parts[0], parts[1], float(parts[2])))
            elif len(parts) == 4 and parts[0] == "CLAIM":
                claims.append((parts[1], parts[2], float(parts[3])))
    return sorted(executions, key=lambda r: r[2]), sorted(claims, key=lambda r: r[2])


async def run_crash_test(url: str, tmp_path: Path) -> dict[str, Any]:
    namespace = f"crash-{random.randrange(1 << 30)}"
    logs = tmp_path / "logs"
    logs.mkdir()
    workers: dict[str, subprocess.Popen[bytes]] = {}
    kills: list[tuple[float, str]] = []
    retired: list[subprocess.Popen[bytes]] = []
    results: dict[str, dt.StepResult] = {}
    result_count = 0
    serial = 0

    async def spawn() -> None:
        nonlocal serial
        serial += 1
        name = f"w{serial}"
        # in a thread: a worker starting slowly must not stall this process's event loop
        with trio.fail_after(30):
            workers[name] = await trio.to_thread.run_sync(
                start_worker, url, namespace, name, logs / f"{name}.log"
            )

    for _ in range(WORKERS):
        await spawn()
    all_done = trio.Event()
    try:
        async with dt.open_backend(url) as backend:
            async with dt.open_queue_transport(
                backend, namespace=namespace, result_concurrency=16
            ) as engine:

                async def on_result(result: dt.StepResult) -> None:
                    nonlocal result_count
                    result_count += 1
                    results.setdefault(result.step_id, result)
                    if len(results) == STEPS:
                        all_done.set()

                engine.on_result(on_result)
                for n in range(STEPS):
                    await engine.dispatch(
                        dt.RemoteTask(run_id="crash", step_id=f"s{n}", attempt=1, name="work")
                    )
                with trio.fail_after(90):
                    while not all_done.is_set():
                        with trio.move_on_after(0.7):
                            await all_done.wait()
                        if all_done.is_set() or len(kills) >= 8:
                            continue
                        victim = random.choice(sorted(workers))
                        workers[victim].send_signal(signal.SIGKILL)
                        kills.append((time.time(), victim))
                        retired.append(workers.pop(victim))
                        retired[-1].wait()
                        await spawn()
                    await all_done.wait()
    finally:
        for process in workers.values():
            process.kill()
            process.wait()
            retired.append(process)
        for process in retired:
            if process.stdout is not None:
                process.stdout.close()
    executions, claims = read_logs(logs)
    killed = {name for _, name in kills}
    # workers that reported a lost lease (an event loop starved past the threshold on a loaded
    # machine): their double runs are the reported at-least-once kind, not a bug
    lost_lease = {
        line.split()[1]
        for log in logs.glob("*.log")
        for line in log.read_text().splitlines()
        if line.startswith("LEASE-LOST ")
    }
    by_step: dict[str, list[tuple[str, float]]] = {}
    for step, instance, at in executions:
        by_step.setdefault(step, []).append((instance, at))
    duplicates = {s: runs for s, runs in by_step.items() if len(runs) > 1}
    # kill -> redelivery (T9, docs/spec.md): for each step the killed worker held at the kill
    # (its latest claim of the step, running or prefetched), the time until another worker
    # claimed it again. A step re-claimed by a worker that is killed in turn is measured again
    # from that kill.
    claims_of: dict[str, list[tuple[str, float]]] = {}
    for step, instance, at in claims:
        claims_of.setdefault(step, []).append((instance, at))
    delays: list[float] = []
    worst: tuple[str, str, list[tuple[str, float]]] | None = None
    for kill_at, victim in kills:
        for step, held in claims_of.items():
            before = [who for who, at in held if at <= kill_at]
            if not before or before[-1] != victim:
                continue
            later = [at for who, at in held if who != victim and at > kill_at]
            if later:
                delays.append(later[0] - kill_at)
                if later[0] - kill_at >= max(delays):
                    worst = (step, victim, [(who, round(at - kill_at, 3)) for who, at in held])
    return {
        "steps": STEPS,
        "results": len(results),
        "lost": STEPS - len(results),
        "result_messages": result_count,
        "kills": len(kills),
        "duplicates": len(duplicates),
        "duplicates_not_from_kills": [
            (step, runs)
            for step, runs in duplicates.items()
            if not ({who for who, _ in runs[:-1]} & (killed | lost_lease))
        ],
        "lost_leases": len(lost_lease),
        "redelivered": len(delays),
        "p50": statistics.median(delays) if delays else 0.0,
        "max": max(delays, default=0.0),
        # the slowest redelivery: (step, killed holder, its claims in seconds from that kill)
        "worst": worst,
    }


def report(backend: str, figures: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():  # shown in CI's output too, not only with -s
        print(
            f"\n[crash test, {backend}] steps={figures['steps']} lost={figures['lost']} "
            f"kills={figures['kills']} duplicates={figures['duplicates']} "
            f"(workers reporting a lost lease: {figures['lost_leases']}) "
            f"redelivered={figures['redelivered']} kill->redelivery p50={figures['p50']:.2f}s "
            f"max={figures['max']:.2f}s (bound {THRESHOLD + CHECK_INTERVAL + 1:.1f}s) "
            f"slowest: {figures['worst']}"
        )


def check(figures: dict[str, Any]) -> None:
    assert figures["lost"] == 0
    assert figures["results"] == STEPS
    assert figures["kills"] >= 3
    assert figures["duplicates_not_from_kills"] == [], figures["duplicates_not_from_kills"][:5]
    assert figures["redelivered"] > 0
    assert figures["max"] <= THRESHOLD + CHECK_INTERVAL + 1.0


@pytest.mark.chaos
async def test_t7_t9_kill_9_workers_on_sqlite_loses_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = "sqlite:///" + str(tmp_path / "crash.db")
    figures = await run_crash_test(url, tmp_path)
    report("sqlite", figures, capsys)
    check(figures)


@pytest.mark.chaos
async def test_t7_t9_kill_9_workers_on_redis_loses_nothing(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    figures = await run_crash_test(redis_url, tmp_path)
    report("redis", figures, capsys)
    check(figures)
