"""Issue 36, item 2, with real processes: hundreds of cancels racing the runs' ends (a step
that completes, or fails for good, within tens of milliseconds), through every route: the
owner's own ``engine.cancel`` (in the engine process), another engine's (this process) and the
operator's ``cancel_run`` (this process, no engine). Afterwards no run that ended completed or
failed holds a cancel mark, every cancel that said it cancelled left its run cancelled, and a
``retry`` of every failed run re-runs its failed step to completion (never ``cancelled``).
SQLite and Redis; wall-clock, bounded."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from durable_trio._engine import App, RunStatus, WorkflowContext, open_engine, open_run_store
from durable_trio._engine._cancel import CANCEL_MARK

if TYPE_CHECKING:
    from pathlib import Path

NAMESPACE = "cancel-race"
RUNS = 240
SEED = 36

app = App("cancel-race")


@app.step("work", retry=dt.Retry(max_attempts=1))
async def work(plan: dict[str, Any]) -> str:
    await trio.sleep(plan["takes"])
    if plan["fail"] and dt.step_info().attempt == 1:  # a retry's attempt succeeds
        raise ValueError("declined")
    return "done"


@app.workflow("racer")
async def racer(ctx: WorkflowContext, plan: dict[str, Any]) -> str:
    return str(await ctx.step("work", plan))


def plan(index: int) -> dict[str, Any]:
    rng = random.Random(f"{SEED}:{index}")
    takes, fail = rng.uniform(0.0, 0.05), rng.random() < 0.5
    return {"takes": takes, "fail": fail, "cancel": rng.uniform(0, 0.08)}


def route(index: int) -> str:
    return ("owner", "engine", "operator")[index % 3]


def run_id(index: int) -> str:
    return f"r-{index}"


async def engine_process(url: str) -> None:
    """Engine A with its worker: starts every run, cancels its own share (the owner's route),
    prints what each of its cancels said, then drives on (retries) until killed."""
    answers: dict[str, bool] = {}
    async with dt.open_backend(url) as backend:
        async with (
            dt.open_worker(app, backend, namespace=NAMESPACE),
            open_engine(
                app, backend, namespace=NAMESPACE, engine_id="A", run_lease=1.0,
                reconcile_interval=0.2, watch_interval=0.2,
            ) as engine,
        ):  # fmt: skip

            async def cancel_later(index: int) -> None:
                await trio.sleep(plan(index)["cancel"])
                answers[run_id(index)] = await engine.cancel(run_id(index), reason="owner")

            async with trio.open_nursery() as nursery:
                for index in range(RUNS):
                    await engine.start("racer", plan(index), run_id=run_id(index))
                    if route(index) == "owner":
                        nursery.start_soon(cancel_later, index)
                    await trio.sleep(0.01)
            print(json.dumps(answers), flush=True)
            await trio.sleep_forever()


async def race(url: str) -> None:
    argv = [sys.executable, __file__, url]
    async with dt.open_backend(url) as backend, open_run_store(backend, NAMESPACE) as store:
        engine_a = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE)
        try:
            answers = await cancel_from_here(url, backend, store, engine_a)
            counts = await check_ends(store, answers)
            # Every route raced; the races went every way.
            assert {route(int(r.split("-")[1])) for r in answers} == {"owner", "engine", "operator"}
            assert counts[RunStatus.CANCELLED] > 10, counts
            assert counts[RunStatus.FAILED] > 10, counts
            assert counts[RunStatus.COMPLETED] > 10, counts
            await retry_failed(backend, store)
        finally:
            engine_a.kill()
            await engine_a.wait()


async def cancel_from_here(
    url: str, backend: dt.Backend, store: Any, engine_a: trio.Process
) -> dict[str, bool]:
    """Another engine's cancels and the operator's, each at its planned delay after the run
    appears; returns what every cancel (these and engine A's) said, by run id."""
    del url
    answers: dict[str, bool] = {}
    async with (
        open_engine(
            app, backend, namespace=NAMESPACE, engine_id="B", run_lease=1.0,
            reconcile_interval=0.2, watch_interval=0.2,
        ) as engine_b,
        dt.open_operations(backend, namespace=NAMESPACE, existing=True) as ops,
    ):  # fmt: skip

        async def cancel_later(index: int) -> None:
            await trio.sleep(plan(index)["cancel"])
            if route(index) == "engine":
                answers[run_id(index)] = await engine_b.cancel(run_id(index), reason="engine B")
            else:
                answers[run_id(index)] = await ops.cancel_run(run_id(index), reason="operator")

        with trio.fail_after(120):
            seen: set[int] = set()
            async with trio.open_nursery() as nursery:
                while len(seen) < RUNS:
                    for run in await store.list_runs(limit=RUNS + 10):
                        index = int(run.run_id.split("-")[1])
                        if index not in seen:
                            seen.add(index)
                            if route(index) != "owner":
                                nursery.start_soon(cancel_later, index)
                    await trio.sleep(0.005)
            assert engine_a.stdout is not None
            out = b""
            while not out.endswith(b"\n"):
                out += await engine_a.stdout.receive_some()
            answers.update(json.loads(out))
    return answers


async def check_ends(store: Any, answers: dict[str, bool]) -> dict[RunStatus, int]:
    counts = dict.fromkeys(RunStatus, 0)
    with trio.fail_after(60):
        for index in range(RUNS):
            while not (run := await store.get_run(run_id(index))).status.terminal:  # noqa: ASYNC110 - another process settles it
                await trio.sleep(0.05)
            counts[run.status] += 1
            mark = await store.get_step(run.run_id, CANCEL_MARK)
            if run.status in (RunStatus.COMPLETED, RunStatus.FAILED):
                assert mark is None, f"{run.run_id} ended {run.status.value} with a cancel mark"
            if answers[run.run_id]:
                assert run.status is RunStatus.CANCELLED, f"{run.run_id}: said cancelled"
    return counts


async def retry_failed(backend: dt.Backend, store: Any) -> None:
    """The operator retries every failed run: engine A re-runs its failed step, it completes."""
    failed = [r.run_id for r in await store.list_runs(status=RunStatus.FAILED, limit=RUNS)]
    async with dt.open_operations(backend, namespace=NAMESPACE, existing=True) as ops:
        for failed_id in failed:
            await ops.retry_run(failed_id)
    with trio.fail_after(60):
        for failed_id in failed:
            while not (run := await store.get_run(failed_id)).status.terminal:  # noqa: ASYNC110 - another process settles it
                await trio.sleep(0.05)
            assert run.status is RunStatus.COMPLETED, (failed_id, run.status, run.error)
            assert run.output == "done"


@pytest.mark.chaos
async def test_cancels_racing_ends_on_sqlite(tmp_path: Path) -> None:
    await race(f"sqlite:///{tmp_path / 'runs.db'}".replace("///", "////", 1))


@pytest.mark.chaos
@pytest.mark.redis
async def test_cancels_racing_ends_on_redis(redis_url: str) -> None:
    await race(redis_url)


@pytest.mark.chaos
@pytest.mark.postgres
async def test_cancels_racing_ends_on_postgres(postgres_schema_url: str) -> None:
    await race(postgres_schema_url)


if __name__ == "__main__":
    trio.run(engine_process, sys.argv[1])
