"""Fleet-wide limits (issue 33) with a real worker process killed with -9 (SQLite file backend,
wall clock, bounded, chaos): the slots its claims held come back once the claims are reclaimed
(the dead-worker pass: ``dead_worker_threshold`` 2 s, sweeps every second, as
tests/test_dead_workers.py), and the other worker then runs the jobs that waited, never more
than the limit at once.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import trio

import durable_trio as dt
from _limited_app import LIMIT
from helpers import killable_worker

pytestmark = pytest.mark.chaos

TESTS = Path(__file__).parent
TARGET = f"{TESTS / '_limited_app.py'}:app"
NAMESPACE = "limits"
JOBS = 6
#: The options of both workers: a claim of a process known dead comes back after 2 s.
RECLAIM: dict[str, Any] = {
    "stalled_threshold": 600,
    "dead_worker_threshold": 2,
    "stalled_check_interval": 1,
}


def _starts(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.chaos
async def test_slots_held_by_a_killed_worker_come_back_and_the_waiting_jobs_run() -> None:
    folder = Path(tempfile.mkdtemp(prefix="dt-limits-", dir="/tmp"))
    url = f"sqlite:///{folder / 'limits.db'}"
    log = folder / "starts.log"
    survivor = dt.App("limited")
    running = {"now": 0, "most": 0}
    ran: list[str] = []

    @survivor.step("limited", max_concurrency=LIMIT)
    async def limited(seconds: float) -> str:
        ran.append(dt.step_info().step_id)
        running["now"] += 1
        running["most"] = max(running["most"], running["now"])
        try:
            await trio.sleep(0.3)  # (not the hour the victim would take)
        finally:
            running["now"] -= 1
        return "survivor"

    try:
        results: list[dt.StepResult] = []
        async with (
            killable_worker(
                TARGET, url, NAMESPACE, {"LIMITS_TEST_LOG": str(log)}, "--concurrency", "8"
            ) as victim,
            dt.open_backend(url) as backend,
            dt.open_queue_transport(backend, namespace=NAMESPACE) as engine,
        ):
            broker = backend.broker
            queue = engine.names.task_queue("limited")

            async def on_result(result: dt.StepResult) -> None:
                results.append(result)

            engine.on_result(on_result)
            for n in range(JOBS):
                await engine.dispatch(
                    dt.RemoteTask(run_id="r", step_id=str(n), attempt=1, name="limited", input=3600)
                )
            # The victim (8 slots of its own) takes the fleet's 2, and no more.
            with trio.fail_after(30):
                while len(_starts(log)) < LIMIT:  # noqa: ASYNC110
                    await trio.sleep(0.05)
            async with dt.open_worker(survivor, backend, namespace=NAMESPACE, **RECLAIM):
                # Alive, the victim renews its claims: the survivor's 8 slots stay idle.
                await trio.sleep(4)
                assert ran == []
                assert len(_starts(log)) == LIMIT
                stats = await broker.queue_stats(queue)  # type: ignore[attr-defined]
                assert (stats.limit, stats.claimed, stats.ready) == (LIMIT, LIMIT, JOBS - LIMIT)
                killed = await victim.kill9()
                with trio.fail_after(30):
                    while len(results) < JOBS:  # noqa: ASYNC110
                        await trio.sleep(0.05)
                took = time.monotonic() - killed
                stats = await broker.queue_stats(queue)  # type: ignore[attr-defined]
        # Every job ran in the survivor, the victim's two again (reclaimed), never more than
        # the limit at once; the slots came back with the reclaim, long before the threshold.
        assert sorted(ran) == [str(n) for n in range(JOBS)]
        assert sorted(r.step_id for r in results) == [str(n) for n in range(JOBS)]
        assert {r.output for r in results} == {"survivor"}
        assert running["most"] == LIMIT
        assert (stats.claimed, stats.ready) == (0, 0)
        assert took < 30
    finally:
        shutil.rmtree(folder, ignore_errors=True)
