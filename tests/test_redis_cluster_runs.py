"""The run store on a Redis Cluster: a namespace's runs spread over run shards (so over every
master), paged, claimed, renewed and counted across all of them (the private 6-node cluster).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

import durable_trio as dt
from _redis_cluster import *  # noqa: F403  (the fixture; harmless once conftest imports it too)
from durable_trio._engine._stores._shard_paging import (
    DONE,
    ShardPage,
    decode_bounds,
    encode_bounds,
    merge_shards,
)
from durable_trio._engine._stores.redis import RedisRunStore
from durable_trio._redis import open_redis_cluster
from durable_trio.backends.redis import CLUSTER_RUN_SHARDS

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from _redis_cluster import RedisCluster

pytestmark = pytest.mark.redis


def record(run_id: str, status: dt.RunStatus = dt.RunStatus.PENDING) -> dt.RunRecord:
    return dt.RunRecord(run_id, "order", None, status, 0.0, 0.0)


@pytest.fixture
async def store(redis_cluster_url: str) -> AsyncIterator[RedisRunStore]:
    async with open_redis_cluster(redis_cluster_url) as client:
        yield RedisRunStore(client, "shop", shards=CLUSTER_RUN_SHARDS)


async def test_a_namespaces_runs_spread_over_every_master_each_run_in_one_slot(
    redis_cluster: RedisCluster, store: RedisRunStore
) -> None:
    for n in range(48):
        await store.create_run(record(f"r{n}"))
        await store.begin_step(
            dt.StepRecord(f"r{n}", "1", dt.StepKind.REMOTE, "s", dt.StepState.PENDING, 1)
        )
    per_master = [int(m.command("DBSIZE")) for m in redis_cluster.masters()]
    assert all(count > 0 for count in per_master), per_master
    for n in range(48):
        keys = {
            store._run_key(f"r{n}"),
            store._steps_key(f"r{n}"),
            store._step_key(f"r{n}", "1"),
        }
        assert len({redis_cluster.keyslot(key) for key in keys}) == 1
    assert (await store.count_runs()) == {dt.RunStatus.PENDING: 48}


async def test_pages_over_every_shard_stay_stable_while_runs_are_created(
    store: RedisRunStore,
) -> None:
    for n in range(40):
        await store.create_run(record(f"r{n:02}"))
    seen: list[str] = []
    cursor = None
    late = 0
    while True:
        page = await store.page_runs(limit=7, cursor=cursor)
        seen += [r.run_id for r in page.runs]
        for _ in range(3):  # new runs in whatever shards while someone pages
            await store.create_run(record(f"late{late}"))
            late += 1
        cursor = page.next_cursor
        if cursor is None:
            break
    assert seen == [f"r{n:02}" for n in reversed(range(40))]
    first = await store.page_runs(limit=100)
    assert len(first.runs) == 40 + late
    assert first.runs[0].run_id == f"late{late - 1}"


async def test_claims_respect_their_limit_across_shards_and_renew_and_release_per_shard(
    store: RedisRunStore,
) -> None:
    for n in range(20):
        await store.create_run(record(f"r{n}"))
    first = await store.claim_runs("engine-a", 30.0, limit=7)
    assert len(first) == 7
    rest = await store.claim_runs("engine-a", 30.0, limit=100)
    assert len(rest) == 13
    ids = {r.run_id for r in first + rest}
    assert len(ids) == 20
    assert await store.claim_runs("engine-b", 30.0) == []
    assert await store.renew_runs("engine-a", sorted(ids), 30.0) == ids
    assert await store.renew_runs("engine-b", sorted(ids), 30.0) == set()
    await store.release_runs("engine-a", sorted(ids))
    assert len(await store.claim_runs("engine-b", 30.0, limit=100)) == 20
    assert (await store.count_runs()) == {dt.RunStatus.RUNNING: 20}
    running = await store.list_runs(status=dt.RunStatus.RUNNING, limit=5)
    assert len(running) == 5


async def test_a_cursor_that_is_not_this_stores_is_a_clear_error(store: RedisRunStore) -> None:
    for n in range(3):
        await store.create_run(record(f"r{n}"))
    page = await store.page_runs(limit=1)
    assert page.next_cursor is not None
    assert page.next_cursor.startswith("r2.")
    one_shard = "r1.MTA"  # a single-server store's cursor
    for bad in (one_shard, "r2.!!!", "r2.MSwy", "garbage"):
        with pytest.raises(dt.ConfigError, match="cursor"):
            await store.page_runs(cursor=bad)
    with pytest.raises(dt.ConfigError, match="shards"):
        RedisRunStore(store._client, "shop", shards=0)


def test_merging_takes_a_prefix_of_each_shard_newest_created_first() -> None:
    def run(n: int) -> dt.RunRecord:
        return dt.RunRecord(f"r{n}", "w", None, dt.RunStatus.PENDING, float(n), float(n))

    pages = {
        0: ShardPage([(5.0, 3, run(5)), (2.0, 2, run(2))], following=None),
        1: ShardPage([(4.0, 9, run(4)), (3.0, 8, run(3))], following=7),
        2: ShardPage([(1.0, 4, run(1))], following=None),
    }
    taken, bounds = merge_shards(pages, [None, None, None, DONE], 3)
    assert [r.run_id for r in taken] == ["r5", "r4", "r3"]
    # shard 0: one of two taken; 1: all taken, goes on from its scan; 2: pinned above its run
    assert bounds == [3, 7, 5, DONE]


def test_shard_cursors_round_trip_and_all_done_is_the_last_page() -> None:
    bounds: list[int | None] = [12, DONE, 7, 1]
    cursor = encode_bounds(bounds)
    assert cursor is not None
    assert decode_bounds(cursor, 4) == bounds
    assert decode_bounds(None, 3) == [None, None, None]
    assert encode_bounds([DONE, DONE]) is None
    with pytest.raises(dt.ConfigError, match="cursor"):
        decode_bounds(cursor, 5)  # a store of another shard count
