"""Issue 30, item 7: a damaged Redis sequence counter (``{Q}:seq`` of a queue, ``T:seq`` of
the run store) is rebuilt from what the store holds, reported once, and new work flows: nothing
queued is lost or reordered.

Damage is written with raw Redis commands while jobs are queued (ready at two priorities,
delayed, claimed); then every script that takes sequence numbers runs on it. The real clock
throughout, with short delays.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import pytest
import trio

import durable_trio as dt
from _redis_cluster import *  # noqa: F403  (the fixture; harmless once conftest imports it too)
from _redis_server import *  # noqa: F403
from durable_trio._engine import App, RunRecord, RunStatus, WorkflowContext, open_engine
from durable_trio._engine._stores.redis import RedisRunStore
from durable_trio._redis import open_redis, open_redis_cluster
from durable_trio.brokers import ClaimedJob, Job
from durable_trio.brokers.redis import RedisBroker, RedisBrokerBase, RedisClusterBroker
from helpers import Errors

pytestmark = pytest.mark.redis

_names = itertools.count(1)

#: Damage written over a counter: what it is, and what the broker's reason starts with.
DAMAGE = {
    "junk": (b"not a number \xff", "sequence counter unreadable"),
    "past-int64": (b"9" * 30, "sequence counter unreadable"),
    "past-2**53": (str(2**53 + 10).encode(), "sequence counter past 2**53"),
    "negative": (b"-7", "sequence counter negative"),
    "zero": (b"0", "sequence counter missing"),
    "missing": (None, "sequence counter missing"),
}


def key(queue: str, part: str) -> str:
    return f"{{{queue}}}:{part}"


async def damage(client: Any, queue: str, value: bytes | None) -> None:
    if value is None:
        await client.execute("DEL", key(queue, "seq"))
    else:
        await client.execute("SET", key(queue, "seq"), value)


def reports(errors: Errors) -> list[dt.DamagedJob]:
    return [e for e in errors.seen if isinstance(e, dt.DamagedJob)]


def set_aside(claims: list[ClaimedJob]) -> list[ClaimedJob]:
    """The reports among a pop's or a sweep's claims (no lease: already in the quarantine)."""
    return [c for c in claims if not c.lease.token]


async def queued_world(broker: RedisBrokerBase, queue: str) -> ClaimedJob:
    """Old work on ``queue``: a1, a2 (priority 0), b1 (priority 1), d1 (delayed 0.3 s, priority
    0) and a0 (priority 0, pushed first): claimed, its claim returned. a2 was retried once
    (counted), so it sits at a later place than its push's."""
    await broker.push_on(queue, Job("a0", b"a0"))
    await broker.push_on(queue, Job("a1", b"a1"))
    await broker.push_on(queue, Job("a2", b"a2"))
    await broker.push_on(queue, Job("b1", b"b1"), priority=1)
    await broker.push_on(queue, Job("d1", b"d1"), delay=0.3)
    claimed = await broker.pop_from(queue)
    assert claimed is not None
    assert claimed.id == "a0"
    # a1 then a2 popped; a1 handed back to its place, a2 retried to the back (a new place)
    first, second = await broker.pop_many(queue, 2)
    assert (first.id, second.id) == ("a1", "a2")
    assert await broker.retry_job(first.lease, queue, count_attempt=False)
    assert await broker.retry_job(second.lease, queue)
    return claimed


async def drain(broker: RedisBrokerBase, queue: str) -> list[str]:
    """Every job of ``queue`` served once (waiting for the delayed ones), in pop order."""
    served: list[str] = []
    with trio.fail_after(10):
        while True:
            jobs = await broker.pop_many(queue, 100)
            assert not set_aside(jobs), [j.damage for j in jobs]
            for job in jobs:
                assert await broker.complete_job(job.lease, queue)
                served.append(job.id)
            if not jobs and not await broker.size_of(queue):
                return served
            if not jobs:
                await trio.sleep(0.05)


async def check_one_repair(client: Any, broker: RedisBrokerBase, queue: str, reason: str) -> None:
    """Exactly one quarantine entry, the counter's; the counter past every number held."""
    entries = await broker.quarantined(queue)
    assert [e.reason for e in entries] == [reason + ", rebuilt from the queue"]
    assert entries[0].at > 0
    assert b"highest number held by the queue" in entries[0].raw
    counter = int(await client.execute("GET", key(queue, "seq")))
    ids = [int(n) for n in await client.execute("HKEYS", key(queue, "meta"))]
    assert 0 < max(ids) <= counter < 2**53


@pytest.mark.parametrize(("value", "reason"), DAMAGE.values(), ids=DAMAGE.keys())
async def test_pushes_after_a_damaged_counter_succeed_in_order(
    redis_url: str, value: bytes | None, reason: str
) -> None:
    errors = Errors()
    queue = f"seq{next(_names)}"
    async with open_redis(redis_url) as client, RedisBroker(client, on_error=errors) as broker:
        claimed = await queued_world(broker, queue)
        await damage(client, queue, value)
        await broker.push_on(queue, Job("n1", b"n1"))
        await broker.push_many(queue, [Job("n2", b"n2"), Job("nb", b"nb")], [0, 1])
        await broker.push_on(queue, Job("n3", b"n3"))
        [report] = reports(errors)  # once: the counter is whole again after the first push
        assert report.queue == queue
        assert str(report).startswith(reason + ", rebuilt from the queue")
        await check_one_repair(client, broker, queue, reason)
        # the old claim is handed back to its place: ahead of everything pushed after it
        assert await broker.retry_job(claimed.lease, queue, count_attempt=False)
        await trio.sleep(0.3)  # d1 due: promoted at the next pop, after what is ready
        served = await drain(broker, queue)
        assert served == ["a0", "a1", "a2", "n1", "n2", "n3", "d1", "b1", "nb"]
        assert len(reports(errors)) == 1
        assert len(await broker.quarantined(queue)) == 1


async def _push_on(broker: RedisBrokerBase, queue: str, claimed: ClaimedJob) -> list[ClaimedJob]:
    await broker.push_on(queue, Job("n1", b"n1"))
    return []


async def _push_many(broker: RedisBrokerBase, queue: str, claimed: ClaimedJob) -> list[ClaimedJob]:
    await broker.push_many(queue, [Job("n1", b"n1")], [0])
    return []


async def _push_and_complete(
    broker: RedisBrokerBase, queue: str, claimed: ClaimedJob
) -> list[ClaimedJob]:
    # (the results pushed onto the damaged queue, the task completed on another)
    other = queue + "-tasks"
    await broker.push_on(other, Job("t", b"t"))
    task = await broker.pop_from(other)
    assert task is not None
    assert await broker.push_and_complete_many(queue, [Job("n1", b"n1")], other, [task.lease]) == [
        True
    ]
    assert await broker.push_and_complete_many(queue, [Job("n2", b"n2")], other, []) == []
    return []


async def _finish_and_claim(
    broker: RedisBrokerBase, queue: str, claimed: ClaimedJob
) -> list[ClaimedJob]:
    other = queue + "-tasks"
    await broker.push_on(other, Job("t", b"t"))
    task = await broker.pop_from(other)
    assert task is not None
    answers, claims = await broker.finish_and_claim(
        queue, [Job("n1", b"n1")], other, [task.lease], 1
    )
    assert answers == [True]
    assert claims == []
    return []


async def _fail_and_push(broker: RedisBrokerBase, queue: str, claimed: ClaimedJob) -> list[Any]:
    assert isinstance(broker, RedisBroker)
    other = queue + "-tasks"
    await broker.push_on(other, Job("t", b"t"))
    task = await broker.pop_from(other)
    assert task is not None
    assert await broker.fail_and_push(task.lease, other, "boom", queue, Job("n1", b"n1"))
    return []


async def _requeue_failed(broker: RedisBrokerBase, queue: str, claimed: ClaimedJob) -> list[Any]:
    assert await broker.fail_job(claimed.lease, queue, "boom")
    assert await broker.requeue_failed(queue, "a0")
    return []


async def _retry(broker: RedisBrokerBase, queue: str, claimed: ClaimedJob) -> list[Any]:
    assert await broker.retry_job(claimed.lease, queue)  # counted: a new place, at the back
    return []


async def _promote(broker: RedisBrokerBase, queue: str, claimed: ClaimedJob) -> list[ClaimedJob]:
    await trio.sleep(0.3)  # d1 due
    report, a1 = await broker.pop_many(queue, 1)
    assert not report.lease.token
    assert a1.id == "a1"
    assert a1.started  # (the one claim asked for, after the report: started, as stored)
    return [report, a1]


async def _recover(broker: RedisBrokerBase, queue: str, claimed: ClaimedJob) -> list[ClaimedJob]:
    # a claim entry lost (so the sweep has no place to give it back: it takes a new one)
    n = claimed.lease.token.split(":")[0]
    await broker.client.execute("HDEL", key(queue, "claims"), n)
    recovery = await broker.recover_stalled_jobs(queue, 0.0, 5)
    assert recovery.recovered == 1
    return list(recovery.exceeded)


#: Every call that takes sequence numbers, run first after the damage: the order the jobs of
#: the queue are then served in (z: pushed last, at priority 1), and whether a0's claim is still
#: held after it.
PATHS = {
    "push_on": (_push_on, ["a0", "a1", "a2", "n1", "d1", "b1"], True),
    "push_many": (_push_many, ["a0", "a1", "a2", "n1", "d1", "b1"], True),
    "push_and_complete_many": (
        _push_and_complete, ["a0", "a1", "a2", "n1", "n2", "d1", "b1"], True
    ),
    "finish_and_claim": (_finish_and_claim, ["a0", "a1", "a2", "n1", "d1", "b1"], True),
    "fail_and_push": (_fail_and_push, ["a0", "a1", "a2", "n1", "d1", "b1"], True),
    "requeue_failed": (_requeue_failed, ["a1", "a2", "a0", "d1", "b1"], False),
    "retry": (_retry, ["a1", "a2", "a0", "d1", "b1"], False),
    "promote": (_promote, ["a0", "a1", "a2", "d1", "b1"], True),
    "recover": (_recover, ["a1", "a2", "a0", "d1", "b1"], False),
}


@pytest.mark.parametrize(("path", "expected", "held"), PATHS.values(), ids=PATHS.keys())
async def test_every_script_that_takes_sequence_numbers_repairs_the_counter(
    redis_url: str, path: Any, expected: list[str], held: bool
) -> None:
    errors = Errors()
    queue = f"seq{next(_names)}"
    async with open_redis(redis_url) as client, RedisBroker(client, on_error=errors) as broker:
        claimed = await queued_world(broker, queue)
        await damage(client, queue, b"junk")
        claims = await path(broker, queue, claimed)
        # reported once: by the broker's hook, or (a pop, a sweep) as a report among the claims
        assert len(reports(errors)) + len(set_aside(claims)) == 1
        assert [c.damage for c in set_aside(claims)] in (
            [], ["sequence counter unreadable, rebuilt from the queue"]
        )
        await check_one_repair(client, broker, queue, "sequence counter unreadable")
        # the counter is whole: no second report
        await broker.push_on(queue, Job("z", b"z"), priority=1)
        assert len(reports(errors)) + len(set_aside(claims)) == 1
        if held:
            assert await broker.retry_job(claimed.lease, queue, count_attempt=False)
        for c in claims:
            if c.lease.token:  # (handed back to its place)
                assert await broker.retry_job(c.lease, queue, count_attempt=False)
        await trio.sleep(0.3)
        served = await drain(broker, queue)
        assert served == [*expected, "z"]
        assert len(await broker.quarantined(queue)) == 1


async def test_a_fresh_queue_is_no_damage(redis_url: str) -> None:
    """The first push of a queue finds no counter: nothing to rebuild, nothing reported."""
    errors = Errors()
    async with open_redis(redis_url) as client, RedisBroker(client, on_error=errors) as broker:
        await broker.push_on("fresh", Job("a", b"a"))
        await broker.push_many("fresh2", [Job("a", b"a"), Job("b", b"b")], [0, 0])
        assert errors.seen == []
        assert await broker.quarantined("fresh") == []
        assert await client.execute("GET", key("fresh", "seq")) == b"1"
        assert await client.execute("GET", key("fresh2", "seq")) == b"2"


async def test_a_counter_of_the_wrong_type_fails_the_push_before_any_write(
    redis_url: str,
) -> None:
    """Not a string at all: the scripts' convention for a wrong-type key (an error, nothing
    written), not a repair."""
    async with open_redis(redis_url) as client, RedisBroker(client) as broker:
        await broker.push_on("wrong", Job("a", b"a"))
        await client.execute("DEL", key("wrong", "seq"))
        await client.execute("LPUSH", key("wrong", "seq"), "x")
        with pytest.raises(dt.BrokerError, match="WRONGTYPE"):
            await broker.push_on("wrong", Job("b", b"b"))
        assert await client.execute("ZCARD", key("wrong", "ready")) == 1
        assert await broker.quarantined("wrong") == []


async def test_a_damaged_counter_on_a_cluster(redis_cluster_url: str) -> None:
    errors = Errors()
    queue = f"seq{next(_names)}"
    async with (
        open_redis_cluster(redis_cluster_url) as client,
        RedisClusterBroker(client, on_error=errors) as broker,
    ):
        claimed = await queued_world(broker, queue)
        await damage(client, queue, b"junk")
        other = queue + "-tasks"  # (another slot, most likely: the push goes first, alone)
        await broker.push_on(other, Job("t", b"t"))
        task = await broker.pop_from(other)
        assert task is not None
        await broker.push_and_complete_many(queue, [Job("n1", b"n1")], other, [task.lease])
        await broker.push_on(queue, Job("n2", b"n2"))
        [report] = reports(errors)
        assert report.queue == queue
        await check_one_repair(client, broker, queue, "sequence counter unreadable")
        assert await broker.retry_job(claimed.lease, queue, count_attempt=False)
        await trio.sleep(0.3)
        assert await drain(broker, queue) == ["a0", "a1", "a2", "n1", "n2", "d1", "b1"]
        assert len(reports(errors)) == 1


# ------------------------------------------------------------------ the run store's counter

RUN_DAMAGE = {
    "junk": b"junk \xff",
    "past-int64": b"9" * 30,
    "past-2**53": str(2**53 + 10).encode(),
    "negative": b"-7",
    "zero": b"0",
    "missing": None,
}


@pytest.mark.parametrize("value", RUN_DAMAGE.values(), ids=RUN_DAMAGE.keys())
async def test_a_damaged_run_counter_does_not_break_engine_start(
    redis_url: str, value: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    app = App(f"seqruns{next(_names)}")

    @app.workflow("echo")
    async def echo(ctx: WorkflowContext, value: Any) -> Any:
        return value

    counter = f"{{dt-runs:{app.name}}}:seq"
    async with (
        dt.open_backend(redis_url) as backend,
        open_engine(app, backend, engine_id="e") as engine,
    ):
        for old in ("r1", "r2", "r3"):
            await engine.start("echo", old, run_id=old)
        if value is None:
            await backend.broker.client.execute("DEL", counter)  # type: ignore[attr-defined]
        else:
            await backend.broker.client.execute("SET", counter, value)  # type: ignore[attr-defined]
        with caplog.at_level(logging.WARNING, logger="durable_trio.redis"):
            await engine.start("echo", "n1", run_id="n1")
            await engine.start("echo", "n2", run_id="n2")
        for run_id in ("r1", "r2", "r3", "n1", "n2"):
            assert await engine.result(run_id) == run_id
        # newest first: the new runs after the old ones, in their order
        runs = await engine.list(limit=10)
        assert [r.run_id for r in runs] == ["n2", "n1", "r3", "r2", "r1"]
    [warning] = [r for r in caplog.records if "run sequence counter" in r.getMessage()]
    assert "rebuilt from the highest run seq: 3" in warning.getMessage()


async def test_a_fresh_run_store_is_no_damage(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_redis(redis_url) as client:
        store = RedisRunStore(client, "fresh")
        with caplog.at_level(logging.WARNING, logger="durable_trio.redis"):
            await store.create_run(RunRecord("a", "w", None, RunStatus.PENDING, 0, 0))
            await store.create_run(RunRecord("b", "w", None, RunStatus.PENDING, 0, 0))
        assert caplog.records == []
        assert [r.run_id for r in await store.list_runs()] == ["b", "a"]


async def test_dispatch_after_a_damaged_counter_flows_through_the_transport(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's symptom: every dispatch to the queue raised a raw ``RedisReplyError``."""
    errors = Errors()
    served: list[str] = []

    async def work(t: dt.RemoteTask) -> str:
        served.append(t.step_id)
        return t.step_id

    def task(step: str) -> dt.RemoteTask:
        return dt.RemoteTask(run_id="r", step_id=step, attempt=1, name="work")

    ns = f"seqns{next(_names)}"
    async with (
        dt.open_backend(redis_url) as backend,
        dt.open_queue_transport(backend, namespace=ns, poll_interval=0.05) as producer,
    ):
        queue = producer.names.task_queue("work")
        for step in ("g1", "g2", "g3"):
            await producer.dispatch(task(step))
        await backend.broker.client.execute("SET", key(queue, "seq"), b"junk")  # type: ignore[attr-defined]
        with caplog.at_level(logging.WARNING, logger="durable_trio.redis"):
            for step in ("g4", "g5"):
                await producer.dispatch(task(step))
        [warning] = [r for r in caplog.records if "sequence counter" in r.getMessage()]
        assert "sequence counter unreadable, rebuilt from the queue" in warning.getMessage()
        async with dt.open_queue_transport(
            backend, namespace=ns, poll_interval=0.05, on_error=errors
        ) as worker:
            worker.handle("work", work)
            with trio.fail_after(10):
                while len(served) < 5:  # noqa: ASYNC110  (the state is in Redis)
                    await trio.sleep(0.05)
        assert served == ["g1", "g2", "g3", "g4", "g5"]
        assert errors.seen == []
        entries = await backend.broker.quarantined(queue)  # type: ignore[attr-defined]
        assert len(entries) == 1
