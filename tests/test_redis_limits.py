"""The Redis broker's fleet-wide limits beyond the shared contract (tests/test_broker_limits.py):
the key layout (``{Q}:limit``, ``{Q}:held``, ``{Q}:parked``), damaged limit data, a parked
key's jobs kept in their order, the bounded walk, the cost of a claim at the limit, and a
limited step served by two workers, end to end. A private ``redis-server``, the real clock.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from durable_trio._errors import DamagedJob
from durable_trio._redis import open_redis
from durable_trio.brokers import Job
from durable_trio.brokers.redis import RedisBroker

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from durable_trio._redis import RedisClient

pytestmark = pytest.mark.redis

Q = "app:tasks:limited"


def job(n: int | str, key: str | None = None) -> Job:
    return Job(f"job-{n}", f'{{"n":"{n}"}}'.encode(), key)


def k(part: str) -> str:
    return f"{{{Q}}}:{part}"


@asynccontextmanager
async def open_broker(url: str, **options: Any) -> AsyncIterator[tuple[RedisClient, RedisBroker]]:
    async with open_redis(url) as client, RedisBroker(client, **options) as broker:
        yield client, broker


async def test_the_limit_and_the_held_entries_are_keys_of_the_queue(redis_url: str) -> None:
    async with open_broker(redis_url) as (client, broker):
        await broker.set_queue_limit(Q, 1, per_key=True)
        assert await client.execute("HGETALL", k("limit")) == [b"max", b"1", b"per_key", b"1"]
        await broker.push_on(Q, job(1, "acct-1"))
        await broker.push_on(Q, job(2, "acct-1"))
        await broker.push_on(Q, job(3))
        claims = await broker.pop_many(Q, 5)
        assert [c.id for c in claims] == ["job-1", "job-3"]
        held = await client.execute("ZRANGE", k("held"), 0, -1)
        # one entry per live lease: the key's byte length, the key, the token
        assert sorted(held) == sorted(
            [f"6:acct-1:{claims[0].lease.token}".encode(), f"0::{claims[1].lease.token}".encode()]
        )
        assert await client.execute("ZCARD", k("parked")) == 1  # job-2, behind acct-1
        assert await client.execute("ZCARD", k("ready")) == 0
        stats = await broker.queue_stats(Q)
        assert (stats.ready, stats.claimed, stats.limit, stats.per_key) == (1, 2, 1, True)
        assert stats.oldest_ready_age is not None  # (the parked job's push time)
        assert await broker.complete_job(claims[0].lease, Q)
        assert await client.execute("ZCARD", k("parked")) == 0  # back to ready
        assert await broker.complete_job(claims[1].lease, Q)
        assert await client.execute("EXISTS", k("held"), k("full")) == 0
        [last] = await broker.pop_many(Q, 5)
        assert last.id == "job-2"
        assert await broker.complete_job(last.lease, Q)
        # The job's key went with it.
        assert await client.execute("HLEN", k("jobs")) == 0
        # No limit: the keys go, nothing is counted any more.
        await broker.set_queue_limit(Q, None)
        assert await client.execute("EXISTS", k("limit"), k("held"), k("parked")) == 0
        assert (await broker.queue_stats(Q)).limit is None


async def test_a_parked_key_keeps_its_jobs_priority_and_push_order(redis_url: str) -> None:
    async with open_broker(redis_url) as (_, broker):
        await broker.set_queue_limit(Q, 1, per_key=True)
        await broker.push_on(Q, job("first", "a"))
        held = await broker.pop_from(Q)
        assert held is not None
        for n, priority in [(1, 5), (2, 0), (3, -(2**53)), (4, 2**53), (5, 0), (6, -3)]:
            await broker.push_on(Q, job(n, "a"), priority=priority)
        assert await broker.pop_many(Q, 10) == []  # every one parked
        order = []
        lease = held.lease
        for _ in range(6):
            assert await broker.complete_job(lease, Q)
            [claim] = await broker.pop_many(Q, 10)
            order.append(claim.id)
            assert claim.priority in (5, 0, -(2**53), 2**53, -3)
            lease = claim.lease
        assert order == ["job-3", "job-6", "job-2", "job-5", "job-1", "job-4"]


async def test_an_unreadable_limit_is_quarantined_reported_and_no_limit(redis_url: str) -> None:
    async with open_broker(redis_url) as (client, broker):
        for n in range(3):
            await broker.push_on(Q, job(n))
        await client.execute("HSET", k("limit"), "max", "ten", "per_key", "1")
        assert (await broker.queue_stats(Q)).limit is None
        claims = await broker.pop_many(Q, 5)
        reports = [c for c in claims if not c.lease.token]
        assert [c.damage for c in reports] == [
            "limit unreadable, removed (no limit until one is set again)"
        ]
        assert [c.id for c in claims if c.lease.token] == ["job-0", "job-1", "job-2"]
        assert await client.execute("EXISTS", k("limit")) == 0
        [entry] = await broker.quarantined(Q)
        assert entry.reason.startswith("limit unreadable")
        assert b"limit max (3 bytes): ten" in entry.raw
        # A limit key of another type: the same (never a script error on every claim).
        await client.execute("SET", k("limit"), "junk")
        await broker.push_on(Q, job(9))
        assert (await broker.queue_stats(Q)).limit is None
        claims = await broker.pop_many(Q, 5)
        assert [c.id for c in claims if c.lease.token] == ["job-9"]
        assert await client.execute("EXISTS", k("limit")) == 0
        assert (await broker.quarantined(Q))[0].raw == b"limit key: a string, not a hash\n"
        # The transport's report of a quarantined entry is a DamagedJob like any other.
        assert issubclass(DamagedJob, dt.DurableTrioError)


async def test_a_stray_held_entry_never_holds_a_key_full(redis_url: str) -> None:
    """A held entry whose lease is gone (damage: written by hand, a script of an older version)
    is found and dropped by the claim it would hold back."""
    async with open_broker(redis_url) as (client, broker):
        await broker.set_queue_limit(Q, 1, per_key=True)
        await client.execute("ZADD", k("held"), 0, "1:a:77:deadbeefdeadbeef")
        await broker.push_on(Q, job(1, "a"))
        claim = await broker.pop_from(Q)
        assert claim is not None
        assert claim.id == "job-1"
        assert await client.execute("ZRANGE", k("held"), 0, -1) == [
            f"1:a:{claim.lease.token}".encode()
        ]


async def test_a_lease_whose_key_field_was_lost_still_frees_its_key(redis_url: str) -> None:
    """The job's stored key deleted while it is claimed (damage): its held entry is found by
    its token when the lease ends, and the next job of its key is unparked."""
    async with open_broker(redis_url) as (client, broker):
        await broker.set_queue_limit(Q, 1, per_key=True)
        await broker.push_on(Q, job(1, "a"))
        await broker.push_on(Q, job(2, "a"))
        one = await broker.pop_from(Q)
        assert one is not None
        assert await broker.pop_from(Q) is None
        n = one.lease.token.split(":")[0]
        assert await client.execute("HDEL", k("jobs"), f"k{n}") == 1
        assert await broker.complete_job(one.lease, Q)
        assert await client.execute("EXISTS", k("held")) == 0
        two = await broker.pop_from(Q)
        assert two is not None
        assert two.id == "job-2"


async def test_a_claim_walks_a_bounded_number_of_full_key_jobs(redis_url: str) -> None:
    """Past WALK_MAX jobs of full keys a claim returns, saying "look again at once" (due in 0
    seconds); the next claim goes on from where the parking left off."""
    from durable_trio.brokers.redis._slots import WALK_MAX

    async with open_broker(redis_url) as (client, broker):
        await broker.set_queue_limit(Q, 1, per_key=True)
        await broker.push_on(Q, job("hot", "hot"))
        assert await broker.pop_from(Q) is not None
        await broker.push_many(
            Q, [job(n, "hot") for n in range(WALK_MAX + 10)], [None] * (WALK_MAX + 10)
        )
        await broker.push_on(Q, job("cold", "cold"))
        reply = await broker._scripts.claim(
            broker._queue(Q).claim_keys, broker._claim_argv(1, 1, "w")
        )
        assert reply == [b"0"]
        assert await client.execute("ZCARD", k("parked")) == WALK_MAX
        claim = await broker.pop_from(Q)
        assert claim is not None
        assert claim.id == "job-cold"
        assert await client.execute("ZCARD", k("parked")) == WALK_MAX + 10


async def test_the_same_limit_stored_again_changes_nothing(redis_url: str) -> None:
    async with open_broker(redis_url) as (client, broker):
        await broker.set_queue_limit(Q, 1, per_key=True)
        await broker.push_on(Q, job(1, "a"))
        await broker.push_on(Q, job(2, "a"))
        assert await broker.pop_from(Q) is not None
        assert await broker.pop_from(Q) is None
        await broker.set_queue_limit(Q, 1, per_key=True)  # (a second worker opening)
        assert await client.execute("ZCARD", k("parked")) == 1
        await broker.set_queue_limit(Q, 2, per_key=True)  # a new limit: every job looked at anew
        assert await client.execute("ZCARD", k("parked")) == 0
        assert (await broker.pop_from(Q)) is not None


async def test_a_failed_record_keeps_the_key_and_reads_as_before(redis_url: str) -> None:
    async with open_broker(redis_url) as (_, broker):
        await broker.push_on(Q, job(1, "ключ"))
        claim = await broker.pop_from(Q)
        assert claim is not None
        assert await broker.fail_job(claim.lease, Q, "boom")
        [failed] = await broker.failed_jobs(Q)
        assert (failed.id, failed.data, failed.error) == ("job-1", b'{"n":"1"}', "boom")


async def test_two_workers_never_run_a_limited_step_past_its_limit(redis_url: str) -> None:
    """End to end on Redis: open_worker stores the step's limit (no refusal any more), and two
    workers of concurrency 8 run at most 2 at once."""
    app = dt.App("limits")
    running = {"now": 0, "most": 0}

    @app.step("partner", max_concurrency=2)
    async def partner(n: int) -> int:
        running["now"] += 1
        running["most"] = max(running["most"], running["now"])
        await trio.sleep(0.02)
        running["now"] -= 1
        return n

    @app.workflow("fan")
    async def fan(ctx: dt.WorkflowContext, n: int) -> list[int]:
        async with trio.open_nursery() as nursery:
            out: list[int] = []

            async def one(i: int) -> None:
                out.append(await ctx.step("partner", i))

            for i in range(n):
                nursery.start_soon(one, i)
        return sorted(out)

    async with dt.open_backend(redis_url) as backend:
        async with (
            dt.open_worker(app, backend, concurrency=8),
            dt.open_worker(app, backend, concurrency=8),
            dt.open_engine(app, backend) as engine,
        ):
            with trio.fail_after(30):
                run_id = await engine.start("fan", 12)
                assert await engine.result(run_id) == list(range(12))
            async with dt.open_operations(backend, namespace="limits") as ops:
                limits = {v.group: (v.limit, v.per_key) for v in await ops.queues()}
    assert running["most"] == 2
    assert limits["partner"] == (2, False)


async def test_a_parked_key_whose_slots_came_back_unseen_is_rescued(redis_url: str) -> None:
    """Damage: a full key's lease vanished without its script (its token deleted by hand), so
    no lease end will unpark its jobs. A claim that runs out of ready jobs probes the parked
    keys, finds that one's slots free, and puts its first job back."""
    async with open_broker(redis_url) as (client, broker):
        await broker.set_queue_limit(Q, 1, per_key=True)
        await broker.push_on(Q, job(1, "a"))
        await broker.push_on(Q, job(2, "a"))
        one = await broker.pop_from(Q)
        assert one is not None
        assert await broker.pop_from(Q) is None  # job-2 parked
        assert await client.execute("ZREM", k("active"), one.lease.token) == 1
        assert await broker.pop_from(Q) is None  # (the probe unparks it: look again)
        claim = await broker.pop_from(Q)
        assert claim is not None
        assert claim.id == "job-2"
