"""The PostgreSQL broker's fleet-wide limits beyond the contract (tests/test_broker_limits.py):
exact under concurrent claimers of two brokers (two pools) on one schema, the advisory lock a
limited queue's claims take and an unlimited one's do not, a freed slot waking another broker's
waiter by NOTIFY, and a schema from before limits migrated.

The real clock throughout (the server's clock does not follow a MockClock); each test uses a
schema of its own on the session's private server.
"""

from __future__ import annotations

import random
import uuid
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from _postgres_server import *  # noqa: F403  (the private server fixture)
from durable_trio._postgres import migrate, open_notify_hub, open_pool, quote_ident
from durable_trio.brokers import ClaimedJob, Job, SupportsQueueLimits
from durable_trio.brokers.postgres import PostgresBroker
from durable_trio.brokers.postgres._operations import lock_key
from durable_trio.brokers.postgres._schema import MIGRATIONS, PART

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.postgres

Q = "t:tasks:pg-limits"
U = "t:tasks:pg-unlimited"


def _schema() -> str:
    return f"t_{uuid.uuid4().hex[:16]}"


def job(n: int | str, key: str | None = None) -> Job:
    return Job(f"job-{n}", f'{{"n":"{n}"}}'.encode(), key)


@asynccontextmanager
async def broker_on(url: str, schema: str, **options: Any) -> AsyncIterator[PostgresBroker]:
    """A broker with its own pool and hub on ``schema`` (attached: migrations applied)."""
    async with open_pool(url, size=6) as pool, open_notify_hub(url) as hub:
        broker = await PostgresBroker.attach(pool, schema, hub, **options)
        async with broker:
            yield broker


def test_the_postgres_broker_keeps_limits() -> None:
    """So the contract suite (tests/test_broker_limits.py) runs on it instead of skipping."""
    assert issubclass(PostgresBroker, SupportsQueueLimits)


@pytest.mark.parametrize("per_key", [False, True], ids=["queue", "per-key"])
async def test_two_brokers_claiming_at_once_never_exceed_the_limit(
    postgres_url: str, per_key: bool
) -> None:
    """8 claimers on two brokers (two pools), every claim path, limit 3: never more than 3
    live claims of the queue (or of one key), and the limit is reached."""
    schema = _schema()
    limit, jobs = 3, 150
    keys: list[str | None] = ["hot", "hot", "cold", None] if per_key else [None]
    live: dict[str, int] = {}
    most: dict[str, int] = {}
    done: set[str] = set()

    def hold(claims: list[ClaimedJob], key_of: dict[str, str]) -> None:
        for claim in claims:
            key = key_of[claim.id] if per_key else ""
            live[key] = live.get(key, 0) + 1
            most[key] = max(most.get(key, 0), live[key])
            assert live[key] <= limit, f"{live[key]} live claims of {key!r}, limit {limit}"

    def release(claims: list[ClaimedJob], key_of: dict[str, str]) -> None:
        for claim in claims:  # (before the broker frees the slot: never counted low)
            live[key_of[claim.id] if per_key else ""] -= 1
            done.add(claim.id)

    async with broker_on(postgres_url, schema) as a, broker_on(postgres_url, schema) as b:
        await a.set_queue_limit(Q, limit, per_key=per_key)
        pushed = [job(n, keys[n % len(keys)]) for n in range(jobs)]
        key_of = {j.id: j.key or "" for j in pushed}
        await a.push_many(Q, pushed, [None] * jobs)

        async def claimer(i: int) -> None:
            broker, rng, worker = (a, b)[i % 2], random.Random(i), f"w{i}"
            got: list[ClaimedJob] = []
            while len(done) < jobs:
                if not got:
                    path = rng.randrange(3)
                    if path == 0:
                        one = await broker.pop_from(Q, worker=worker)
                        got = [one] if one is not None else []
                    elif path == 1:
                        got = await broker.pop_many(Q, rng.randint(1, 4), worker=worker)
                    else:
                        got = await broker.pop_ahead(Q, 1, rng.randint(0, 3), worker=worker)
                    if not got:
                        with trio.move_on_after(0.2):
                            await broker.wait_for_work(Q)
                        continue
                    hold(got, key_of)
                await trio.sleep(rng.uniform(0, 0.01))
                leases = [claim.lease for claim in got]
                release(got, key_of)
                if rng.random() < 0.5:
                    answers, got = await broker.finish_and_claim(
                        "t:results", [], Q, leases, rng.randint(0, 3), worker=worker
                    )
                    hold(got, key_of)
                else:
                    answers, got = await broker.complete_many(Q, leases), []
                assert all(answers)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(claimer, i)
        assert len(done) == jobs
        assert (await a.queue_stats(Q)).claimed == 0
    assert max(most.values()) == limit  # the claimers did contend for the slots


async def test_a_broker_that_never_saw_the_limit_claims_under_it_at_once(
    postgres_url: str,
) -> None:
    """A claim sends the plain statement first for a queue its process knows no limit of
    (unlimited queues pay nothing); on a queue found limited it claims nothing, and the call
    claims again under the lock: every path is exact from the first call."""
    schema = _schema()
    async with (
        broker_on(postgres_url, schema) as a,
        broker_on(postgres_url, schema) as b,
        broker_on(postgres_url, schema) as c,
    ):
        await a.set_queue_limit(Q, 2)
        for n in range(6):
            await a.push_on(Q, job(n))
        assert [claim.id for claim in await b.pop_many(Q, 4)] == ["job-0", "job-1"]
        assert await c.pop_from(Q) is None
        await a.set_queue_limit(Q, 3)
        done, claims = await c.finish_and_claim("t:results", [], Q, [], 4)
        assert (done, [claim.id for claim in claims]) == ([], ["job-2"])
        await a.set_queue_limit(Q, None)  # b still thinks it limited: right all the same
        assert [claim.id for claim in await b.pop_many(Q, 4)] == ["job-3", "job-4", "job-5"]


async def test_a_limited_queue_claims_under_its_advisory_lock_and_an_unlimited_one_takes_none(
    postgres_url: str,
) -> None:
    schema = _schema()
    async with broker_on(postgres_url, schema) as broker:
        await broker.set_queue_limit(Q, 2)
        await broker.push_on(Q, job("limited"))
        await broker.push_on(U, job("free"))
        release = trio.Event()

        async def hold_the_lock(queue: str, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            async with broker.pool.transaction() as conn:
                await conn.execute(
                    "SELECT pg_advisory_xact_lock($1::bigint)", lock_key(quote_ident(schema), queue)
                )
                task_status.started()
                await release.wait()

        claimed: list[str] = []

        async def pop_limited() -> None:
            claim = await broker.pop_from(Q)
            assert claim is not None
            claimed.append(claim.id)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(hold_the_lock, Q)
                await nursery.start(hold_the_lock, U)  # (nobody takes U's: it has no limit)
                free = await broker.pop_from(U)
                assert free is not None
                assert free.id == "job-free"
                nursery.start_soon(pop_limited)
                await trio.sleep(0.3)
                assert claimed == []  # waits for the queue's lock
                release.set()
        assert claimed == ["job-limited"]


async def test_a_freed_slot_wakes_another_brokers_waiter_by_notify(postgres_url: str) -> None:
    schema = _schema()
    # poll_interval 30 s: only a NOTIFY can wake the waiter within the bound below.
    async with broker_on(postgres_url, schema) as a, broker_on(postgres_url, schema) as b:
        await a.set_queue_limit(Q, 1)
        await a.push_on(Q, job(1))
        await a.push_on(Q, job(2))
        held = await a.pop_from(Q)
        assert held is not None
        assert await b.pop_from(Q) is None
        woke: list[float] = []

        async def waiter() -> None:
            await b.wait_for_work(Q)
            woke.append(trio.current_time())

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                await trio.sleep(0.3)
                assert woke == []  # at the limit: no work, no spin
                freed = trio.current_time()
                assert await a.complete_job(held.lease, Q)
        assert woke[0] - freed < 2.0
        again = await b.pop_from(Q)
        assert again is not None
        assert again.id == "job-2"


async def test_a_failed_lease_frees_its_slot_and_a_requeue_keeps_the_key(
    postgres_url: str,
) -> None:
    async with broker_on(postgres_url, _schema()) as broker:
        await broker.set_queue_limit(Q, 1, per_key=True)
        await broker.push_on(Q, job(1, "k"))
        await broker.push_on(Q, job(2, "k"))
        one = await broker.pop_from(Q)
        assert one is not None
        assert await broker.fail_and_push(one.lease, Q, "boom", "t:results", job("r"))
        (failed,) = await broker.failed_jobs(Q)
        assert (failed.id, failed.key) == ("job-1", "k")
        two = await broker.pop_from(Q)
        assert two is not None
        assert await broker.requeue_failed(Q, "job-1")
        assert await broker.pop_from(Q) is None  # key "k" full
        assert await broker.complete_job(two.lease, Q)
        back = await broker.pop_from(Q)
        assert back is not None
        assert back.id == "job-1"


async def test_a_schema_from_before_limits_is_migrated(postgres_url: str) -> None:
    schema = _schema()
    async with open_pool(postgres_url, size=2) as pool:
        await migrate(pool, schema, PART, MIGRATIONS[:2])
        await pool.execute(
            f"INSERT INTO {quote_ident(schema)}.broker_jobs (queue, id, data, state) "
            "VALUES ($1, 'job-old', '\\x7b7d'::bytea, 'ready')",
            Q,
        )
    async with broker_on(postgres_url, schema) as broker:
        await broker.set_queue_limit(Q, 1, per_key=True)
        await broker.push_on(Q, job("new"))  # the old job and this one: key ""
        await broker.push_on(Q, job("keyed", "k"))
        claims = await broker.pop_many(Q, 5)
        assert [c.id for c in claims] == ["job-old", "job-keyed"]
        assert await broker.complete_job(claims[0].lease, Q)
        assert [c.id for c in await broker.pop_many(Q, 5)] == ["job-new"]


async def test_workers_on_a_postgres_backend_hold_a_step_limit(postgres_schema_url: str) -> None:
    """End to end: ``open_worker`` accepts a limit on PostgreSQL and the fleet holds it (two
    workers of 4 slots each, ``max_concurrency=2``); the waiting workers are woken by the freed
    slots' NOTIFY (their safety poll is 30 s: the bound below would fail on it)."""
    running = {"now": 0, "most": 0}
    app = dt.App("pglimits")

    @app.step("call", max_concurrency=2)
    async def call(n: int) -> int:
        running["now"] += 1
        running["most"] = max(running["most"], running["now"])
        await trio.sleep(0.1)
        running["now"] -= 1
        return n

    @app.workflow("wf")
    async def wf(ctx: dt.WorkflowContext, n: int) -> int:
        return int(await ctx.step("call", n))

    with trio.fail_after(20):
        async with dt.open_backend(postgres_schema_url) as backend:
            async with (
                dt.open_worker(app, backend, concurrency=4),
                dt.open_worker(app, backend, concurrency=4),
                dt.open_engine(app, backend) as engine,
            ):
                ids = [await engine.start("wf", n) for n in range(8)]
                results = [await engine.result(run_id) for run_id in ids]
                async with dt.open_operations(backend, namespace="pglimits") as ops:
                    limits = {v.group: (v.limit, v.per_key) for v in await ops.queues()}
    assert results == list(range(8))
    assert running["most"] == 2
    assert limits["call"] == (2, False)
