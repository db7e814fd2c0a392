"""Child workflows under a crash with real processes (issue 18, item 3): the engine process is
SIGKILLed while the parent waits for its children; another engine process finishes the parent
and the children, each child started once (SQLite file, private Redis)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from typing import TYPE_CHECKING

import pytest
import trio

import durable_trio as dt
from durable_trio._engine import (
    App,
    RunStatus,
    StepKind,
    WorkflowContext,
    open_run_store,
    open_worker,
    step_info,
)
from helpers import short_lease_engine, sqlite_url

if TYPE_CHECKING:
    from pathlib import Path

    from durable_trio._engine import RunStore

NAMESPACE = "children-chaos"
PARCELS = 3

app = App("children-chaos")
EXECUTIONS: Counter[str] = Counter()


@app.step("ship")
async def ship(parcel: int) -> str:
    EXECUTIONS[step_info().idempotency_key] += 1
    await trio.sleep(1.0)
    return f"shipped {parcel}"


@app.workflow("shipment")
async def shipment(ctx: WorkflowContext, parcel: int) -> str:
    return str(await ctx.step("ship", parcel))


@app.workflow("order")
async def order(ctx: WorkflowContext, parcels: int) -> list[str]:
    handles = [await ctx.start_child("shipment", n) for n in range(parcels)]
    return list(await ctx.gather(*handles))


async def engine_process(url: str, engine_id: str, start: bool) -> None:
    """An engine with a short run lease, so a killed one's runs lapse quickly."""
    async with short_lease_engine(app, url, namespace=NAMESPACE, engine_id=engine_id) as engine:
        if start:
            await engine.start("order", PARCELS, run_id="order-1")
        output = await engine.result("order-1")
    print(json.dumps({"output": output}))


def command(url: str, engine_id: str, start: bool) -> list[str]:
    return [sys.executable, __file__, url, engine_id, "1" if start else "0"]


async def children_started(store: RunStore) -> int:
    """Children checkpointed by the parent AND running (a child's checkpoint is written before
    its run is created and claimed: killing in between would test another moment)."""
    steps = await store.get_steps("order-1")
    started = 0
    for step in steps:
        if step.kind is StepKind.CHILD:
            child = await store.get_run(step.input["runId"])
            started += child is not None and child.status is RunStatus.RUNNING
    return started


async def kill_mid_wait(url: str) -> None:
    EXECUTIONS.clear()
    async with dt.open_backend(url) as backend, open_run_store(backend, NAMESPACE) as store:
        async with open_worker(app, backend, namespace=NAMESPACE, concurrency=8):
            first = await trio.lowlevel.open_process(
                command(url, "A", True), stdout=subprocess.DEVNULL
            )
            with trio.fail_after(30):
                # Polled: another process writes the checkpoints.
                while await children_started(store) < PARCELS:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            first.kill()  # the parent waits for its children (each ship step takes 1 s)
            await first.wait()
            waiting = [await store.get_run(f"order-1/{n}") for n in range(1, PARCELS + 1)]
            with trio.fail_after(60):
                last = await trio.run_process(command(url, "B", False), capture_stdout=True)
            report = json.loads(last.stdout.decode().strip().splitlines()[-1])
            runs = sorted(r.run_id for r in await store.list_runs())
            statuses = {r: (await store.get_run(r)).status for r in runs}  # type: ignore[union-attr]
    assert all(w is not None and w.status is RunStatus.RUNNING for w in waiting)
    assert report["output"] == [f"shipped {n}" for n in range(PARCELS)]
    # One child per parcel, never a second; each completed.
    assert runs == ["order-1", *(f"order-1/{n}" for n in range(1, PARCELS + 1))]
    assert set(statuses.values()) == {RunStatus.COMPLETED}
    # Each child's step ran; again only when the killed engine had not confirmed its dispatch.
    assert set(EXECUTIONS) == {f"order-1/{n}:1" for n in range(1, PARCELS + 1)}
    assert all(count <= 2 for count in EXECUTIONS.values())


@pytest.mark.chaos
async def test_engine_killed_while_the_parent_waits_on_sqlite(tmp_path: Path) -> None:
    await kill_mid_wait(sqlite_url(tmp_path / "chaos.db"))


@pytest.mark.chaos
@pytest.mark.redis
async def test_engine_killed_while_the_parent_waits_on_redis(redis_url: str) -> None:
    await kill_mid_wait(redis_url)


@pytest.mark.chaos
@pytest.mark.postgres
async def test_engine_killed_while_the_parent_waits_on_postgres(postgres_schema_url: str) -> None:
    await kill_mid_wait(postgres_schema_url)


if __name__ == "__main__":
    url, engine_id, start = sys.argv[1:4]
    trio.run(engine_process, url, engine_id, start == "1")
