"""Schedules under SIGKILL, with real processes and the real clock: two engine processes fire
one schedule (every 1 s, the shortest period a schedule takes) while they are killed and
restarted, one at a time, around ticks; afterwards each tick from the first to the last has
exactly one run, and every run completes (a killed engine's runs are taken over). SQLite and
Redis."""

from __future__ import annotations

import datetime
import itertools
import random
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from durable_trio._engine import App, WorkflowContext, open_engine, open_run_store
from helpers import short_lease_engine

if TYPE_CHECKING:
    from pathlib import Path

EVERY = 1.0  # the shortest period a schedule takes (docs/engine.md)
NAMESPACE = "sched-chaos"

app = App(NAMESPACE)


@app.workflow("tick")
async def tick(ctx: WorkflowContext, _: Any) -> str:
    await ctx.sleep(0.1)  # a durable wait: a kill may land mid-run
    return ctx.run_id


# "allow": a run whose engine was killed stays unfinished until its lease lapses; under the
# default "skip" the ticks meanwhile would start nothing (by design), and this test checks that
# every tick starts once (the overlap policies: test_wf_schedules_overlap.py).
app.schedule("fast", "tick", every=EVERY, overlap="allow")


async def engine_process(url: str, engine_id: str) -> None:
    """The child: an engine that fires the schedule until it is killed."""
    async with short_lease_engine(
        app,
        url,
        engine_id=engine_id,
        schedule_grace=30.0,  # ticks passed while a process restarts are still on time
        schedule_recheck=0.5,
    ):
        await trio.sleep_forever()


def tick_of(run_id: str) -> float:
    stamp = run_id.removeprefix("sched:fast:").replace("Z", "+00:00")
    return datetime.datetime.fromisoformat(stamp).timestamp()


async def kill_and_restart(url: str, rounds: int) -> None:
    rng = random.Random(18)
    command = [sys.executable, __file__, url]
    processes = {
        name: await trio.lowlevel.open_process([*command, name], stdout=subprocess.DEVNULL)
        for name in ("A", "B")
    }
    try:
        for _ in range(rounds):
            await trio.sleep(rng.uniform(1.0, 2.0))  # lands anywhere around a tick
            victim = rng.choice(["A", "B"])
            processes[victim].kill()
            await processes[victim].wait()
            processes[victim] = await trio.lowlevel.open_process(
                [*command, victim], stdout=subprocess.DEVNULL
            )
        await trio.sleep(1.0)
    finally:
        for process in processes.values():
            process.kill()
            await process.wait()
    async with dt.open_backend(url) as backend, open_run_store(backend, NAMESPACE) as store:
        # One clean engine (no schedule firing: reconcile takes the killed engines' runs).
        async with open_engine(app, backend, engine_id="final", run_lease=1.0):
            await store.delete_schedule("fast")
            with trio.fail_after(60):
                while True:
                    runs = await store.list_runs(limit=10_000)
                    if all(r.status is dt.RunStatus.COMPLETED for r in runs):
                        break
                    await trio.sleep(0.1)
    ticks = sorted(tick_of(r.run_id) for r in runs)
    assert len(ticks) >= 8
    steps = [round((b - a) / EVERY) for a, b in itertools.pairwise(ticks)]
    assert steps == [1] * len(steps), "a tick was missed or started twice"
    assert len(set(ticks)) == len(ticks)


@pytest.mark.chaos
async def test_schedule_ticks_once_under_engine_kills_on_sqlite(tmp_path: Path) -> None:
    await kill_and_restart("sqlite:///" + str(tmp_path / "sched.db"), rounds=8)


@pytest.mark.chaos
@pytest.mark.redis
async def test_schedule_ticks_once_under_engine_kills_on_redis(redis_url: str) -> None:
    await kill_and_restart(redis_url, rounds=8)


@pytest.mark.chaos
@pytest.mark.postgres
async def test_schedule_ticks_once_under_engine_kills_on_postgres(postgres_schema_url: str) -> None:
    await kill_and_restart(postgres_schema_url, rounds=8)


if __name__ == "__main__":
    trio.run(engine_process, sys.argv[1], sys.argv[2])
