"""The backend on a Redis Cluster (``redis+cluster://``): the broker, its sharded doorbells, the
checks and listings that span queues, and the key store, on the private 6-node cluster.

The real clock throughout (the servers' own timing is involved); every wait is bounded. Tests
look the topology up (a failover swaps a master and its replica) and never assume it.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import pytest
import trio

import durable_trio as dt
from _redis_cluster import *  # noqa: F403  (the fixture; harmless once conftest imports it too)
from durable_trio._errors import BrokerError, BrokerUnavailable, ConfigError
from durable_trio._redis import key_slot, open_redis_cluster
from durable_trio.brokers import Job, SupportsFailAndPush
from durable_trio.brokers.redis import RedisBroker, RedisClusterBroker
from durable_trio.keys.redis import RedisKeyStore

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from _redis_cluster import ClusterNode, RedisCluster

pytestmark = pytest.mark.redis


def job(n: int | str) -> Job:
    return Job(f"job-{n}", f'{{"n":"{n}"}}'.encode())


def queue_on(cluster: RedisCluster, master: ClusterNode, prefix: str) -> str:
    """A queue name whose slot (its ``{name}`` tag) ``master`` serves now."""
    for index in range(100_000):
        name = f"{prefix}:{index}"
        if cluster.owner(key_slot(name)) is master:
            return name
    raise AssertionError("no queue name found")


def queue_per_master(cluster: RedisCluster, prefix: str) -> list[str]:
    return [queue_on(cluster, m, f"{prefix}{i}") for i, m in enumerate(cluster.masters())]


@asynccontextmanager
async def a_job_on_each(url: str, queues: list[str]) -> AsyncIterator[RedisClusterBroker]:
    """The broker of ``open_backend(url)``, one job pushed on each of ``queues``."""
    async with dt.open_backend(url) as backend:
        broker = backend.broker
        assert isinstance(broker, RedisClusterBroker)
        for n, queue in enumerate(queues):
            await broker.push_on(queue, job(n))
        yield broker


async def subscribed_on_its_master(cluster: RedisCluster, queue: str) -> None:
    """Until the master of ``queue``'s slot counts one subscriber of its sharded doorbell."""
    owner = cluster.owner(key_slot(queue))
    channel = f"{{{queue}}}:doorbell@0"
    while owner.command("PUBSUB", "SHARDNUMSUB", channel)[1] != 1:  # noqa: ASYNC110 (a poll)
        await trio.sleep(0.01)


async def test_open_backend_on_a_cluster_url_gives_broker_key_store_and_run_stores(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    async with dt.open_backend(redis_cluster_url) as backend:
        assert isinstance(backend.broker, RedisClusterBroker)
        assert isinstance(backend.keys, RedisKeyStore)
        assert backend.url == redis_cluster_url
        await backend.broker.push_on("q", job(1))
        claimed = await backend.broker.pop_from("q")
        assert claimed is not None
        assert claimed.id == "job-1"
        await backend.keys.put("worker:a", b"alive", 30)
        assert [e.key for e in await backend.keys.entries("worker:")] == ["worker:a"]
        async with backend.open_run_store("shop") as store:
            record = dt.RunRecord(
                run_id="r1", workflow="w", input=1, status=dt.RunStatus.PENDING,
                created_at=0.0, updated_at=0.0,
            )  # fmt: skip
            await store.create_run(record)
            found = await store.get_run("r1")
            assert found is not None
            assert found.input == 1


async def test_queues_spread_over_the_masters_each_in_one_slot(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    queues = queue_per_master(redis_cluster, "spread")
    async with dt.open_backend(redis_cluster_url) as backend:
        for n, queue in enumerate(queues):
            await backend.broker.push_on(queue, job(n), delay=60 if n == 0 else 0)
            await backend.broker.pop_from(queue) if n == 1 else None
    for queue, master in zip(queues, redis_cluster.masters(), strict=True):
        keys = master.command("KEYS", f"{{{queue}}}:*")
        assert keys, queue
        assert {redis_cluster.keyslot(k) for k in keys} == {key_slot(queue)}
        # Nothing of another queue here (the store's identity lives on one master).
        identity = master.command("KEYS", "{durable-trio}:*")
        assert master.command("DBSIZE") == len(keys) + len(identity)


async def test_a_waiter_on_each_master_wakes_on_its_push_through_a_sharded_doorbell(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    queues = queue_per_master(redis_cluster, "bell")
    woke: dict[str, float] = {}
    async with (
        open_redis_cluster(redis_cluster_url) as client,
        RedisClusterBroker(client, safety_poll_interval=60) as broker,
    ):
        for queue in queues:
            assert await broker.pop_from(queue) is None

        async def waiter(queue: str) -> None:
            await broker.wait_for_work(queue)
            woke[queue] = trio.current_time()

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                for queue in queues:
                    nursery.start_soon(waiter, queue)
                for queue in queues:  # each subscribed on its own master
                    await subscribed_on_its_master(redis_cluster, queue)
                assert woke == {}
                pushed = trio.current_time()
                for n, queue in enumerate(queues):
                    await broker.push_on(queue, job(n))
        assert sorted(woke) == sorted(queues)
        assert max(woke.values()) - pushed < 1.0
        assert broker.statistics().subscriptions == len(queues)


async def test_sweep_hint_reads_the_claim_flags_of_queues_on_every_master(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    queues = queue_per_master(redis_cluster, "hint")
    async with a_job_on_each(redis_cluster_url, queues) as broker:
        assert await broker.queues_with_claims(queues) == []
        for queue in queues[1:]:
            await broker.pop_from(queue)
        assert await broker.queues_with_claims(queues) == queues[1:]
        assert await broker.queues_with_claims([]) == []


async def test_the_safety_check_finds_an_armed_flag_gone_on_any_master(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    """The doorbell lost (here: never rung, the flag deleted behind the broker's back): the
    per-master read of the armed flags returns the waiter at the next safety tick."""
    queues = queue_per_master(redis_cluster, "safety")
    async with (
        open_redis_cluster(redis_cluster_url) as client,
        RedisClusterBroker(client, safety_poll_interval=0.3) as broker,
    ):
        returned: list[str] = []

        async def waiter(queue: str) -> None:
            await broker.wait_for_work(queue)
            returned.append(queue)

        for queue in queues:
            assert await broker.pop_from(queue) is None  # arms
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                for queue in queues:
                    nursery.start_soon(waiter, queue)
                await trio.sleep(0.8)  # a few safety ticks: every flag still set
                assert returned == []
                await client.execute("DEL", f"{{{queues[-1]}}}:armed")
                await trio.sleep(0.8)
                nursery.cancel_scope.cancel()
        assert returned == [queues[-1]]


async def test_listings_scan_every_master(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    queues = queue_per_master(redis_cluster, "list")
    async with a_job_on_each(redis_cluster_url, queues) as broker:
        claimed = await broker.pop_from(queues[0])
        assert claimed is not None
        assert await broker.waiting_queues("list") == sorted(queues[1:])
        assert await broker.known_queues("list") == sorted(queues)
        assert await broker.known_queues("nothing") == []
        stats = await broker.queue_stats(queues[0])
        assert (stats.ready, stats.claimed) == (0, 1)


async def test_a_cluster_client_needs_the_cluster_broker_which_has_no_fail_and_push(
    redis_cluster_url: str,
) -> None:
    async with open_redis_cluster(redis_cluster_url) as client:
        with pytest.raises(ConfigError, match="RedisClusterBroker"):
            RedisBroker(client)
        async with RedisClusterBroker(client) as broker:
            # Two queues are two slots: no atomic fail-and-push (the transport then fails first
            # and republishes the result until it lands).
            assert not isinstance(broker, SupportsFailAndPush)


async def test_a_damaged_queue_fails_its_own_calls_and_no_other_queue_or_loop(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    bad, good = queue_per_master(redis_cluster, "damage")[:2]
    errors: list[Exception] = []
    async with (
        open_redis_cluster(redis_cluster_url) as client,
        RedisClusterBroker(client, on_error=errors.append, safety_poll_interval=0.2) as broker,
    ):
        await broker.push_on(bad, job(1))
        await client.execute("DEL", f"{{{bad}}}:ready")
        await client.execute("SET", f"{{{bad}}}:ready", "not a zset")
        with pytest.raises(BrokerError, match="WRONGTYPE"):
            await broker.pop_from(bad)
        assert await client.execute("GET", f"{{{bad}}}:ready") == b"not a zset"  # untouched
        await broker.push_on(good, job(2))
        claimed = await broker.pop_from(good)
        assert claimed is not None
        assert claimed.id == "job-2"
        with trio.fail_after(3):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(broker.wait_for_work, good)
                await trio.sleep(0.3)
                await broker.push_on(good, job(3))
        assert await broker.known_queues("damage") == sorted([bad, good])


@pytest.mark.chaos
async def test_a_waiter_wakes_on_a_push_after_its_queues_master_is_killed(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    """kill -9 of the master of a waited queue: the sharded doorbell follows the failover
    (rings its queue when it subscribes again), and a push after it wakes the waiter."""
    await trio.to_thread.run_sync(redis_cluster.wait_replicas_synced)
    victim = redis_cluster.masters()[0]
    queue = queue_on(redis_cluster, victim, "failover")
    async with (
        open_redis_cluster(redis_cluster_url, retries=3) as client,
        RedisClusterBroker(client, safety_poll_interval=60) as broker,
    ):
        assert await broker.pop_from(queue) is None
        wakes: list[float] = []

        async def waiter() -> None:
            while True:
                await broker.wait_for_work(queue)
                wakes.append(time.monotonic())
                try:
                    if await broker.pop_from(queue) is not None:
                        return
                except BrokerUnavailable:
                    await trio.sleep(0.1)

        with trio.fail_after(40):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                await subscribed_on_its_master(redis_cluster, queue)
                victim.stop(kill=True)
                killed = time.monotonic()
                while True:  # the slot is served again once a replica took over
                    try:
                        await broker.push_on(queue, job("after"))
                        break
                    except BrokerUnavailable:
                        await trio.sleep(0.05)
                served = time.monotonic() - killed
        print(f"\nkill -9 -> push accepted {served:.2f}s, waiter done {wakes[-1] - killed:.2f}s")
    await trio.to_thread.run_sync(redis_cluster.start)


async def test_worker_liveness_and_group_health_read_the_key_store_on_a_cluster(
    redis_cluster_url: str,
) -> None:
    """The worker-key store on a Cluster (one hash tag, one slot): a worker's liveness key and
    descriptor are seen by another process's health read, and withdrawn when it closes."""
    release = trio.Event()

    async def slow(task: dt.RemoteTask) -> None:
        await release.wait()

    async with (
        dt.open_backend(redis_cluster_url) as backend,
        dt.open_queue_transport(backend, instance_id="engine") as engine,
    ):
        async with dt.open_queue_transport(
            backend, instance_id="w1", concurrency=2, prefetch=0
        ) as worker:
            worker.handle("resize", slow)
            for n in range(3):
                task = dt.RemoteTask(run_id="r", step_id=f"s{n}", attempt=1, name="resize")
                await engine.dispatch(task)
            with trio.fail_after(10):
                while True:
                    health = await engine.health.group_health("resize")
                    if health is not None and health.live_workers and health.depth == 1:
                        break
                    await trio.sleep(0.05)
            assert [w.instance for w in health.live_workers] == ["w1"]
            release.set()
        health = await engine.health.group_health("resize")
        assert health is not None
        assert health.live_workers == ()  # withdrawn at once on close
