"""Resharding under a live workflow on the private Redis Cluster (real clock, bounded): the slots
of the task queue, the results queue and the runs' store shards move to another master while
runs are in flight (``SETSLOT MIGRATING/IMPORTING``, ``MIGRATE``, ``SETSLOT NODE``); every run
completes, nothing is lost. The backend runs with ``min_replicas=1`` (every master has a
replica): each write also waits for its replica, on the node that took it."""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

import pytest
import trio

import durable_trio as dt
from _redis_cluster import *  # noqa: F403  (the fixture; harmless once conftest imports it too)
from durable_trio._engine import App, WorkflowContext, open_engine, open_run_store, open_worker
from durable_trio._redis._keyslot import key_slot
from helpers import completed_steps
from test_redis_cluster import _begin_migration, _end_migration, _move_keys

if TYPE_CHECKING:
    from _redis_cluster import ClusterNode, RedisCluster

pytestmark = pytest.mark.redis

NAMESPACE = "reshard"
RUNS = [f"r{n}" for n in range(8)]
app = App("reshard")
EXECUTIONS: Counter[str] = Counter()


@app.step("slow")
async def slow(job: tuple[int, str]) -> str:
    n, part = job
    EXECUTIONS[f"{part}:{n}"] += 1
    await trio.sleep(0.3)  # long enough that the moves meet steps in flight
    return f"{part}-{n}"


@app.workflow("two_parts")
async def two_parts(ctx: WorkflowContext, n: int) -> list[str]:
    first = await ctx.step("slow", (n, "a"))
    await ctx.sleep(0.2)
    return [first, await ctx.step("slow", (n, "b"))]


def _move(cluster: RedisCluster, slot: int) -> None:
    """Move ``slot`` from its master to the next one, the way ``redis-cli --cluster reshard``
    does (keys written meanwhile are followed through ``ASK``)."""
    source = cluster.owner(slot)
    masters = cluster.masters()
    target: ClusterNode = masters[(masters.index(source) + 1) % len(masters)]
    _begin_migration(slot, source, target)
    time.sleep(0.05)  # traffic meets the half-done migration
    _move_keys(slot, source, target)
    _end_migration(cluster, slot, target)


def _calls(node: ClusterNode, command: str) -> int:
    """How many times ``node`` ran ``command`` since its stats were reset."""
    for line in node.command("INFO", "commandstats").decode().splitlines():
        if line.startswith(f"cmdstat_{command}:calls="):
            return int(line.split("=", 1)[1].split(",", 1)[0])
    return 0


@pytest.mark.chaos
async def test_a_run_in_flight_completes_while_its_queue_and_run_shard_slots_move(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    EXECUTIONS.clear()
    await trio.to_thread.run_sync(redis_cluster.wait_replicas_synced)
    for node in redis_cluster.masters():
        node.command("CONFIG", "RESETSTAT")
    slots = sorted(
        {
            key_slot(f"{{{NAMESPACE}:tasks:slow}}"),
            key_slot(f"{{{NAMESPACE}:results}}"),
            # the run shards of the runs (see RedisRunStore: a hash tag per shard)
            *(key_slot(f"{{dt-runs:{NAMESPACE}:{k}}}") for k in range(16)),
        }
    )
    url = f"{redis_cluster_url}?min_replicas=1&replica_timeout=2"
    async with (
        dt.open_backend(url) as backend,
        open_worker(app, backend, namespace=NAMESPACE, concurrency=8),
        open_engine(
            app, backend, namespace=NAMESPACE, run_lease=1.0, reconcile_interval=0.2
        ) as engine,
        open_run_store(backend, NAMESPACE) as store,
    ):
        for n, run_id in enumerate(RUNS):
            await engine.start("two_parts", n, run_id=run_id)
        with trio.fail_after(20):
            while not await completed_steps(store, RUNS):  # noqa: ASYNC110 (a poll)
                await trio.sleep(0.01)
        began = time.monotonic()
        for slot in slots:  # while runs are in flight
            await trio.to_thread.run_sync(_move, redis_cluster, slot)
        moved = time.monotonic() - began
        with trio.fail_after(60):
            outputs = {run_id: await engine.result(run_id) for run_id in RUNS}
        steps_done = len(await completed_steps(store, RUNS))
    duplicates = sum(count - 1 for count in EXECUTIONS.values())
    waits = sum(_calls(node, "wait") for node in redis_cluster.masters())
    print(
        f"\n{len(slots)} slots moved in {moved:.2f}s under {len(RUNS)} runs in flight: "
        f"{len(outputs)} runs completed, {steps_done} steps checkpointed, "
        f"{duplicates} duplicate step executions, {waits} WAITs on the masters"
    )
    assert waits > 0  # the writes waited for their replicas, on the masters that took them
    assert outputs == {f"r{n}": [f"a-{n}", f"b-{n}"] for n in range(len(RUNS))}
    assert steps_done == 2 * len(RUNS)
    assert all(count >= 1 for count in EXECUTIONS.values())
    assert len(EXECUTIONS) == 2 * len(RUNS)
