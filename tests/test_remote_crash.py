"""Remote workflows with real processes: the workflow worker process (serving the workflow's
turns and its steps) is SIGKILLed mid-run, twice, and replaced; every run completes with the
right output, and a step runs more than once only where a killed process ran it first (it
died before its acknowledgement landed: at least once) — never twice in one process, never
again after the surviving process ran it (SQLite, and Redis when available)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from durable_trio._engine import (
    App,
    open_engine,
    open_run_store,
    open_worker,
    step_info,
)
from helpers import completed_steps, kill_after
from test_engine_crash import expected, pipeline

if TYPE_CHECKING:
    from pathlib import Path

RUNS = 3
RUN_IDS = [f"run-{n}" for n in range(RUNS)]
NAMESPACE = "remote-chaos"
#: Short thresholds, so a killed worker's claims come back within about a second.
FAST: dict[str, Any] = {"stalled_threshold": 1.0, "stalled_check_interval": 0.25}

app = App(NAMESPACE)


def _log(what: str) -> None:
    """Each execution and the process that ran it, appended to the file the test names."""
    with open(os.environ["REMOTE_CHAOS_LOG"], "a", encoding="utf-8") as log:
        log.write(f"{what} {os.getpid()}\n")


@app.step("work")
async def work(n: int) -> int:
    _log(step_info().idempotency_key)
    await trio.sleep(0.1)
    return n * n


app.workflow("pipeline", remote=True)(pipeline)  # the local crash test's workflow


async def worker_process(url: str) -> None:
    """The child: serves the steps and the turns of ``pipeline`` until killed."""
    async with dt.open_backend(url) as backend, open_worker(app, backend, **FAST):
        await trio.sleep_forever()


async def kill_workers_twice(url: str, log: Path) -> None:
    env = {**os.environ, "REMOTE_CHAOS_LOG": str(log)}
    declared = App(NAMESPACE)
    declared.remote_workflow("pipeline")

    async def spawn() -> trio.Process:
        return await trio.lowlevel.open_process(
            [sys.executable, __file__, url], stdout=subprocess.DEVNULL, env=env
        )

    async with (
        dt.open_backend(url) as backend,
        open_run_store(backend, NAMESPACE) as store,
        open_engine(declared, backend, turn_timeout=30.0, watch_interval=0.2, **FAST) as engine,
    ):
        for n in range(RUNS):
            await engine.start("pipeline", 4 + n, run_id=f"run-{n}")
        first = await spawn()
        done_at_first_kill = await kill_after(first, store, RUN_IDS, 4)
        second = await spawn()
        done_at_second_kill = await kill_after(second, store, RUN_IDS, len(done_at_first_kill) + 5)
        third = await spawn()
        try:
            with trio.fail_after(60):
                outputs = {f"run-{n}": await engine.result(f"run-{n}") for n in range(RUNS)}
        finally:
            third.kill()
            await third.wait()
        finished = await completed_steps(store, RUN_IDS)
        stats = engine.statistics()
        lines = (await trio.Path(log).read_text()).split("\n")
    runs_of: dict[str, list[int]] = {}
    for line in filter(None, lines):
        key, pid = line.split()
        runs_of.setdefault(key, []).append(int(pid))
    killed = {first.pid, second.pid}
    assert outputs == {f"run-{n}": expected(4 + n) for n in range(RUNS)}
    assert done_at_first_kill < done_at_second_kill < finished
    assert set(runs_of) == finished
    assert len(finished) == sum(4 + n + 3 for n in range(RUNS))
    for key, pids in runs_of.items():
        assert len(set(pids)) == len(pids), f"{key} ran twice in one process: {pids}"
        assert all(pid in killed for pid in pids[:-1]), f"{key} ran again after {pids}"
    # At most what two kills left in flight (8 slots each).
    assert sum(len(pids) - 1 for pids in runs_of.values()) <= 2 * 8
    assert stats.runs_completed == RUNS
    assert stats.decisions_applied >= stats.runs_completed


@pytest.mark.chaos
async def test_killed_workflow_workers_on_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'remote-chaos.db'}".replace("///", "////", 1)
    await kill_workers_twice(url, tmp_path / "executions.log")


@pytest.mark.chaos
@pytest.mark.redis
async def test_killed_workflow_workers_on_redis(redis_url: str, tmp_path: Path) -> None:
    await kill_workers_twice(redis_url, tmp_path / "executions.log")


@pytest.mark.chaos
@pytest.mark.postgres
async def test_killed_workflow_workers_on_postgres(
    postgres_schema_url: str, tmp_path: Path
) -> None:
    await kill_workers_twice(postgres_schema_url, tmp_path / "executions.log")


if __name__ == "__main__":
    trio.run(worker_process, sys.argv[1])
