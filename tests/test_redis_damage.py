"""Issue 13, finding 1: the Redis broker never dies of, drops, or loops on damaged stored data.

Damage is written with raw Redis commands beside good jobs (an eviction, a partial restore,
another program writing the keys), then a real transport runs on it. Each test asserts that the
transport keeps serving, every good job is served, every bad entry is in the failed set or the
quarantine with its raw bytes and a reason (reported as :class:`~durable_trio.DamagedJob`),
nothing is lost (ready + delayed + active + failed + quarantine accounts for every entry) and
nothing loops (each bad entry is set aside once).

The real clock throughout, with short thresholds (see the house style's known pitfalls).
"""

from __future__ import annotations

import itertools
import logging
import re
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

import durable_trio as dt
from _redis_server import *  # noqa: F403
from durable_trio._redis import RedisClient, open_redis
from durable_trio.brokers import Job
from durable_trio.brokers.redis import EvictionPolicyWarning, RedisBroker
from helpers import Errors

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

    from _redis_server import RedisServer

pytestmark = pytest.mark.redis

_namespaces = itertools.count(1)


def fresh_namespace() -> str:
    return f"dmg{next(_namespaces)}"


@attrs.define
class Queue:
    """One task queue of a namespace, its keys and a raw client to damage them with."""

    client: RedisClient
    name: str

    def key(self, part: str) -> str:
        return f"{{{self.name}}}:{part}"

    async def r(self, *args: Any) -> Any:
        return await self.client.execute(*args)

    async def internal_id(self, job_id: str) -> bytes:
        """The internal id ``n`` of the job pushed as ``job_id``."""
        flat = await self.r("HGETALL", self.key("meta"))
        for n, meta in zip(flat[::2], flat[1::2], strict=True):
            if meta.endswith(b":" + job_id.encode()):
                return bytes(n)
        raise AssertionError(f"no meta for {job_id}")

    async def census(self) -> dict[str, int]:
        """Entries of every structure that holds a job or a set-aside entry."""
        counts = {}
        for part, command in [
            ("ready", "ZCARD"),
            ("delayed", "ZCARD"),
            ("active", "ZCARD"),
            ("failed", "LLEN"),
            ("quarantine", "LLEN"),
        ]:
            counts[part] = int(await self.r(command, self.key(part)))
        return counts


@asynccontextmanager
async def world(
    url: str, ns: str
) -> AsyncIterator[tuple[dt.Backend, RedisClient, dt.QueueTransport]]:
    """A backend, a raw client and a producer transport (no handlers: it consumes nothing)."""
    async with (
        dt.open_backend(url) as backend,
        open_redis(url) as client,
        dt.open_queue_transport(backend, namespace=ns, poll_interval=0.05) as producer,
    ):
        yield backend, client, producer


def task(step: str) -> dt.RemoteTask:
    return dt.RemoteTask(run_id="r", step_id=step, attempt=1, name="work")


def result(step: str) -> dt.StepResult:
    return dt.StepResult("r", step, 1, dt.StepStatus.COMPLETED, output=step)


async def serve_until(
    backend: dt.Backend,
    ns: str,
    done: Callable[[], Awaitable[bool]],
    *,
    errors: Errors,
    served: list[str] | None = None,
    register: Callable[[dt.QueueTransport], None] | None = None,
    **options: Any,
) -> None:
    """Run a transport until ``done()``; its loops must survive. ``register`` sets up its
    consumers (default: a step handler ``work`` that records the steps it serves)."""

    async def work(t: dt.RemoteTask) -> str:
        assert served is not None
        served.append(t.step_id)
        return t.step_id

    options = {"poll_interval": 0.05, **options}
    async with dt.open_queue_transport(backend, namespace=ns, on_error=errors, **options) as worker:
        if register is None:
            worker.handle("work", work)
        else:
            register(worker)
        with trio.fail_after(10):
            while not await done():  # noqa: ASYNC110  (the state is in Redis)
                await trio.sleep(0.05)
        assert not worker.statistics().closed


def damaged_reports(errors: Errors) -> list[dt.DamagedJob]:
    return [e for e in errors.seen if isinstance(e, dt.DamagedJob)]


@pytest.fixture
def ns() -> str:
    """A fresh namespace (the tests of one server never share queues)."""
    return fresh_namespace()


async def dispatch(producer: dt.QueueTransport, steps: Iterable[str]) -> dict[str, str]:
    """Dispatch one task per step; their job ids by step."""
    return {step: await producer.dispatch(task(step)) for step in steps}


# ------------------------------------------------------------------ finding 1: no meta


async def test_members_without_meta_are_quarantined_not_fatal(redis_url: str, ns: str) -> None:
    errors = Errors()
    served: list[str] = []
    async with world(redis_url, ns) as (backend, client, producer):
        q = Queue(client, producer.names.task_queue("work"))
        await dispatch(producer, ["g1", "g2"])
        # a ready member whose id has no meta (but a job body), one too short to hold an id,
        # and a delayed member (due) whose id has no meta
        await q.r("HSET", q.key("jobs"), "900", b"orphan body \xff")
        await q.r("ZADD", q.key("ready"), 0, b"0000000000000900900")
        await q.r("ZADD", q.key("ready"), 0, b"short")
        await q.r("ZADD", q.key("delayed"), 0, b"0000000000000901901")
        await dispatch(producer, ["g3"])

        async def done() -> bool:
            census = await q.census()
            return sorted(served) == ["g1", "g2", "g3"] and census["quarantine"] == 3

        await serve_until(backend, ns, done, errors=errors, served=served)
        census = await q.census()
        assert census == {"ready": 0, "delayed": 0, "active": 0, "failed": 0, "quarantine": 3}
        entries = await backend.broker.quarantined(q.name)  # type: ignore[attr-defined]
        reasons = sorted(e.reason for e in entries)
        assert reasons == [
            "delayed job without meta",
            "ready job without meta",
            "ready member names no job",
        ]
        by_reason = {e.reason: e for e in entries}
        assert b"0000000000000900900" in by_reason["ready job without meta"].raw
        assert b"orphan body \xff" in by_reason["ready job without meta"].raw
        assert b"short" in by_reason["ready member names no job"].raw
        assert all(e.at > 0 and e.queue == q.name for e in entries)
        assert await q.r("HEXISTS", q.key("jobs"), "900") == 0  # moved, not copied
    assert len(damaged_reports(errors)) == 3  # once each: no loop


async def test_a_pop_of_only_damaged_members_reports_them_once(redis_url: str) -> None:
    """The original crash: every popped member skipped, ``float(b'')`` on the empty reply."""
    async with open_redis(redis_url) as client, RedisBroker(client) as broker:
        q = Queue(client, "only-bad")
        await q.r("ZADD", q.key("ready"), 0, b"00000000000000077")
        first = await broker.pop_many(q.name, 4)
        assert [(j.lease.token, j.damage) for j in first] == [
            ("", "ready job without meta (internal id 7)")
        ]
        assert await broker.pop_many(q.name, 4) == []
        assert await broker.pop_from(q.name) is None
        assert (await q.census())["quarantine"] == 1


async def test_a_key_of_the_wrong_type_fails_the_script_before_any_write(redis_url: str) -> None:
    """A string where a hash is expected: the claim errors (a BrokerError), and nothing it had
    popped or promoted is lost (Redis keeps a failed script's earlier writes)."""
    async with open_redis(redis_url) as client, RedisBroker(client) as broker:
        q = Queue(client, "wrong-type")
        await broker.push_on(q.name, Job("a", b"1"))
        await broker.push_on(q.name, Job("b", b"2"))
        await q.r("ZADD", q.key("delayed"), 0, b"00000000000000099")  # due, no meta
        for part in ("stalls", "active", "claims", "quarantine"):
            saved = await q.r("DUMP", q.key(part))
            await q.r("SET", q.key(part), b"not the right type")
            with pytest.raises(dt.BrokerError, match="WRONGTYPE"):
                await broker.pop_many(q.name, 10)
            assert await q.r("ZCARD", q.key("ready")) == 2
            assert await q.r("ZCARD", q.key("delayed")) == 1
            await q.r("DEL", q.key(part))
            if saved is not None:
                await q.r("RESTORE", q.key(part), 0, saved)
        jobs = await broker.pop_many(q.name, 10)
        assert sorted(j.id for j in jobs) == ["", "a", "b"]  # (and the report of the delayed one)
        assert (await q.census())["quarantine"] == 1


# ------------------------------------------------------------------ push times


@pytest.mark.parametrize(
    "stored",
    [b"junk", b"1764695335.5", b"1e400 0", b"-5 0", b"1 1234567", b"9" * 40 + b" 0",
     b"\xff\x00", None],
    ids=["text", "decimal", "exponent", "negative", "micros-too-long", "too-long", "binary",
         "missing"],
)
async def test_an_unreadable_push_time_makes_the_age_unknown(
    redis_url: str, ns: str, stored: bytes | None
) -> None:
    """The oldest ready job's push time (the ``t<n>`` field of the job hash) not in the
    scripts' format, or none at all (a job pushed before push times were kept): the queue's
    oldest age is ``None``, its counts are right, nothing raises, and the job is served as any
    other."""
    errors = Errors()
    served: list[str] = []
    async with world(redis_url, ns) as (backend, client, producer):
        q = Queue(client, producer.names.task_queue("work"))
        ids = await dispatch(producer, ["bad", "g1", "g2"])
        n = await q.internal_id(ids["bad"])
        if stored is None:
            await q.r("HDEL", q.key("jobs"), b"t" + n)
        else:
            await q.r("HSET", q.key("jobs"), b"t" + n, stored)
        broker: Any = backend.broker
        stats = await broker.queue_stats(q.name)
        assert (stats.ready, stats.delayed, stats.claimed, stats.failed) == (3, 0, 0, 0)
        assert stats.oldest_ready_age is None

        async def done() -> bool:
            return sorted(served) == ["bad", "g1", "g2"]

        await serve_until(backend, ns, done, errors=errors, served=served)
        assert await q.r("EXISTS", q.key("jobs")) == 0  # the damaged field left with its job
        await dispatch(producer, ["g3"])
        age = (await broker.queue_stats(q.name)).oldest_ready_age
        assert age is not None
        assert 0 <= age < 1
    assert errors.seen == []


async def test_a_ready_member_naming_no_job_makes_the_age_unknown(redis_url: str) -> None:
    """First in its priority, a member whose id cannot be read hides the jobs behind it (one of
    them may be the oldest): the age is ``None`` until a pop moves it to the quarantine."""
    async with open_redis(redis_url) as client, RedisBroker(client) as broker:
        q = Queue(client, "age-of-nothing")
        await broker.push_on(q.name, Job("good", b"{}"))
        await q.r("ZADD", q.key("ready"), -1, b"short")
        stats = await broker.queue_stats(q.name)
        assert (stats.ready, stats.oldest_ready_age) == (2, None)
        claimed = await broker.pop_many(q.name, 4)  # the member goes to the quarantine
        assert [j.id for j in claimed if j.lease.token] == ["good"]
        await broker.push_on(q.name, Job("next", b"{}"))
        age = (await broker.queue_stats(q.name)).oldest_ready_age
        assert age is not None
        assert 0 <= age < 1


# ------------------------------------------------------------------ finding 2: garbage meta


async def test_garbage_meta_is_failed_kept_raw(redis_url: str, ns: str) -> None:
    errors = Errors()
    served: list[str] = []
    async with world(redis_url, ns) as (backend, client, producer):
        q = Queue(client, producer.names.task_queue("work"))
        ids = await dispatch(producer, ["g1", "bad", "g2"])
        n = await q.internal_id(ids["bad"])
        body = await q.r("HGET", q.key("jobs"), n)
        await q.r("HSET", q.key("meta"), n, b"garbage")

        async def done() -> bool:
            return sorted(served) == ["g1", "g2"] and (await q.census())["failed"] == 1

        await serve_until(backend, ns, done, errors=errors, served=served)
        assert await q.census() == {
            "ready": 0, "delayed": 0, "active": 0, "failed": 1, "quarantine": 0
        }  # fmt: skip
        [failed] = await backend.broker.failed_jobs(q.name)  # type: ignore[attr-defined]
        assert failed.data == body
        assert failed.error.startswith("damaged: meta unreadable: b'garbage'")
        assert "stored meta: b'garbage'" in failed.error
    assert len(damaged_reports(errors)) == 1


async def test_garbage_meta_on_a_stalled_claim_is_failed_not_dropped(
    redis_url: str, ns: str
) -> None:
    """The recover script used to ZREM the claim and then error on the meta: the job ended in
    neither ready, active nor failed."""
    errors = Errors()
    served: list[str] = []
    async with world(redis_url, ns) as (backend, client, producer):
        q = Queue(client, producer.names.task_queue("work"))
        ids = await dispatch(producer, ["stalled", "g1"])
        broker = backend.broker
        claim = await broker.pop_from(q.name, worker="dead")  # a worker that died holding it
        assert claim is not None
        assert claim.id == ids["stalled"]
        n = await q.internal_id(ids["stalled"])
        await q.r("HSET", q.key("meta"), n, b"0:x:garbage")
        await trio.sleep(0.3)

        async def done() -> bool:
            return served == ["g1"] and (await q.census())["failed"] == 1

        await serve_until(
            backend,
            ns,
            done,
            errors=errors,
            served=served,
            stalled_threshold=0.2,
            stalled_check_interval=0.05,
            max_stalled_count=5,  # not exceeded: the damage alone sets it aside
        )
        assert await q.census() == {
            "ready": 0, "delayed": 0, "active": 0, "failed": 1, "quarantine": 0
        }  # fmt: skip
        [failed] = await broker.failed_jobs(q.name)  # type: ignore[attr-defined]
        assert failed.data == claim.data
        assert "meta unreadable" in failed.error
        assert "b'0:x:garbage'" in failed.error
    assert len(damaged_reports(errors)) == 1


async def test_a_retry_that_finds_garbage_meta_fails_the_job(redis_url: str, ns: str) -> None:
    """A result handler that raises gets its result retried; meta damaged meanwhile: failed."""
    errors = Errors()
    consumed: list[str] = []
    async with world(redis_url, ns) as (backend, client, producer):
        q = Queue(client, producer.names.results)
        flaky = await producer.publish_result(result("flaky"))
        await producer.publish_result(result("g1"))
        n = await q.internal_id(flaky)

        async def on_result(r: dt.StepResult) -> None:
            if r.step_id == "flaky":
                await q.r("HSET", q.key("meta"), n, b"\x00damaged")  # under the handler
                raise RuntimeError("redeliver me")
            consumed.append(r.step_id)

        async def done() -> bool:
            return consumed == ["g1"] and (await q.census())["failed"] == 1

        await serve_until(
            backend, ns, done, errors=errors, register=lambda t: t.on_result(on_result)
        )
        assert await q.census() == {
            "ready": 0, "delayed": 0, "active": 0, "failed": 1, "quarantine": 0
        }  # fmt: skip
        [failed] = await backend.broker.failed_jobs(q.name)  # type: ignore[attr-defined]
        assert failed.error.startswith("damaged: stored meta unreadable")
        assert "b'\\x00damaged'" in failed.error


async def test_a_retry_with_garbage_meta_is_reported_by_the_broker(redis_url: str) -> None:
    errors = Errors()
    async with open_redis(redis_url) as client, RedisBroker(client, on_error=errors) as broker:
        q = Queue(client, "retry-bad")
        await broker.push_on(q.name, Job("j", b"body"))
        claim = await broker.pop_from(q.name)
        assert claim is not None
        await q.r("HSET", q.key("meta"), "1", b"nonsense")
        assert await broker.retry_job(claim.lease, q.name) is True
        assert await broker.retry_job(claim.lease, q.name) is False  # handled once
        assert await q.census() == {
            "ready": 0, "delayed": 0, "active": 0, "failed": 1, "quarantine": 0
        }  # fmt: skip
        [failed] = await broker.failed_jobs(q.name)
        assert failed.data == b"body"
    [report] = damaged_reports(errors)
    assert report.queue == q.name
    assert report.job_id == "j"


# ------------------------------------------------------------------ finding 3: non-UTF-8 id


async def test_a_job_id_that_is_not_utf8_is_set_aside(redis_url: str, ns: str) -> None:
    errors = Errors()
    served: list[str] = []
    async with world(redis_url, ns) as (backend, client, producer):
        q = Queue(client, producer.names.task_queue("work"))
        ids = await dispatch(producer, ["g1", "bad"])
        n = await q.internal_id(ids["bad"])
        await q.r("HSET", q.key("meta"), n, b"0:0:0:id-\xff\xfe")

        async def done() -> bool:
            return served == ["g1"] and (await q.census())["failed"] == 1

        await serve_until(backend, ns, done, errors=errors, served=served)
        [failed] = await backend.broker.failed_jobs(q.name)  # type: ignore[attr-defined]
        assert failed.id == "id-\\xff\\xfe"  # readable, escaped
        assert "job id is not UTF-8: id-\\xff\\xfe" in failed.error
    [report] = damaged_reports(errors)
    assert report.job_id == "id-\\xff\\xfe"


# ------------------------------------------------------------------ finding 4: stall history


async def test_junk_stall_history_is_failed_kept_raw(redis_url: str, ns: str) -> None:
    errors = Errors()
    served: list[str] = []
    async with world(redis_url, ns) as (backend, client, producer):
        q = Queue(client, producer.names.task_queue("work"))
        ids = await dispatch(producer, ["g1", "bad", "bad2"])
        await q.r("HSET", q.key("stalls"), await q.internal_id(ids["bad"]), b"{not json")
        await q.r("HSET", q.key("stalls"), await q.internal_id(ids["bad2"]), b'[["x", 1]]')

        async def done() -> bool:
            return served == ["g1"] and (await q.census())["failed"] == 2

        await serve_until(backend, ns, done, errors=errors, served=served)
        failed = await backend.broker.failed_jobs(q.name)  # type: ignore[attr-defined]
        errors_text = " ".join(f.error for f in failed)
        assert errors_text.count("damaged: stall history unreadable") == 2
        assert "b'{not json'" in errors_text
        assert "b'[[\"x\", 1]]'" in errors_text
    assert len(damaged_reports(errors)) == 2


async def test_junk_stall_history_of_a_stalled_claim_is_replaced_and_kept(
    redis_url: str, ns: str
) -> None:
    """The recover script appended to the stored text by string surgery: now a history that is
    no JSON array is replaced by a fresh one, its old text kept in the quarantine."""
    errors = Errors()
    served: list[str] = []
    async with world(redis_url, ns) as (backend, client, producer):
        q = Queue(client, producer.names.task_queue("work"))
        ids = await dispatch(producer, ["stalled"])
        claim = await backend.broker.pop_from(q.name, worker="dead")
        assert claim is not None
        n = await q.internal_id(ids["stalled"])
        await q.r("HSET", q.key("stalls"), n, b"junk]")
        await trio.sleep(0.3)

        async def done() -> bool:
            return served == ["stalled"]

        await serve_until(
            backend,
            ns,
            done,
            errors=errors,
            served=served,
            stalled_threshold=0.2,
            stalled_check_interval=0.05,
        )
        [entry] = await backend.broker.quarantined(q.name)  # type: ignore[attr-defined]
        assert entry.reason == "stall history unreadable, replaced by a new one"
        assert b"junk]" in entry.raw
        census = await q.census()
        assert census == {"ready": 0, "delayed": 0, "active": 0, "failed": 0, "quarantine": 1}
    assert len(damaged_reports(errors)) == 1


# ------------------------------------------------------------------ finding 5: records


async def test_damaged_failed_and_quarantine_records_are_readable(redis_url: str) -> None:
    async with open_redis(redis_url) as client, RedisBroker(client) as broker:
        q = Queue(client, "records")
        bad = [b"garbage", b"1.0 0 0 99 0 0\nshort", b"x y z\n", b"1.0 0 0 1 1 0 -7\nab"]
        for record in bad:
            await q.r("LPUSH", q.key("failed"), record)
            await q.r("LPUSH", q.key("quarantine"), record)
        await q.r("LPUSH", q.key("failed"), b"2.5 1 0 2 3 0\n\xff\xfeerrdata")
        failed = await broker.failed_jobs(q.name)
        assert failed[0].id == "\\xff\\xfe"
        assert failed[0].data == b"data"
        assert "job id is not UTF-8" in failed[0].error
        assert [f.data for f in failed[1:]] == bad[::-1]
        assert all(f.error.startswith("damaged failed record") for f in failed[1:])
        entries = await broker.quarantined(q.name)
        assert [e.raw for e in entries if e.reason == "damaged quarantine record"] == [
            bad[3],
            bad[2],
            bad[1],
            bad[0],
        ]


# ------------------------------------------------------------------ finding 6: eviction


async def test_the_broker_warns_when_redis_may_evict(
    redis_evicting_server: RedisServer, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    errors = Errors()
    with caplog.at_level(logging.WARNING, logger="durable_trio.redis"):
        async with (
            open_redis(redis_evicting_server.url) as client,
            RedisBroker(client, on_error=errors) as broker,
        ):
            assert broker.statistics().maxmemory_policy == "allkeys-lru"
    [warning] = errors.seen
    assert isinstance(warning, EvictionPolicyWarning)
    assert not isinstance(warning, dt.BrokerError)
    assert "allkeys-lru" in str(warning)
    assert "noeviction" in caplog.text
    # reported, never raised: one line with its class's name, no traceback of nothing
    [record] = [r for r in caplog.records if r.name == "durable_trio.redis"]
    assert record.getMessage().startswith(
        "Redis eviction policy: EvictionPolicyWarning: Redis runs with maxmemory-policy"
    )
    assert record.exc_info is None
    errors = Errors()
    async with open_redis(redis_url) as client, RedisBroker(client, on_error=errors) as broker:
        assert broker.statistics().maxmemory_policy == "noeviction"
    assert errors.seen == []


async def test_a_server_that_refuses_config_is_not_checked(redis_url: str) -> None:
    async with open_redis(redis_url) as admin:
        await admin.execute("ACL", "SETUSER", "noconfig", "on", ">pw", "~*", "&*", "+@all")
        await admin.execute("ACL", "SETUSER", "noconfig", "-config")
    errors = Errors()
    url = redis_url.replace("redis://", "redis://noconfig:pw@")
    try:
        async with open_redis(url) as client, RedisBroker(client, on_error=errors) as broker:
            assert broker.statistics().maxmemory_policy is None
            await broker.push_on("q", Job("j", b"{}"))  # and it works
    finally:
        async with open_redis(redis_url) as admin:
            await admin.execute("ACL", "DELUSER", "noconfig")
    assert errors.seen == []


async def test_evicted_keys_are_reported_not_fatal(
    redis_evicting_server: RedisServer, ns: str
) -> None:
    redis_evicting_server.reset()
    url = redis_evicting_server.url
    errors = Errors()
    served: list[str] = []
    body = "x" * 4000

    async with world(url, ns) as (backend, client, producer):
        queues = [Queue(client, producer.names.task_queue(f"work{i}")) for i in range(8)]
        # Acknowledged jobs, past maxmemory: Redis evicts whole keys of the queues (a job body
        # hash, a meta hash, a ready set ...) while it takes the pushes.
        for round_ in range(40):
            for i in range(8):
                await producer.dispatch(
                    dt.RemoteTask(
                        run_id="r", step_id=f"{i}-{round_}", attempt=1, name=f"work{i}",
                        input=body,
                    )
                )  # fmt: skip
        # Then a small job on each queue: the LRU may have taken every queue's keys whole
        # (seen once in CI: nothing left to serve and nothing damaged to report), and the
        # newest writes are the last it takes.
        for i in range(8):
            await producer.dispatch(
                dt.RemoteTask(run_id="r", step_id=f"{i}-last", attempt=1, name=f"work{i}")
            )
        info = (await client.execute("INFO", "stats")).decode()
        assert int(info.split("evicted_keys:")[1].split()[0]) > 0
        # The census is what the worker meets: eviction stops here. The worker's own writes
        # need memory; the LRU would otherwise go on taking keys whole while it runs, the
        # damage the census saw with them (nothing damaged left to report: seen in CI), or
        # the store's identity key (then the broker raises its store-lost alarm and serves
        # nothing: tests/test_redis_store_loss.py).
        await client.execute("CONFIG", "SET", "maxmemory", "64mb")
        try:
            vanished = visible = 0
            for q in queues:
                ready = int(await q.r("ZCARD", q.key("ready")))
                bodies = int(await q.r("HLEN", q.key("jobs")))
                metas = int(await q.r("HLEN", q.key("meta")))
                vanished += ready > 0 and (bodies < ready or metas < ready)
                visible += ready

            async def work(t: dt.RemoteTask) -> str:
                served.append(t.step_id)
                return "ok"

            async def done() -> bool:
                for q in queues:
                    census = await q.census()
                    if census["ready"] or census["active"]:
                        return False
                return True

            async with dt.open_queue_transport(
                backend, namespace=ns, on_error=errors, poll_interval=0.05
            ) as worker:
                for i in range(8):
                    worker.handle(f"work{i}", work)
                with trio.fail_after(20):
                    while not await done():  # noqa: ASYNC110
                        await trio.sleep(0.05)
                # What a worker can still see is served, or reported as damaged.
                if visible:
                    assert served or damaged_reports(errors)
                if vanished:
                    assert damaged_reports(errors), "vanished data is reported"
                assert not worker.statistics().closed
        finally:
            await client.execute("CONFIG", "SET", "maxmemory", "2mb")
    assert not [e for e in errors.seen if "retried after a backoff" in str(e)]


# ------------------------------------------------------------------ finding 7: engine queues


async def test_damage_on_the_engine_queues_is_set_aside(redis_url: str, ns: str) -> None:
    """Results, heartbeats and control messages go through the same pop: a damaged entry there
    is set aside (failed or quarantined), never fatal to the engine's loops."""
    errors = Errors()
    got: list[str] = []
    async with world(redis_url, ns) as (backend, client, producer):
        names = producer.names
        queues = [Queue(client, name) for name in (names.results, names.heartbeats, names.control)]
        await producer.publish_result(result("g1"))
        await producer.remote.heartbeat(dt.StepHeartbeat("r", "g1", 1, at=1.0))
        await producer.remote.send_control(dt.ControlMessage("cancel", run_id="r", step_id="g1"))
        for q in queues:
            await backend.broker.push_on(q.name, Job("bad", b"{}"))
            await q.r("HSET", q.key("meta"), await q.internal_id("bad"), b"bad meta")
            await q.r("ZADD", q.key("ready"), 0, b"\x00junk member")

        async def on_result(r: dt.StepResult) -> None:
            got.append(f"result {r.step_id}")

        async def on_heartbeat(beat: dt.StepHeartbeat) -> None:
            got.append(f"beat {beat.step_id}")

        async def on_control(message: dt.ControlMessage) -> None:
            got.append(f"control {message.step_id}")

        def register(engine: dt.QueueTransport) -> None:
            engine.on_result(on_result)
            engine.remote.on_heartbeat(on_heartbeat)
            engine.remote.on_control(on_control)

        async def done() -> bool:
            censuses = [await q.census() for q in queues]
            return len(got) == 3 and all(c["failed"] + c["quarantine"] == 2 for c in censuses)

        await serve_until(backend, ns, done, errors=errors, register=register)
        assert sorted(got) == ["beat g1", "control g1", "result g1"]
        for q in queues:
            assert await q.census() == {
                "ready": 0, "delayed": 0, "active": 0, "failed": 1, "quarantine": 1
            }  # fmt: skip
    assert len(damaged_reports(errors)) == 6


# ------------------------------------------------------------------ restarts


async def test_workers_restarted_on_damaged_data_serve_the_rest(redis_url: str, ns: str) -> None:
    errors = Errors()
    served: list[str] = []
    async with world(redis_url, ns) as (backend, client, producer):
        q = Queue(client, producer.names.task_queue("work"))
        # damage that stays: unreadable records in the inspection lists
        await q.r("LPUSH", q.key("failed"), b"\xff not a record")
        await q.r("LPUSH", q.key("quarantine"), b"\xff not a record")
        for round_ in range(5):
            ids = await dispatch(producer, [f"g{round_}", f"bad{round_}"])
            await q.r("HSET", q.key("meta"), await q.internal_id(ids[f"bad{round_}"]), b"?")
            await q.r("ZADD", q.key("ready"), 0, f"junk{round_}")
            want = [f"g{r}" for r in range(round_ + 1)]

            async def done(want: list[str] = want, round_: int = round_) -> bool:
                census = await q.census()
                return sorted(served) == want and census["quarantine"] == round_ + 2

            await serve_until(backend, ns, done, errors=errors, served=served)
            failed = await backend.broker.failed_jobs(q.name)  # type: ignore[attr-defined]
            assert len(failed) == round_ + 2
        assert await q.census() == {
            "ready": 0, "delayed": 0, "active": 0, "failed": 6, "quarantine": 6
        }  # fmt: skip
    assert len(damaged_reports(errors)) == 10


# ------------------------------------------------------------------ property


_MEMBER_LIKE = re.compile(rb".{16}[0-9]+", re.DOTALL)
_META_LIKE = re.compile(rb"-?[0-9]+:[0-9]+:[0-9]+:.*", re.DOTALL)
_TOKEN_LIKE = re.compile(rb"[0-9]+:.*", re.DOTALL)


def _not_utf8(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return True
    return False


_junk = st.binary(max_size=40)
#: (kind, bytes): one damaged entry.
_ENTRY_DAMAGE = st.one_of(
    st.tuples(st.just("ready member"), _junk.filter(lambda b: not _MEMBER_LIKE.fullmatch(b))),
    st.tuples(st.just("delayed member"), _junk.filter(lambda b: not _MEMBER_LIKE.fullmatch(b))),
    st.tuples(st.just("orphan member"), _junk),  # a well-formed member naming no job
    st.tuples(st.just("active member"), _junk.filter(lambda b: not _TOKEN_LIKE.fullmatch(b))),
    st.tuples(st.just("meta"), _junk.filter(lambda b: not _META_LIKE.fullmatch(b))),
    st.tuples(st.just("meta id"), st.binary(min_size=1, max_size=20).filter(_not_utf8)),
    st.tuples(
        st.just("stalls"),
        st.binary(min_size=1, max_size=40).filter(lambda b: not b.lstrip().startswith(b"[")),
    ),
    st.tuples(st.just("body gone"), st.just(b"")),
    st.tuples(st.just("meta gone"), st.just(b"")),
    st.tuples(st.just("failed record"), _junk),
    st.tuples(st.just("quarantine record"), _junk),
    # a job claimed by a worker that died, then damaged: the sweep meets it
    st.tuples(st.just("stalled meta"), _junk.filter(lambda b: not _META_LIKE.fullmatch(b))),
    st.tuples(st.just("stalled meta gone"), st.just(b"")),
    st.tuples(
        st.just("stalled stalls"),
        st.binary(min_size=1, max_size=40).filter(lambda b: not b.lstrip().startswith(b"[")),
    ),
    st.tuples(st.just("stalled claim entry"), _junk),
)
#: The kinds that damage a pushed job (the rest write entries of their own).
_ON_JOBS = {"meta", "meta id", "stalls", "body gone", "meta gone"}
_QUARANTINED = {"ready member", "delayed member", "orphan member", "active member", "meta gone"}


def _outcome(kind: str, raw: bytes) -> tuple[int, int, int]:
    """Where one damaged entry must end up: (failed records, quarantine records, reports)."""
    if kind == "failed record":
        return 1, 0, 0
    if kind == "quarantine record":
        return 0, 1, 0
    if kind in _QUARANTINED or kind in ("stalled meta gone", "stalled stalls"):
        return 0, 1, 1  # (a replaced history: kept in the quarantine, the job goes on)
    if kind == "stalled claim entry":
        # the claim's worker name goes into the stall history: unreadable if not UTF-8
        return (1, 0, 1) if _not_utf8(raw[16:]) else (0, 0, 0)
    return 1, 0, 1


#: Keys replaced by a string for a while (then restored): the broker reports, or works on.
_WRONG_TYPE = st.none() | st.sampled_from(
    [
        "ready",
        "jobs",
        "meta",
        "stalls",
        "claims",
        "failed",
        "quarantine",
        "active",
        "delayed",
        "seq",
        "armed",
    ]
)


@settings(max_examples=25, deadline=None)
@given(
    target=st.sampled_from(["tasks", "results"]),
    good=st.integers(1, 3),
    damage=st.lists(_ENTRY_DAMAGE, max_size=5, unique=True),  # (a member added twice is one)
    wrong_type=_WRONG_TYPE,
)
def test_arbitrary_damage_is_set_aside_and_nothing_is_lost(
    redis_server: RedisServer,
    target: str,
    good: int,
    damage: list[tuple[str, bytes]],
    wrong_type: str | None,
) -> None:
    redis_server.start()
    trio.run(_damage_example, redis_server.url, target, good, damage, wrong_type)


async def _write_damage(
    q: Queue,
    push: Callable[[str], Awaitable[str]],
    broker: RedisBroker,
    i: int,
    kind: str,
    raw: bytes,
) -> None:
    if kind.startswith("stalled"):
        n = await q.internal_id(await push(f"bad{i}"))
        assert await broker.pop_from(q.name, worker="dead") is not None
        [token] = await q.r("ZRANGE", q.key("active"), 0, 0)
        await q.r("ZADD", q.key("active"), 0, token)  # claimed long ago
        field = {"stalled meta": "meta", "stalled stalls": "stalls"}.get(kind, "claims")
        if kind == "stalled meta gone":
            await q.r("HDEL", q.key("meta"), n)
        else:
            await q.r("HSET", q.key(field), n, raw)
    elif kind in _ON_JOBS:
        n = await q.internal_id(await push(f"bad{i}"))
        if kind == "meta":
            await q.r("HSET", q.key("meta"), n, raw)
        elif kind == "meta id":
            await q.r("HSET", q.key("meta"), n, b"0:0:0:" + raw)
        elif kind == "stalls":
            await q.r("HSET", q.key("stalls"), n, raw)
        elif kind == "body gone":
            await q.r("HDEL", q.key("jobs"), n)
        else:
            await q.r("HDEL", q.key("meta"), n)
    elif kind == "ready member":
        await q.r("ZADD", q.key("ready"), i, raw)
    elif kind == "delayed member":
        await q.r("ZADD", q.key("delayed"), 0, raw)
    elif kind == "orphan member":
        fake = 900_000 + i  # an internal id no push gave
        await q.r("HSET", q.key("jobs"), fake, raw)
        await q.r("ZADD", q.key("ready"), 0, b"%016d%d" % (fake, fake))
    elif kind == "active member":
        await q.r("ZADD", q.key("active"), 0, raw)  # a claim long stalled
    else:
        await q.r("LPUSH", q.key(kind.split()[0]), raw)


async def _damage_example(
    url: str, target: str, good: int, damage: list[tuple[str, bytes]], wrong_type: str | None
) -> None:
    ns = fresh_namespace()
    errors = Errors()
    served: list[str] = []
    consumed: list[str] = []
    async with world(url, ns) as (backend, client, producer):
        queue = producer.names.task_queue("work") if target == "tasks" else producer.names.results
        q = Queue(client, queue)

        async def push(step: str) -> str:
            if target == "tasks":
                return await producer.dispatch(task(step))
            return await producer.publish_result(result(step))

        broker = backend.broker
        assert isinstance(broker, RedisBroker)
        # (claimed by a dead worker first: each is the only ready job when it is popped)
        stalled = [i for i, (kind, _) in enumerate(damage) if kind.startswith("stalled")]
        for i in stalled:
            await _write_damage(q, push, broker, i, *damage[i])
        for i in range(good):
            await push(f"g{i}")
        for i in range(len(damage)):
            if i not in stalled:
                await _write_damage(q, push, broker, i, *damage[i])
        outcomes = [_outcome(kind, raw) for kind, raw in damage]
        to_failed = sum(o[0] for o in outcomes)
        to_quarantine = sum(o[1] for o in outcomes)
        set_aside = sum(o[2] for o in outcomes)

        async def work(t: dt.RemoteTask) -> str:
            served.append(t.step_id)
            return t.step_id

        async def on_result(r: dt.StepResult) -> None:
            consumed.append(r.step_id)

        def register(worker: dt.QueueTransport) -> None:
            worker.handle("work", work)
            worker.on_result(on_result)  # the engine's side, on the same transport

        want = sorted(f"g{i}" for i in range(good))

        async def done() -> bool:
            census = await q.census()
            # (a damaged job may be served too, once recovered with its history replaced)
            got = {s for s in (served if target == "tasks" else consumed) if s.startswith("g")}
            return (
                sorted(got) == want
                and census == {"ready": 0, "delayed": 0, "active": 0, **expected(census)}
                and (wrong_type is not None or len(damaged_reports(errors)) >= set_aside)
            )

        def expected(census: dict[str, int]) -> dict[str, int]:
            if wrong_type is None:
                return {"failed": to_failed, "quarantine": to_quarantine}
            # A job whose failing met the wrong-type key stayed claimed; recovered, a junk
            # stall history is replaced (its text quarantined) and the job may be served: each
            # entry still ends in exactly one place.
            moved = min(census["quarantine"] - to_quarantine, to_failed)
            return {"failed": to_failed - moved, "quarantine": to_quarantine + moved}

        options: dict[str, Any] = {"stalled_threshold": 0.3, "stalled_check_interval": 0.05}
        if wrong_type is not None:
            key = q.key(wrong_type)
            saved = await q.r("DUMP", key)
            await q.r("DEL", key)
            # (a string at seq is junk, which is rebuilt now: see test_redis_seq_damage.py)
            if wrong_type == "seq":
                await q.r("RPUSH", key, b"not the right type")
            else:
                await q.r("SET", key, b"not the right type")

            async def a_while() -> bool:
                await trio.sleep(0.25)
                return True

            await serve_until(backend, ns, a_while, errors=errors, register=register, **options)
            await q.r("DEL", key)
            if saved is not None:
                await q.r("RESTORE", key, 0, saved)
        await serve_until(backend, ns, done, errors=errors, register=register, **options)
        census = await q.census()
        assert census == {"ready": 0, "delayed": 0, "active": 0, **expected(census)}
        failed = await backend.broker.failed_jobs(queue)  # type: ignore[attr-defined]
        quarantined = await backend.broker.quarantined(queue)  # type: ignore[attr-defined]
        assert (len(failed), len(quarantined)) == (census["failed"], census["quarantine"])
    # A broker never raised anything but a BrokerError (the transport's safety net unused).
    assert not [e for e in errors.seen if "retried after a backoff" in str(e)]
    if wrong_type is None:
        assert len(damaged_reports(errors)) == set_aside  # each set aside once: nothing loops
    # (With a wrong-type key the counts differ, not the entries: a failed finalize is
    # redelivered and reported again, and the first transport, closed while a reply may be in
    # flight, may never read the reports in it.)


@settings(max_examples=200, deadline=None)
@given(
    fields=st.lists(st.none() | st.binary(max_size=60), min_size=3, max_size=3),
    token=st.sampled_from([b"", b"7:00ff00ff00ff00ff"]),  # (tokens are the script's own)
    record=st.binary(max_size=80),
    head=st.lists(st.integers(0, 10**20), min_size=6, max_size=7),
)
def test_the_decoders_never_raise(
    fields: list[bytes | None], token: bytes, record: bytes, head: list[int]
) -> None:
    """Whatever a reply or a record holds, the decoders return a value (pure, no server)."""
    from durable_trio.brokers.redis._replies import read_claim, read_failed, read_quarantined

    fields[0] = fields[0] or b""
    job = read_claim([*fields, token], 0)
    assert job.damage is not None or job.lease.token
    for raw in (record, " ".join(map(str, head)).encode() + b"\n" + record):
        assert read_failed(raw).failed_at >= 0
        assert read_quarantined("q", raw).queue == "q"
