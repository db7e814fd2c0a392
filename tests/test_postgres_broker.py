"""The PostgreSQL broker (``durable_trio.brokers.postgres``) beyond the shared contract suite:
wake-ups by NOTIFY across brokers and after a lost listener, damaged rows, a server restart,
``SKIP LOCKED`` under concurrent consumers, claims ahead, stall evidence and the notify hub.

The real clock throughout (the server's clock does not follow a MockClock); each test uses a
schema of its own on the session's private server.
"""

from __future__ import annotations

import uuid
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from _postgres_server import *  # noqa: F403  (the private server fixture)
from durable_trio._errors import BrokerError, BrokerUnavailable
from durable_trio._postgres import open_notify_hub, open_pool, schema_versions
from durable_trio.brokers import Job, Lease
from durable_trio.brokers.postgres import PostgresBroker, channel_for
from durable_trio.brokers.postgres._broker import MUX_MIN_POOL
from durable_trio.keys.memory import MemoryKeyStore

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from _postgres_server import PostgresServer

pytestmark = pytest.mark.postgres

Q = "t:tasks:pg"


def _schema() -> str:
    return f"t_{uuid.uuid4().hex[:16]}"


def _named(url: str, name: str) -> str:
    """``url`` with an ``application_name`` (to find its backends in ``pg_stat_activity``)."""
    return f"{url}?application_name={name}"


def job(n: int | str) -> Job:
    return Job(f"job-{n}", f'{{"n":"{n}"}}'.encode())


@asynccontextmanager
async def broker_on(
    url: str, schema: str, *, fast_backoff: bool = False, **options: Any
) -> AsyncIterator[PostgresBroker]:
    """A broker with its own pool and hub on ``schema`` (attached: migrations applied)."""
    backoff: dict[str, Any] = {"backoff_max": 0.2} if fast_backoff else {}
    async with (
        open_pool(url, size=8, **backoff) as pool,
        open_notify_hub(url, **backoff) as hub,
    ):
        broker = await PostgresBroker.attach(pool, schema, hub, **options)
        async with broker:
            yield broker


async def _eventually(check: Any, *, within: float = 30.0) -> Any:
    """Call ``check()`` until it returns without a broker error (the server is coming back)."""
    with trio.fail_after(within):
        while True:
            try:
                return await check()
            except BrokerError:
                await trio.sleep(0.05)


async def _until(check: Callable[[], object], *, within: float) -> None:
    """Wait until ``check()`` holds (a list that callbacks of another task fill)."""
    with trio.fail_after(within):
        while not check():  # noqa: ASYNC110  (filled by callbacks, not an event of ours)
            await trio.sleep(0.02)


async def _listener_pid(broker: PostgresBroker, name: str) -> int:
    """The backend of the hub's LISTEN connection (``application_name`` ``name``)."""
    with trio.fail_after(10):
        while True:
            pid = await broker.pool.fetchval(
                "SELECT pid FROM pg_stat_activity WHERE application_name = $1 "
                "AND query LIKE 'LISTEN%' LIMIT 1",
                name,
            )
            if pid is not None:
                return int(pid)
            await trio.sleep(0.02)


# -- wake-ups ---------------------------------------------------------------------------------


async def test_a_push_wakes_a_waiter_of_another_broker(postgres_url: str) -> None:
    schema = _schema()
    async with (
        broker_on(postgres_url, schema, poll_interval=300) as producer,
        broker_on(postgres_url, schema, poll_interval=300) as consumer,
    ):
        woke = trio.Event()

        async def wait() -> None:
            await consumer.wait_for_work(Q)
            woke.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.sleep(0.3)  # (let the waiter listen and look: nothing there)
            assert not woke.is_set()
            await producer.push_on(Q, job(1))
            with trio.fail_after(10):  # far below the 300 s poll: the NOTIFY woke it
                await woke.wait()
        claimed = await consumer.pop_from(Q)
        assert claimed is not None
        assert claimed.id == "job-1"


async def test_a_waiter_wakes_when_its_delayed_job_comes_due(postgres_url: str) -> None:
    async with broker_on(postgres_url, _schema(), poll_interval=300) as broker:
        await broker.push_on(Q, job("later"), delay=0.5)
        assert await broker.pop_from(Q) is None
        with trio.fail_after(10):
            await broker.wait_for_work(Q)
        claimed = await broker.pop_from(Q)
        assert claimed is not None
        assert claimed.id == "job-later"


async def test_a_delayed_push_by_another_broker_moves_the_waiters_due_time(
    postgres_url: str,
) -> None:
    schema = _schema()
    async with (
        broker_on(postgres_url, schema, poll_interval=300) as producer,
        broker_on(postgres_url, schema, poll_interval=300) as consumer,
    ):
        async with trio.open_nursery() as nursery:
            done = trio.Event()

            async def wait() -> None:
                await consumer.wait_for_work(Q)
                done.set()

            nursery.start_soon(wait)
            await trio.sleep(0.3)
            await producer.push_on(Q, job("soon"), delay=0.5)  # NOTIFY "later": look again
            with trio.fail_after(10):
                await done.wait()
        assert (await consumer.pop_from(Q)) is not None


async def test_every_waiter_wakes_once_after_the_listener_is_terminated(
    postgres_url: str,
) -> None:
    name = f"hub_{uuid.uuid4().hex[:8]}"
    async with broker_on(_named(postgres_url, name), _schema(), poll_interval=300) as broker:
        woke: list[str] = []

        async def wait(queue: str) -> None:
            await broker.wait_for_work(queue)
            woke.append(queue)

        async with trio.open_nursery() as nursery:
            for queue in ("a", "b", "c"):
                nursery.start_soon(wait, queue)
            pid = await _listener_pid(broker, name)
            await trio.sleep(0.3)
            assert woke == []
            assert await broker.pool.fetchval("SELECT pg_terminate_backend($1)", pid) is True
            # Nothing was pushed: the reconnect woke them.
            await _until(lambda: len(woke) >= 3, within=20)
        assert sorted(woke) == ["a", "b", "c"]

        # Listening again: a push wakes a new waiter at once.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait, "a")
            await trio.sleep(0.3)
            await broker.push_on("a", job(1))
            await _until(lambda: len(woke) >= 4, within=10)


async def test_a_batch_push_notifies_once(postgres_url: str) -> None:
    """PostgreSQL folds a transaction's identical notifications; a batch sends one anyway."""
    schema = _schema()
    async with (
        broker_on(postgres_url, schema) as broker,
        open_notify_hub(postgres_url) as hub,
    ):
        seen: list[str | None] = []
        await hub.subscribe(channel_for(schema, Q), seen.append)
        await broker.push_many(Q, [job(n) for n in range(50)], [None] * 50)
        await broker.push_on(Q, job("x"))
        await _until(lambda: len(seen) >= 2, within=10)
        await trio.sleep(0.2)
        assert seen == ["", ""]
        assert await broker.size_of(Q) == 51


def test_channel_names_are_short_safe_and_distinct() -> None:
    odd = ["q", "t:tasks:shop", "x" * 500, 'quo"te; DROP', "ünïcode ✓", ""]
    names = {channel_for("durable_trio", queue) for queue in odd}
    assert len(names) == len(odd)
    for name in names:
        assert name.isascii()
        assert name.replace("_", "").isalnum()
        assert len(name) <= 63
    assert channel_for("a", "q") != channel_for("b", "q")


# -- finalizes -------------------------------------------------------------------------------


async def _drain_through(broker: PostgresBroker, jobs: int) -> None:
    """``jobs`` steps dispatched and run by a transport at concurrency 10 on ``broker``."""
    backend = dt.Backend(url="test://", broker=broker, keys=MemoryKeyStore())
    done: set[str] = set()
    all_done = trio.Event()
    async with dt.open_queue_transport(backend, concurrency=10) as transport:

        async def step(task: dt.RemoteTask) -> None:
            await trio.lowlevel.checkpoint()
            done.add(task.step_id)
            if len(done) == jobs:
                all_done.set()

        transport.handle("step", step)
        await transport.dispatch_many(
            [dt.RemoteTask(run_id="r", step_id=str(n), attempt=1, name="step") for n in range(jobs)]
        )
        with trio.fail_after(60):
            await all_done.wait()


async def test_a_small_pool_keeps_its_connections_shared_and_finalizes_one_call_at_a_time(
    postgres_url: str,
) -> None:
    """On a pool smaller than MUX_MIN_POOL no connection is set aside for the finish-and-claim
    calls (a pool of one would have none left for the rest): they share the pool, one at a
    time, and a worker drains its queue as on any pool."""
    async with (
        open_pool(postgres_url, size=MUX_MIN_POOL - 1) as pool,
        open_notify_hub(postgres_url) as hub,
    ):
        broker = await PostgresBroker.attach(pool, _schema(), hub)
        async with broker:
            assert broker.finalize_in_halves is False
            await _drain_through(broker, 100)
            assert broker._mux is None


async def test_finalizes_go_in_two_halves_pipelined_on_one_connection(postgres_url: str) -> None:
    """docs/decisions.md, "PostgreSQL finalizes in two halves on one pipelined connection": a
    worker at concurrency 10 has at most two finish-and-claim transactions that claim in
    flight, both on the broker's one pipelined connection, and its finishes share calls."""
    async with broker_on(postgres_url, _schema()) as broker:
        assert broker.finalize_in_halves is True
        flying = most = calls = 0
        inner = broker.finish_and_claim

        async def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal flying, most, calls
            claims = args[4] > 0  # (a finish that claims nothing is the other coalescer's)
            flying += claims
            calls += claims
            most = max(most, flying)
            try:
                return await inner(*args, **kwargs)
            finally:
                flying -= claims

        broker.finish_and_claim = counted  # type: ignore[method-assign]
        await _drain_through(broker, 200)
        assert 1 <= most <= 2
        assert 0 < calls < 200
        live = broker._mux._live if broker._mux is not None else None
        assert live is not None
        assert live.error is None  # one connection served every call


# -- the notify hub ---------------------------------------------------------------------------


async def test_hub_fans_out_and_says_none_after_a_reconnect(postgres_url: str) -> None:
    name = f"hub_{uuid.uuid4().hex[:8]}"
    async with (
        open_pool(postgres_url, size=2) as pool,
        open_notify_hub(_named(postgres_url, name)) as hub,
    ):
        first: list[str | None] = []
        second: list[str | None] = []
        other: list[str | None] = []
        await hub.subscribe("chan", first.append)
        await hub.subscribe("chan", second.append)
        await hub.subscribe("other", other.append)
        await pool.execute("SELECT pg_notify('chan', 'hello')")
        await _until(lambda: second, within=10)
        assert first == second == ["hello"]
        assert other == []
        pid = await pool.fetchval(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1", name
        )
        assert await pool.fetchval("SELECT pg_terminate_backend($1)", pid) is True
        await _until(lambda: other, within=20)
        assert first == second == ["hello", None]
        assert other == [None]
        await hub.unsubscribe("chan", first.append)  # (an equal bound method: removed)
        await pool.execute("SELECT pg_notify('chan', 'again')")
        await _until(lambda: len(second) >= 3, within=10)
        assert first == ["hello", None]
        assert second == ["hello", None, "again"]
        assert hub.channels == {"chan", "other"}


async def test_hub_subscribe_soon_says_none_once_the_channel_is_listened_to(
    postgres_url: str,
) -> None:
    """A run store's first waiter subscribes from synchronous code: a NOTIFY committed before the
    ``LISTEN`` is not heard, so the callback is called with ``None`` once it is active (its
    waiters look again then, not at their poll); later notifications arrive as they are."""
    async with (
        open_pool(postgres_url, size=2) as pool,
        open_notify_hub(postgres_url) as hub,
    ):
        heard: list[str | None] = []
        hub.subscribe_soon("soon", heard.append)
        await _until(lambda: heard, within=10)
        assert heard == [None]
        assert "soon" in hub.channels
        await pool.execute("SELECT pg_notify('soon', 'later')")
        await _until(lambda: len(heard) >= 2, within=10)
        assert heard == [None, "later"]


# -- damaged rows -----------------------------------------------------------------------------


async def test_damaged_rows_are_set_aside(postgres_url: str) -> None:
    schema = _schema()
    async with broker_on(postgres_url, schema) as broker:
        pool = broker.pool
        await pool.execute(
            f"INSERT INTO {schema}.broker_jobs (queue, id, data, state) VALUES ($1, NULL, $2, "
            "'ready')",
            Q,
            b"orphan bytes",
        )
        await pool.execute(
            f"INSERT INTO {schema}.broker_jobs (queue, id, data, state, attempts, stalls) "
            "VALUES ($1, 'bad', NULL, 'ready', -3, 'junk')",
            Q,
        )
        await pool.execute(
            f"INSERT INTO {schema}.broker_jobs (queue, id, data, state, due_at) "
            "VALUES ($1, 'never', 'x', 'delayed', 'NaN')",
            Q,
        )
        await broker.push_on(Q, job("good"))
        claims = await broker.pop_many(Q, 10)
        by_id = {claim.id: claim for claim in claims}
        (report,) = [claim for claim in claims if claim.lease.token == ""]
        assert report.damage == "id: NULL, not a job id"
        bad = by_id["bad"]
        assert bad.damage is not None
        assert "data: NULL" in bad.damage
        assert "attempts: -3" in bad.damage
        assert "stalls: 'junk'" in bad.damage
        assert "due_at: NaN" in (by_id["never"].damage or "")
        assert by_id["job-good"].damage is None
        (entry,) = await broker.quarantined(Q)
        assert entry.reason == "id: NULL, not a job id"
        assert entry.raw.startswith(b"id=NULL")
        assert entry.raw.endswith(b"data=orphan bytes")
        # Failed as damaged (as the transport does), the row stays inspectable.
        assert await broker.fail_job(bad.lease, Q, f"damaged: {bad.damage}") is True
        (failed,) = await broker.failed_jobs(Q)
        assert failed.id == "bad"
        assert failed.error.startswith("damaged: ")
        assert "[unreadable:" not in failed.error  # every problem already named in it
        assert await broker.size_of(Q) == 0


# -- a server restart -------------------------------------------------------------------------


@pytest.mark.chaos
async def test_a_server_restart_is_unavailable_then_recovered(
    postgres_url: str, postgres_server: PostgresServer
) -> None:
    async with broker_on(postgres_url, _schema(), fast_backoff=True, poll_interval=300) as broker:
        await broker.push_on(Q, job("durable"))
        woke = trio.Event()

        async def wait() -> None:
            await broker.wait_for_work("idle")
            woke.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.sleep(0.3)
            # ("fast": the private server runs with synchronous_commit off, so a crash may lose
            # the last commits, this test's schema among them; a fast stop keeps them.)
            await trio.to_thread.run_sync(postgres_server.stop, "fast")
            try:
                with pytest.raises(BrokerUnavailable):
                    await broker.size_of(Q)
                with pytest.raises(BrokerUnavailable):
                    await broker.push_on(Q, job("lost"))
            finally:
                await trio.to_thread.run_sync(postgres_server.start)
            # The waiter returns once the hub listens again (or its look failed meanwhile).
            with trio.fail_after(30):
                await woke.wait()
        claimed = await _eventually(lambda: broker.pop_from(Q))
        assert claimed is not None
        assert claimed.id == "job-durable"
        assert await broker.complete_job(claimed.lease, Q) is True
        # And the wake-ups work again.
        async with trio.open_nursery() as nursery:
            woke = trio.Event()
            nursery.start_soon(wait)
            await trio.sleep(0.5)
            await _eventually(lambda: broker.push_on("idle", job("after")))
            with trio.fail_after(20):
                await woke.wait()


# -- concurrency ------------------------------------------------------------------------------


async def test_skip_locked_concurrent_consumers_claim_each_job_once(postgres_url: str) -> None:
    schema = _schema()
    total = 300
    claimed: list[str] = []
    async with (
        broker_on(postgres_url, schema) as first,
        broker_on(postgres_url, schema) as second,
    ):
        await first.push_many(Q, [job(n) for n in range(total)], [None] * total)

        async def consume(broker: PostgresBroker, worker: str) -> None:
            while True:
                jobs = await broker.pop_many(Q, 7, worker=worker)
                if not jobs:
                    return
                claimed.extend(claim.id for claim in jobs)
                assert all(await broker.complete_many(Q, [c.lease for c in jobs]))

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for n in range(12):
                    nursery.start_soon(consume, first if n % 2 else second, f"w{n}")
        assert len(claimed) == total
        assert sorted(claimed) == sorted(f"job-{n}" for n in range(total))
        assert await first.size_of(Q) == 0
        assert await first.pool.fetchval(f"SELECT count(*) FROM {schema}.broker_jobs") == 0


# -- claims ahead, stalls, finish and claim ---------------------------------------------------


async def test_claims_ahead_stall_uncounted_and_poison_is_exceeded(postgres_url: str) -> None:
    async with broker_on(postgres_url, _schema()) as broker:
        for n in range(3):
            await broker.push_on(Q, job(n))
        claims = await broker.pop_ahead(Q, 1, 2, worker="w1")
        assert [(c.id, c.started) for c in claims] == [
            ("job-0", True),
            ("job-1", False),
            ("job-2", False),
        ]
        assert await broker.mark_started(Q, [claims[1].lease, Lease("job-x", "nope")]) == [
            True,
            False,
        ]
        recovery = await broker.recover_stalled_jobs(Q, 0.0, max_stalled=1)
        assert recovery.recovered == 3
        again = {c.id: c for c in await broker.pop_many(Q, 3, worker="w2")}
        assert again["job-0"].stalled_count == 1
        assert again["job-1"].stalled_count == 1
        assert again["job-2"].stalled_count == 0  # held ahead, never started: uncounted
        assert again["job-2"].stalls[0].counted is False
        assert again["job-0"].started is False  # a suspect is handed over not started
        # job-0 stalls a second time while started: past max_stalled=1, re-leased as poison.
        await broker.mark_started(Q, [again["job-0"].lease])
        recovery = await broker.recover_stalled_jobs(Q, 0.0, max_stalled=1)
        poison = {c.id: c for c in recovery.exceeded}
        assert set(poison) == {"job-0"}
        assert poison["job-0"].stalled_count == 2
        assert [s.worker for s in poison["job-0"].stalls] == ["w1", "w2"]
        assert await broker.complete_job(again["job-0"].lease, Q) is False  # the old lease
        assert await broker.fail_job(poison["job-0"].lease, Q, "poison") is True


async def test_finish_and_claim_in_one_round_trip(postgres_url: str) -> None:
    async with broker_on(postgres_url, _schema()) as broker:
        for n in range(4):
            await broker.push_on(Q, job(n))
        first = await broker.pop_many(Q, 2)
        done, claims = await broker.finish_and_claim(
            "results", [job("r0"), job("r1")], Q, [c.lease for c in first] + [first[0].lease], 5
        )
        assert done == [True, True, False]
        assert [c.id for c in claims] == ["job-2", "job-3"]
        assert await broker.size_of("results") == 2
        stats = await broker.queue_stats(Q)
        assert (stats.ready, stats.delayed, stats.claimed, stats.failed) == (0, 0, 2, 0)
        assert await broker.job_states(Q, ["job-2", "job-0"]) == [
            await broker.job_state(Q, "job-2"),
            None,
        ]
        assert await broker.queues_with_claims([Q, "results"]) == [Q]
        assert await broker.known_queues("") == ["results", Q]


async def test_requeue_and_delete_failed(postgres_url: str) -> None:
    async with broker_on(postgres_url, _schema(), failed_retention=2) as broker:
        for n in range(3):
            await broker.push_on(Q, job(n), priority=4)
            claim = await broker.pop_from(Q)
            assert claim is not None
            await broker.fail_job(claim.lease, Q, f"boom {n}")
        assert [f.id for f in await broker.failed_jobs(Q)] == ["job-2", "job-1"]  # retention
        assert await broker.requeue_failed(Q, "job-2") is True
        assert await broker.requeue_failed(Q, "job-2") is False
        assert await broker.delete_failed(Q, "job-1") is True
        assert await broker.failed_jobs(Q) == []
        again = await broker.pop_from(Q)
        assert again is not None
        assert (again.id, again.priority, again.attempts) == ("job-2", 4, 0)


async def test_attach_migrates_once(postgres_url: str) -> None:
    schema = _schema()
    async with broker_on(postgres_url, schema) as broker:
        async with broker_on(postgres_url, schema):
            pass
        assert await schema_versions(broker.pool, schema) == {"broker": 5, "store": 1}


# -- the call's bound -------------------------------------------------------------------------


async def test_a_call_past_its_bound_is_unavailable_and_its_connection_made_safe(
    postgres_url: str,
) -> None:
    """A call's statements have no timeout of their own: the call's one shielded scope bounds
    them; past it the statement is cancelled on the server, the connection drained and reused."""
    schema = _schema()
    async with broker_on(postgres_url, schema, call_timeout=0.5) as broker:
        await broker.push_on(Q, job(1))
        stats = broker.pool.connection_stats
        before = (stats.interrupted, stats.recovered)
        async with broker.pool.transaction() as locker:
            await locker.execute(f"LOCK TABLE {schema}.broker_jobs IN ACCESS EXCLUSIVE MODE")
            with pytest.raises(BrokerUnavailable, match=r"within 0.5s \(it may have run\)"):
                await broker.pop_from(Q)
        assert (stats.interrupted, stats.recovered) == (before[0] + 1, before[1] + 1)
        claimed = await broker.pop_from(Q)
        assert claimed is not None
        assert claimed.id == "job-1"


async def test_a_call_cancelled_after_it_started_runs_to_its_end(postgres_url: str) -> None:
    schema = _schema()
    async with broker_on(postgres_url, schema) as broker:
        await broker.push_on(Q, job(1))
        got: list[object] = []
        scope = trio.CancelScope()

        async def claim() -> None:
            with scope:
                got.append(await broker.pop_from(Q))
                await trio.lowlevel.checkpoint()  # (the cancellation comes here)

        async with trio.open_nursery() as nursery:
            async with broker.pool.transaction() as locker:
                await locker.execute(f"LOCK TABLE {schema}.broker_jobs IN ACCESS EXCLUSIVE MODE")
                nursery.start_soon(claim)
                await trio.sleep(0.2)  # (the claim waits for the lock on the server)
                scope.cancel()
                await trio.sleep(0.2)  # (still waiting: the call is shielded)
                assert got == []
            # the lock released (the block rolled back): the claim goes on
        assert scope.cancelled_caught
        # The claim ran to its end (shielded) and returned; the cancellation came after it.
        assert len(got) == 1
        state = await broker.job_state(Q, "job-1")
        assert state is not None
        assert state.claimed


# -- under the transport ----------------------------------------------------------------------


async def test_the_transport_runs_steps_on_it_and_sets_damage_aside(postgres_url: str) -> None:
    schema = _schema()
    errors: list[BaseException] = []
    results: list[dt.StepResult] = []
    async with broker_on(postgres_url, schema, poll_interval=300) as broker:
        backend = dt.Backend(url="test://", broker=broker, keys=MemoryKeyStore())
        async with dt.open_queue_transport(
            backend, namespace="pg", on_error=errors.append, concurrency=4
        ) as transport:
            held = trio.Event()

            async def double(t: dt.RemoteTask) -> Any:
                if t.input["n"] == 0:
                    await held.wait()  # claimed meanwhile: its queue is known
                return t.input["n"] * 2

            async def on_result(result: dt.StepResult) -> None:
                results.append(result)

            transport.handle("double", double)
            transport.on_result(on_result)
            for n in range(20):
                await transport.dispatch(
                    dt.RemoteTask(f"run-{n}", "s", 1, "double", input={"n": n})
                )
            await _until(lambda: len(results) >= 19, within=30)
            (queue,) = await broker.queues_with_claims(await broker.known_queues("pg:"))
            held.set()
            await _until(lambda: len(results) >= 20, within=30)
            # A row another program damaged, on the queue the transport serves.
            await broker.pool.execute(
                f"INSERT INTO {schema}.broker_jobs (queue, id, data, state, stalls) "
                "VALUES ($1, 'broken', 'x', 'ready', 'junk')",
                queue,
            )
            await broker.push_on(queue, Job("poke", b"not json"))  # (its NOTIFY wakes the loop)
            await _until(lambda: len(errors) >= 2, within=30)
        assert sorted(r.output for r in results) == [n * 2 for n in range(20)]
        assert any(isinstance(e, dt.DamagedJob) and "stalls" in str(e) for e in errors)
        failed = {f.id: f for f in await broker.failed_jobs(queue)}
        assert "broken" in failed
        assert "stalls" in failed["broken"].error
        assert await broker.size_of(queue) == 0
