"""The Redis broker and key store beyond the shared contract: key layout, the server clock,
bounded work, the doorbell, reconnection and cost, against a private ``redis-server``.

The real clock throughout, with short durations (``autojump_clock`` would count socket waits as
idle time).
"""

from __future__ import annotations

import logging
import random
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest
import trio

from durable_trio._errors import BrokerError, BrokerUnavailable
from durable_trio._redact import redact_url
from durable_trio._redis import open_redis
from durable_trio.backends.redis import open_redis_backend
from durable_trio.brokers import ClaimedJob, Job, SupportsBatchPop
from durable_trio.brokers.redis import MAX_PRIORITY, MIN_PRIORITY, PROMOTE_BATCH, RedisBroker
from durable_trio.keys import redis as redis_keys
from durable_trio.keys.redis import RedisKeyStore

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from _redis_server import RedisServer
    from durable_trio._redis import RedisClient

pytestmark = pytest.mark.redis

Q = "app:tasks:redis"


def job(n: int | str) -> Job:
    return Job(f"job-{n}", f'{{"n":"{n}"}}'.encode())


@asynccontextmanager
async def open_broker(url: str, **options: Any) -> AsyncIterator[tuple[RedisClient, RedisBroker]]:
    async with open_redis(url) as client, RedisBroker(client, **options) as broker:
        yield client, broker


def command_calls(server: RedisServer) -> dict[str, int]:
    """``INFO commandstats`` as ``{command: calls}`` (scripts' own commands included)."""
    text: bytes = server.command("INFO", "commandstats")
    calls: dict[str, int] = {}
    for line in text.decode().splitlines():
        if line.startswith("cmdstat_"):
            name, _, fields = line.partition(":")
            stats = dict(item.split("=") for item in fields.split(","))
            calls[name.removeprefix("cmdstat_")] = int(stats["calls"])
    return calls


def commands_since(server: RedisServer, before: dict[str, int]) -> dict[str, int]:
    """Commands run since ``before`` was taken, not counting ``INFO`` itself."""
    after = command_calls(server)
    return {
        name: count - before.get(name, 0)
        for name, count in after.items()
        if name != "info" and count != before.get(name, 0)
    }


def crc16(data: bytes) -> int:
    """CRC-16/XMODEM, the checksum of Redis Cluster's key slots."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def key_slot(key: bytes) -> int:
    """The Cluster slot of ``key`` (``CLUSTER KEYSLOT``), hash tags included."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return crc16(key) % 16384


async def until(predicate: Any, *, within: float = 5.0) -> None:
    with trio.fail_after(within):
        while True:
            if predicate():
                return
            await trio.sleep(0.01)


# -- layout and clock ------------------------------------------------------------------------


async def test_every_key_of_a_queue_lives_under_its_hash_tag(
    redis_url: str, redis_server: RedisServer
) -> None:
    queues = [Q, "other:queue"]
    async with open_broker(redis_url) as (_, broker):
        for queue in queues:
            await broker.push_on(queue, job(1))
            await broker.push_on(queue, job(2))
            await broker.push_on(queue, job("later"), delay=30)
            one = await broker.pop_from(queue, worker="w")
            two = await broker.pop_from(queue, worker="w")
            assert one is not None
            assert two is not None
            await broker.fail_job(one.lease, queue, "boom")
            await broker.recover_stalled_jobs(queue, 0.0, 0)  # two: stalled, poison
            assert await broker.pop_from(queue) is None  # arms the doorbell
    keys: list[bytes] = redis_server.command("KEYS", "*")
    for queue in queues:
        tag = f"{{{queue}}}:".encode()
        mine = sorted(k for k in keys if k.startswith(tag))
        # Every part but "ready", which is empty (Redis drops empty keys).
        assert {k[len(tag) :].decode() for k in mine} == {
            "seq", "delayed", "active", "jobs", "meta", "stalls", "claims", "failed", "armed",
            "claimed",
        }  # fmt: skip
        assert {key_slot(k) for k in mine} == {key_slot(queue.encode())}
    # Nothing outside the two tags but the store's identity (stamped once per store).
    assert sorted(
        k for k in keys if not k.startswith(b"{other:queue}:") and Q not in k.decode()
    ) == [b"{durable-trio}:identity"]
    assert len(keys) == 21


async def test_push_times_live_in_the_job_hash_and_leave_with_the_job(
    redis_url: str, redis_server: RedisServer
) -> None:
    """Every push (one, many, delayed, a requeue, the poison bridge's) stores its push time
    as the ``t<n>`` field of the job hash, and every way out (complete, complete_many, fail,
    fail_and_push, a retry that fails a damaged job) takes it along: nothing is left behind."""
    other = Q + "-results"
    async with open_broker(redis_url) as (client, broker):
        await broker.push_on(Q, job(1))
        await broker.push_on(Q, job("later"), delay=0.05)
        await broker.push_many(Q, [job(2), job(3), job(4), job(5)], [None, None, None, None])
        fields = await client.execute("HKEYS", f"{{{Q}}}:jobs")
        assert sorted(fields) == sorted([b"1", b"2", b"3", b"4", b"5", b"6"] + [
            b"t" + n for n in (b"1", b"2", b"3", b"4", b"5", b"6")
        ])  # fmt: skip
        await trio.sleep(0.1)
        claims = await broker.pop_many(Q, 6)
        assert len(claims) == 6
        one, two, three, four, five, later = claims  # ("later" promoted: a fresh place)
        assert later.id == "job-later"
        assert await broker.complete_job(one.lease, Q)
        assert await broker.complete_many(Q, [later.lease, two.lease]) == [True, True]
        assert await broker.fail_job(three.lease, Q, "boom")
        assert await broker.fail_and_push(four.lease, Q, "poison", other, job("answer"))
        await client.execute("HSET", f"{{{Q}}}:meta", five.lease.token.split(":")[0], b"junk")
        assert await broker.retry_job(five.lease, Q)  # damaged meta: failed instead
        assert await broker.requeue_failed(Q, "job-3")
        again = await broker.pop_from(Q)
        assert again is not None
        assert await broker.complete_job(again.lease, Q)
        answer = await broker.pop_from(other)
        assert answer is not None
        assert await broker.complete_job(answer.lease, other)
        assert await client.execute("EXISTS", f"{{{Q}}}:jobs", f"{{{other}}}:jobs") == 0
        assert await client.execute("EXISTS", f"{{{Q}}}:moved") == 0  # ("later" left it)


async def test_the_oldest_age_costs_a_few_commands_however_long_the_queue(
    redis_url: str, redis_server: RedisServer
) -> None:
    """The oldest ready job is found wherever it sits in ``ready`` (a retried job keeps its
    first push time but goes to the back; newer jobs at a more urgent priority come first),
    by looking at the head of each priority and the lowest id of ``moved``: a few commands,
    never a walk of the queue."""
    async with open_broker(redis_url) as (client, broker):
        await broker.push_on(Q, job("first"))
        first = await broker.pop_from(Q)
        assert first is not None
        await trio.sleep(0.3)
        for start in range(0, 2500, 500):
            await broker.push_many(Q, [job(n) for n in range(start, start + 500)], [None] * 500)
        await broker.push_on(Q, job("urgent"), priority=-5)
        assert await broker.retry_job(first.lease, Q)  # to the back, its push time kept
        assert await client.execute("ZCARD", f"{{{Q}}}:moved") == 1
        before = command_calls(redis_server)
        stats = await broker.queue_stats(Q)
        used = commands_since(redis_server, before)
        assert stats.ready == 2502
        assert stats.oldest_ready_age is not None
        assert 0.3 <= stats.oldest_ready_age < 2.0
        # (a constant few: the counts, the heads, and since issue 33 the rate window's one
        # script (its TIME, HMGET and ZCOUNT), against 2,502 jobs)
        assert sum(used.values()) < 20, used
        claimed = await broker.pop_many(Q, 3000)
        assert claimed[-1].id == "job-first"
        assert await client.execute("EXISTS", f"{{{Q}}}:moved") == 0  # claimed: not moved now
        assert (await broker.queue_stats(Q)).oldest_ready_age is None


async def test_delays_are_measured_on_the_server_clock(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_broker(redis_url) as (_, broker):
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 3600.0)  # the client's clock is off
        await broker.push_on(Q, job("later"), delay=0.3)
        await trio.sleep(0.2)
        assert await broker.pop_from(Q) is None
        await trio.sleep(0.2)
        claimed = await broker.pop_from(Q)
        assert claimed is not None
        assert claimed.id == "job-later"


async def test_promotion_is_bounded_per_pop_and_keeps_fifo(
    redis_url: str, redis_server: RedisServer
) -> None:
    async with open_broker(redis_url) as (_, broker):
        for n in range(250):
            await broker.push_on(Q, job(n), delay=0.05)
        await trio.sleep(0.1)
        first = await broker.pop_from(Q)
        assert first is not None
        assert first.id == "job-0"
        assert redis_server.command("ZCARD", f"{{{Q}}}:delayed") == 250 - PROMOTE_BATCH
        assert redis_server.command("ZCARD", f"{{{Q}}}:ready") == PROMOTE_BATCH - 1
        rest = await broker.pop_many(Q, 1000)  # promotes one more batch, then claims
        assert len(rest) == 2 * PROMOTE_BATCH - 1
        rest += await broker.pop_many(Q, 1000)
        assert [c.id for c in [first, *rest]] == [f"job-{n}" for n in range(250)]


async def test_pop_many_claims_a_batch_in_one_round_trip(
    redis_url: str, redis_server: RedisServer
) -> None:
    async with open_broker(redis_url) as (_, broker):
        assert isinstance(broker, SupportsBatchPop)
        for n in range(60):
            await broker.push_on(Q, job(n), priority=n % 3)
        assert await broker.pop_many(Q, 0) == []
        assert await broker.pop_many(Q + ":warm", 1) == []  # the script is cached now
        before = command_calls(redis_server)
        claimed = await broker.pop_many(Q, 50, worker="w1")
        used = commands_since(redis_server, before)
    assert used.get("evalsha", 0) + used.get("eval", 0) == 1
    expected = sorted(range(60), key=lambda n: (n % 3, n))[:50]
    assert [c.id for c in claimed] == [f"job-{n}" for n in expected]
    assert [c.priority for c in claimed] == [n % 3 for n in expected]
    assert len({c.lease.token for c in claimed}) == 50
    assert len({c.lease.token.partition(":")[2] for c in claimed}) == 50  # random per claim


async def test_priorities_cover_the_exact_double_range(redis_url: str) -> None:
    async with open_broker(redis_url) as (_, broker):
        with pytest.raises(ValueError, match="priority"):
            await broker.push_on(Q, job(0), priority=MAX_PRIORITY + 1)
        with pytest.raises(ValueError, match="priority"):
            await broker.push_on(Q, job(0), priority=MIN_PRIORITY - 1)
        with pytest.raises(ValueError, match="braces"):
            await broker.push_on("a{b}", job(0))
        await broker.push_on(Q, job("max"), priority=MAX_PRIORITY)
        await broker.push_on(Q, job("max-minus-one"), priority=MAX_PRIORITY - 1)
        await broker.push_on(Q, job("min"), priority=MIN_PRIORITY)
        order = [await broker.pop_from(Q) for _ in range(3)]
    assert [(c.id, c.priority) for c in order if c is not None] == [
        ("job-min", MIN_PRIORITY),
        ("job-max-minus-one", MAX_PRIORITY - 1),
        ("job-max", MAX_PRIORITY),
    ]


# -- recovery and failures -------------------------------------------------------------------


async def test_recovery_touches_only_the_stalled_claims(
    redis_url: str, redis_server: RedisServer
) -> None:
    async with open_broker(redis_url) as (_, broker):
        for n in range(3):
            await broker.push_on(Q, job(f"old-{n}"))
        old = await broker.pop_many(Q, 3, worker="w-old")
        await trio.sleep(0.3)
        fresh_since = trio.current_time()

        async def push_many(start: int) -> None:
            for n in range(start, start + 100):
                await broker.push_on(Q, job(n))

        async with trio.open_nursery() as nursery:
            for start in range(0, 10_000, 100):
                nursery.start_soon(push_many, start)
        fresh: list[ClaimedJob] = []
        while len(fresh) < 10_000:
            fresh += await broker.pop_many(Q, 1000)
        await broker.recover_stalled_jobs(Q, 3600.0, 5)  # warm the script (SCRIPT FLUSH)
        before = command_calls(redis_server)
        examined = broker.statistics().claims_examined
        threshold = trio.current_time() - fresh_since + 0.1
        recovery = await broker.recover_stalled_jobs(Q, threshold, 5)
        used = commands_since(redis_server, before)
        assert recovery.recovered == 3
        assert broker.statistics().claims_examined - examined == 3
        assert [c.id for c in await broker.pop_many(Q, 10)] == [c.id for c in old]
    # One range query on the age index; per-claim work only for the 3 stalled claims.
    assert used["evalsha"] == 1
    assert used["zrangebyscore"] == 1
    assert used["zrem"] == 3
    assert "zrange" not in used
    assert "zscan" not in used
    assert used.get("zcard", 0) <= 1  # the one "any claim left?" at the end of the sweep
    assert sum(used.values()) < 40


async def test_failed_jobs_keep_the_newest_within_the_retention(
    redis_url: str, redis_server: RedisServer
) -> None:
    async with open_broker(redis_url, failed_retention=5) as (_, broker):
        for n in range(8):
            await broker.push_on(Q, job(n))
        for n in range(8):
            claimed = await broker.pop_from(Q)
            assert claimed is not None
            if n == 7:
                assert await broker.retry_job(claimed.lease, Q)
                claimed = await broker.pop_from(Q)
                assert claimed is not None
            assert await broker.fail_job(claimed.lease, Q, f"error {n}: ünïcode")
        failed = await broker.failed_jobs(Q, limit=100)
    assert [f.id for f in failed] == [f"job-{n}" for n in (7, 6, 5, 4, 3)]
    assert failed[0].error == "error 7: ünïcode"
    assert failed[0].data == b'{"n":"7"}'
    assert failed[0].attempts == 1
    assert abs(failed[0].failed_at - time.time()) < 5  # the server's clock, in seconds
    assert redis_server.command("LLEN", f"{{{Q}}}:failed") == 5


async def test_binary_data_and_odd_ids_round_trip(redis_url: str) -> None:
    data = bytes(range(256)) * 4
    async with open_broker(redis_url) as (_, broker):
        await broker.push_on(Q, Job("id:with:colons\nand ünïcode", data))
        claimed = await broker.pop_from(Q, worker='w "quoted" ü')
        assert claimed is not None
        assert claimed.id == "id:with:colons\nand ünïcode"
        assert claimed.lease.job_id == claimed.id
        assert claimed.data == data
        recovery = await broker.recover_stalled_jobs(Q, 0.0, 0)
        (poison,) = recovery.exceeded
        assert [s.worker for s in poison.stalls] == ['w "quoted" ü']
        assert await broker.fail_job(poison.lease, Q, "poison")
        (failed,) = await broker.failed_jobs(Q)
    assert (failed.id, failed.data, failed.stalled_count) == (claimed.id, data, 1)
    assert failed.stalls == poison.stalls


# -- wake-up ---------------------------------------------------------------------------------


async def test_a_push_through_another_client_wakes_a_waiter_within_milliseconds(
    redis_url: str,
) -> None:
    delays: list[float] = []
    async with open_broker(redis_url) as (_, consumer), open_broker(redis_url) as (_, producer):
        for n in range(20):
            assert await consumer.pop_from(Q) is None
            woke: list[float] = []

            async def wait(woke: list[float]) -> None:
                await consumer.wait_for_work(Q)
                woke.append(trio.current_time())

            with trio.fail_after(2):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(wait, woke)
                    await trio.sleep(0.02)
                    assert woke == []
                    pushed_at = trio.current_time()
                    await producer.push_on(Q, job(n))
            delays.append(woke[0] - pushed_at)
            claimed = await consumer.pop_from(Q)
            assert claimed is not None
    delays.sort()
    assert delays[len(delays) // 2] < 0.01, delays
    assert delays[-1] < 0.1, delays


async def test_a_push_right_after_an_empty_pop_is_never_missed(redis_url: str) -> None:
    """Race the push against the waiter, from the first (uncovered) wait on: a missed push
    would sleep until the 30 s safety check."""
    async with open_broker(redis_url) as (_, consumer), open_broker(redis_url) as (_, producer):
        for n in range(150):
            queue = f"{Q}:{n % 3}"  # the first round on each queue is not yet subscribed
            assert await consumer.pop_from(queue) is None

            async def push(queue: str, n: int) -> None:
                await trio.sleep(random.choice([0, 0, 0.0005, 0.002]))
                await producer.push_on(queue, job(n))

            with trio.fail_after(2):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(push, queue, n)
                    while (claimed := await consumer.pop_from(queue)) is None:
                        await consumer.wait_for_work(queue)
            assert claimed.id == f"job-{n}"


async def test_a_retry_and_a_recovery_ring_the_doorbell(redis_url: str) -> None:
    async with open_broker(redis_url) as (_, consumer), open_broker(redis_url) as (_, other):
        await other.push_on(Q, job(1))
        held = await other.pop_from(Q)
        assert held is not None
        assert await consumer.pop_from(Q) is None
        with trio.fail_after(1):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consumer.wait_for_work, Q)
                await trio.sleep(0.02)
                assert await other.retry_job(held.lease, Q)
        held = await other.pop_from(Q)
        assert held is not None
        assert await consumer.pop_from(Q) is None
        await trio.sleep(0.1)
        with trio.fail_after(1):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consumer.wait_for_work, Q)
                await trio.sleep(0.02)
                assert (await other.recover_stalled_jobs(Q, 0.05, 5)).recovered == 1


async def test_pushes_publish_only_when_a_pop_found_nothing(
    redis_url: str, redis_server: RedisServer
) -> None:
    async with open_broker(redis_url) as (_, broker):
        await broker.push_on(Q + ":warm", job(0))  # scripts cached
        before = command_calls(redis_server)
        for n in range(20):
            await broker.push_on(Q, job(n))  # a busy queue: nobody can be waiting
        assert "publish" not in commands_since(redis_server, before)
        assert len(await broker.pop_many(Q, 100)) == 20
        assert await broker.pop_from(Q) is None  # arms
        before = command_calls(redis_server)
        for n in range(20, 25):
            await broker.push_on(Q, job(n))
        assert commands_since(redis_server, before)["publish"] == 1  # one ring, then disarmed


async def test_the_safety_check_finds_work_the_doorbell_missed(
    redis_url: str, redis_server: RedisServer
) -> None:
    async with open_broker(redis_url, safety_poll_interval=0.2) as (_, consumer):
        assert await consumer.pop_from(Q) is None
        with trio.fail_after(2):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consumer.wait_for_work, Q)
                await trio.sleep(0.05)
                # The flag lost (an eviction, a flush): the push below rings nobody.
                redis_server.command("DEL", f"{{{Q}}}:armed")
                started = trio.current_time()
                async with RedisBroker.from_url(redis_url) as producer:
                    await producer.push_on(Q, job(1))
        # found by the safety check (on the shared grid: within one interval, plus slack)
        assert trio.current_time() - started < 0.5
        claimed = await consumer.pop_from(Q)
        assert claimed is not None


@pytest.mark.parametrize("queues", [1, 10])
async def test_an_idle_worker_costs_less_than_half_a_command_a_second(
    redis_url: str, redis_server: RedisServer, queues: int
) -> None:
    async def idle(broker: RedisBroker, queue: str) -> None:
        while True:  # the transport's poll loop, reduced to its idle path
            if not await broker.pop_many(queue, 10):
                await broker.wait_for_work(queue)

    async def measure_once(seconds: float, **options: Any) -> dict[str, int]:
        async with open_broker(redis_url, **options) as (_, broker):
            async with trio.open_nursery() as nursery:
                for n in range(queues):
                    nursery.start_soon(idle, broker, f"{Q}:{n}")
                await trio.sleep(0.2)  # first pops, the subscription, the peeks
                before = command_calls(redis_server)
                await trio.sleep(seconds)
                used = commands_since(redis_server, before)
                nursery.cancel_scope.cancel()
        return used

    async def measure(seconds: float, **options: Any) -> int:
        # The server is shared by the session's tests and its command counts are global: a
        # straggler of an earlier test can only ADD commands, so the quietest of three windows
        # is the one that measures this broker alone.
        used = min(
            [await measure_once(seconds, **options) for _ in range(3)],
            key=lambda u: sum(u.values()),
        )
        assert set(used) <= {"mget", "ping"}, used  # no scripts, no pops while idle
        return sum(used.values())

    # Default settings: nothing at all in a short window.
    assert await measure(2.0) / 2.0 <= 0.5
    # The steady state, compressed: ONE MGET for every idle queue, and one PING, per safety
    # interval, whatever the number of queues.
    count = await measure(1.0, safety_poll_interval=0.25)
    assert count <= 2 * 5 + 4  # ~4-5 ticks in the window, 2 commands each: not 1 per queue
    assert count / 1.0 * 0.25 / 30.0 <= 0.5  # scaled to the default 30 s interval


async def test_the_doorbell_resubscribes_after_a_server_restart(
    redis_url: str, redis_server: RedisServer
) -> None:
    errors: list[Exception] = []
    got: list[ClaimedJob] = []
    options: dict[str, Any] = {"on_error": errors.append, "resubscribe_backoff": (0.05, 0.2)}
    async with open_broker(redis_url, **options) as (_, broker):

        async def consume() -> None:
            while True:
                try:
                    claimed = await broker.pop_from(Q)
                except BrokerError:  # refused, or -LOADING while the server replays its AOF
                    await trio.sleep(0.05)
                    continue
                if claimed is not None:
                    got.append(claimed)
                    return
                await broker.wait_for_work(Q)

        with trio.fail_after(8):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume)
                await until(lambda: broker.statistics().subscriptions == 1)
                await trio.sleep(0.05)
                await trio.to_thread.run_sync(redis_server.stop)
                await until(lambda: broker.statistics().subscription_failures >= 1)
                await trio.to_thread.run_sync(redis_server.start)
                # Pushed at once: maybe before the doorbell is back (then the resubscription
                # itself rings), maybe after (then the push does).
                async with open_redis(redis_url) as client, RedisBroker(client) as producer:
                    while True:
                        try:
                            await producer.push_on(Q, job("after-restart"))
                            break
                        except BrokerError:  # -LOADING
                            await trio.sleep(0.02)
        await until(lambda: broker.statistics().subscriptions >= 2)
    assert [c.id for c in got] == ["job-after-restart"]
    assert errors
    assert isinstance(errors[0], BrokerUnavailable)
    assert all(isinstance(e, BrokerError) for e in errors)


async def test_the_doorbell_reports_a_server_down_in_one_line_per_attempt(
    redis_url: str, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Each failed resubscription was logged with its traceback, the chain of connect errors
    (an ExceptionGroup, an OSError, the BrokerUnavailable: ~45 lines every few seconds, in
    every worker and engine, for as long as the server stays down). One line each, naming
    where it was raised; at DEBUG the traceback is back."""
    caplog.set_level(logging.WARNING, logger="durable_trio")
    options: dict[str, Any] = {"resubscribe_backoff": (0.05, 0.1)}
    async with open_broker(redis_url, **options) as (_, broker):
        with trio.fail_after(8):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(broker.wait_for_work, Q)
                await until(lambda: broker.statistics().subscriptions == 1)
                await trio.to_thread.run_sync(redis_server.stop)
                try:
                    await until(lambda: broker.statistics().subscription_failures >= 3)
                    caplog.set_level(logging.DEBUG, logger="durable_trio")
                    failures = broker.statistics().subscription_failures
                    await until(lambda: broker.statistics().subscription_failures > failures)
                finally:
                    await trio.to_thread.run_sync(redis_server.start)
                nursery.cancel_scope.cancel()
    doorbell = [r for r in caplog.records if r.getMessage().startswith("Redis doorbell: ")]
    brief = [r for r in doorbell if r.levelno == logging.WARNING and r.exc_info is None]
    assert len(brief) >= 3
    for record in brief:
        text = record.getMessage()
        assert "\n" not in text
        assert text.startswith("Redis doorbell: BrokerUnavailable: ")
        assert text.endswith(")")  # ... (in _listen_forever) / (in receive)
    assert any(r.exc_info is not None for r in doorbell)  # at DEBUG: with its traceback


async def test_wait_for_work_needs_an_entered_broker(redis_url: str) -> None:
    async with open_redis(redis_url) as client:
        broker = RedisBroker(client)
        with pytest.raises(RuntimeError, match="enter"):
            await broker.wait_for_work(Q)
        await broker.aclose()
        await broker.aclose()  # idempotent


# -- the key store and the backend -----------------------------------------------------------


async def test_key_store_expires_and_lists_by_prefix_without_scanning(
    redis_url: str, redis_server: RedisServer
) -> None:
    before = command_calls(redis_server)
    async with open_redis(redis_url) as client:
        keys = RedisKeyStore(client, tag="test-keys")
        for n in range(200):
            await keys.put(f"other-prefix:{n:03}", b"x", 60)
        await keys.put("durable-worker-heartbeat:tok:b", b"B", 60)
        await keys.put("durable-worker-heartbeat:tok:a", b"A", 0.2)
        await keys.put("durable-worker-heartbeat:tok2:c", b"C", 60)
        await keys.put("durable-worker-heartbeat:tok:\u00e9", b"E", 60)
        await keys.put("durable-worker-heartbeat:tok", b"exact", 60)
        listed = await keys.entries("durable-worker-heartbeat:tok:")
        assert [(e.key, e.value) for e in listed] == [
            ("durable-worker-heartbeat:tok:a", b"A"),
            ("durable-worker-heartbeat:tok:b", b"B"),
            ("durable-worker-heartbeat:tok:\u00e9", b"E"),
        ]
        await trio.sleep(0.3)
        listed = await keys.entries("durable-worker-heartbeat:tok:")
        assert [e.key for e in listed] == [
            "durable-worker-heartbeat:tok:b",
            "durable-worker-heartbeat:tok:\u00e9",
        ]
        # The expired key is gone from the store too (pruned by that listing).
        assert redis_server.command("HLEN", "{test-keys}:entries") == 204
        await keys.put("durable-worker-heartbeat:tok:b", b"B2", 60)  # rewrite
        await keys.remove(["durable-worker-heartbeat:tok:\u00e9", "missing"])
        await keys.put("durable-worker-heartbeat:tok2:c", b"C", 0)  # ttl 0: gone now
        assert [(e.key, e.value) for e in await keys.entries("durable-worker-heartbeat:")] == [
            ("durable-worker-heartbeat:tok", b"exact"),
            ("durable-worker-heartbeat:tok:b", b"B2"),
        ]
        assert len(await keys.entries("")) == 202
        await keys.aclose()
    used = commands_since(redis_server, before)
    assert not {"scan", "keys"} & set(used), used


async def test_key_store_writes_a_whole_beat_in_one_command(
    redis_url: str, redis_server: RedisServer
) -> None:
    """An idle worker's liveness (a key per token, a descriptor, its last status) is one HSET,
    whatever the number of keys (its expiries from the server's clock, read at the first
    write)."""
    async with open_redis(redis_url) as client:
        keys = RedisKeyStore(client, tag="beat-keys")
        await keys.put("warm", b"x", 60)  # the server's clock read
        before = command_calls(redis_server)
        await keys.put_many([(f"durable-worker-heartbeat:t{n}:w", b"{}", 35) for n in range(12)])
        used = commands_since(redis_server, before)
    assert used == {"hset": 1}, used


async def test_key_store_reads_the_server_clock_again_every_two_minutes_and_after_a_failure(
    redis_url: str, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(redis_keys, "_monotonic", lambda: now[0])
    async with open_redis(redis_url) as client:
        keys = RedisKeyStore(client, tag="clock-keys")

        async def reads_of_the_clock(ttl: float = 60) -> int:
            before = command_calls(redis_server)
            await keys.put("k", b"v", ttl)
            return commands_since(redis_server, before).get("time", 0)

        assert await reads_of_the_clock() == 1  # the first write
        now[0] += redis_keys.CLOCK_EVERY - 1
        assert await reads_of_the_clock() == 0
        now[0] += 1
        assert await reads_of_the_clock() == 1
        # A write 59 s (monotonic) after the reading: its expiry is the reading + 59 s + ttl.
        now[0] += 59
        await keys.put("later", b"v", 1)
        stored = redis_server.command("HGET", "{clock-keys}:entries", "later")
        seconds, micros = redis_server.command("TIME")
        server_now_ms = int(seconds) * 1000 + int(micros) // 1000
        assert 59_000 < int(stored.split(b":", 1)[0]) - server_now_ms <= 60_000
        # A failed write: the next one reads the clock again (a failover may have moved it).
        with monkeypatch.context() as failing:

            async def broken(*args: Any, **kwargs: Any) -> Any:
                raise BrokerUnavailable("down")

            failing.setattr(client, "execute", broken)
            with pytest.raises(BrokerUnavailable):
                await keys.put("k", b"v", 60)
        assert await reads_of_the_clock() == 1


async def test_key_store_values_carry_a_server_side_ttl(
    redis_url: str, redis_server: RedisServer
) -> None:
    async with open_redis(redis_url) as client:
        keys = RedisKeyStore(client)
        await keys.put("k", b"v", 1.5)
    stored = redis_server.command("HGET", "{durable-keys}:entries", "k")
    expires_ms = float(stored.split(b":", 1)[0])
    seconds, micros = redis_server.command("TIME")
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    assert 1000 < expires_ms - now_ms <= 1500


async def test_open_redis_backend_opens_broker_and_key_store_together(
    redis_server: RedisServer, redis_url: str
) -> None:
    async with open_redis_backend(redis_url) as backend:
        assert isinstance(backend.broker, RedisBroker)
        assert backend.keys is not None
        await backend.broker.push_on(Q, job(1))
        await backend.keys.put("durable-worker-heartbeat:t:i", b"1", 5)
        with trio.fail_after(1):
            await backend.broker.wait_for_work(Q)
        assert [e.key for e in await backend.keys.entries("durable-")] == [
            "durable-worker-heartbeat:t:i"
        ]
        await backend.aclose()
        await backend.aclose()
    assert redact_url("redis://user:s3cret@host:1234/2") == "redis://***@host:1234/2"
    assert redact_url("rediss://:pw@host/0?ssl_cert_reqs=none") == (
        "rediss://***@host/0?ssl_cert_reqs=none"
    )


async def test_the_sweep_hint_names_only_queues_that_may_hold_claims(
    redis_url: str, redis_server: RedisServer
) -> None:
    async with open_broker(redis_url) as (_, broker):
        queues = [f"{Q}:{n}" for n in range(3)]
        assert await broker.queues_with_claims(queues) == []
        await broker.push_on(queues[1], job(1))
        claimed = await broker.pop_from(queues[1])
        assert claimed is not None
        assert await broker.queues_with_claims(queues) == [queues[1]]
        assert await broker.complete_job(claimed.lease, queues[1])
        # still hinted until a sweep finds the queue without claims, then skipped
        assert await broker.queues_with_claims(queues) == [queues[1]]
        await broker.recover_stalled_jobs(queues[1], 60.0, 3)
        assert await broker.queues_with_claims(queues) == []
        before = command_calls(redis_server)
        await broker.queues_with_claims(queues)
        assert commands_since(redis_server, before) == {"mget": 1}
