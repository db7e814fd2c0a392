"""What is specific to the SQLite broker and key store: many connections (and processes) on one
file, the cross-connection wake-up, cancellation safety, error translation, and the key store.

The contract itself runs in ``test_broker_contract.py`` and ``test_broker_model.py``. The broker's
clock is the wall clock, so these tests use real (short) sleeps, never ``autojump_clock``.
"""

from __future__ import annotations

import json
import os
import random
import re
import sqlite3
import sys
import threading
import time
from functools import partial
from typing import TYPE_CHECKING

import pytest
import trio

from durable_trio import BrokerError, BrokerUnavailable
from durable_trio.brokers import Job, Lease
from durable_trio.brokers.sqlite import PROMOTE_BATCH, SqliteBroker
from durable_trio.brokers.sqlite import _operations as operations_module
from durable_trio.brokers.sqlite import _rows as rows_module
from durable_trio.keys import sqlite as keys_module
from durable_trio.keys.sqlite import SqliteKeyStore, prefix_upper_bound

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

Q = "t:tasks:sqlite"


def job(n: int | str) -> Job:
    return Job(f"job-{n}", f'{{"n":"{n}"}}'.encode())


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "durable.db"


@pytest.fixture
async def broker(db_path: Path) -> AsyncIterator[SqliteBroker]:
    b = await SqliteBroker.open(db_path, wakeup_interval=0.05)
    try:
        yield b
    finally:
        await b.aclose()


@pytest.fixture
async def other(db_path: Path, broker: SqliteBroker) -> AsyncIterator[SqliteBroker]:
    """A second broker (a second connection, as another process would have) on the same file."""
    b = await SqliteBroker.open(db_path, wakeup_interval=0.05)
    try:
        yield b
    finally:
        await b.aclose()


def read_rows(path: Path, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    """Read the file on a connection of its own (call through ``trio.to_thread``)."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        return db.execute(sql, params).fetchall()
    finally:
        db.close()


async def rows(path: Path, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    return await trio.to_thread.run_sync(read_rows, path, sql, params)


async def assert_consistent(path: Path) -> list[tuple[object, ...]]:
    """Every job is exactly one of ready, delayed, active or failed; an active job has a token
    and a claim time, no other job has a token; a delayed job has a due time. Returns
    (id, state, token) of every job."""
    jobs = await rows(path, "SELECT id, state, token, claimed_at, due_at FROM dt_jobs")
    ids = [r[0] for r in jobs]
    assert len(ids) == len(set(ids)), "a job is in the table twice"
    for job_id, state, token, claimed_at, due_at in jobs:
        assert state in ("ready", "delayed", "active", "failed"), (job_id, state)
        assert (token is not None) == (state == "active"), (job_id, state, token)
        assert (claimed_at is not None) == (state == "active"), (job_id, state, claimed_at)
        assert (due_at is not None) == (state == "delayed"), (job_id, state, due_at)
    return [(r[0], r[1], r[2]) for r in jobs]


class HeldLock:
    """Another connection holding the file's write lock (``BEGIN IMMEDIATE``) until released."""

    def __init__(self, path: Path) -> None:
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("BEGIN IMMEDIATE")

    def release(self) -> None:
        self._db.execute("COMMIT")
        self._db.close()


# ----------------------------------------------------------------------- many connections


async def test_two_connections_on_one_file_see_each_others_jobs(
    broker: SqliteBroker, other: SqliteBroker
) -> None:
    await broker.push_on(Q, job("low"), priority=5)
    await broker.push_on(Q, job("high"), priority=1)
    await other.push_on(Q, job("high-2"), priority=1)
    assert await other.size_of(Q) == 3
    first = await other.pop_from(Q, worker="b")
    second = await broker.pop_from(Q, worker="a")
    assert first is not None
    assert second is not None
    assert (first.id, second.id) == ("job-high", "job-high-2")
    # A lease is plain data: whichever connection presents it finalizes the claim, once.
    assert await broker.complete_job(first.lease, Q) is True
    assert await other.complete_job(first.lease, Q) is False
    assert await other.fail_job(second.lease, Q, "boom") is True
    assert [f.id for f in await broker.failed_jobs(Q)] == ["job-high-2"]
    assert await broker.size_of(Q) == 1
    assert await other.size_of(Q) == 1


async def test_a_push_on_another_connection_wakes_a_waiter_within_the_tick(
    broker: SqliteBroker, other: SqliteBroker
) -> None:
    assert await broker.pop_from(Q) is None
    woke_at: list[float] = []

    async def waiter() -> None:
        await broker.wait_for_work(Q)
        woke_at.append(trio.current_time())

    with trio.fail_after(3):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.sleep(0.1)
            assert woke_at == []
            pushed_at = trio.current_time()
            await other.push_on(Q, job(1))
    # within one tick (0.05 s), plus slack for a loaded machine
    assert woke_at[0] - pushed_at < broker.wakeup_interval + 0.2
    assert (await broker.pop_from(Q)) is not None


async def test_an_idle_wait_does_not_poll_the_database(broker: SqliteBroker) -> None:
    """Idle, the only SQL is the connection thread's ``PRAGMA data_version`` once per tick, and
    the waiters' own look at their queue once: no per-queue polling, no event-loop wake-ups."""
    connection = broker.connection
    async with trio.open_nursery() as nursery:
        for n in range(10):
            nursery.start_soon(broker.wait_for_work, f"{Q}:{n}")
        await trio.sleep(0.05)
        executed, ticks = connection.executed, connection.ticks
        await trio.sleep(0.5)
        assert connection.executed == executed  # no operation from the event loop at all
        assert 4 <= connection.ticks - ticks <= 12  # ~10 ticks of 0.05 s
        nursery.cancel_scope.cancel()
    # nobody waits: the thread stops ticking
    await trio.sleep(0.1)
    ticks = connection.ticks
    await trio.sleep(0.2)
    assert connection.ticks == ticks


async def test_another_connections_push_wakes_only_the_waiter_of_its_queue(
    broker: SqliteBroker, other: SqliteBroker
) -> None:
    woke: list[int] = []

    async def waiter(n: int) -> None:
        await broker.wait_for_work(f"{Q}:{n}")
        woke.append(n)

    with trio.fail_after(3):
        async with trio.open_nursery() as nursery:
            for n in range(5):
                nursery.start_soon(waiter, n)
            await trio.sleep(0.1)
            await other.push_on(f"{Q}:3", job(3))
            await trio.sleep(0.3)
            assert woke == [3]
            await broker.push_on(f"{Q}:1", job(1))  # this connection: at once
            await trio.sleep(0.01)
            assert woke == [3, 1]
            nursery.cancel_scope.cancel()


async def test_a_delayed_push_on_another_connection_wakes_the_waiter_when_due(
    broker: SqliteBroker, other: SqliteBroker
) -> None:
    with trio.fail_after(3):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(broker.wait_for_work, Q)
            await trio.sleep(0.05)
            start = trio.current_time()
            await other.push_on(Q, job("later"), delay=0.3)
        elapsed = trio.current_time() - start
    assert 0.25 <= elapsed < 0.3 + 0.25
    claimed = await broker.pop_from(Q)
    assert claimed is not None
    assert claimed.id == "job-later"


WORKER_SCRIPT = """
import json, sys, time
import trio
from durable_trio.brokers import Job
from durable_trio.brokers.sqlite import SqliteBroker

async def main(path, name, count, start_at):
    broker = await SqliteBroker.open(path, busy_timeout=10.0)
    claims, completed = [], []
    pushed = 0
    while time.time() < start_at:
        await trio.sleep(0.005)
    while True:
        if pushed < count:
            await broker.push_on("mp", Job(f"{name}-{pushed}", b"x"), priority=pushed % 3)
            pushed += 1
        claimed = await broker.pop_from("mp", worker=name)
        if claimed is None:
            if pushed < count:
                continue
            with trio.move_on_after(0.5) as idle:
                await broker.wait_for_work("mp")
            if idle.cancelled_caught:
                break
            continue
        claims.append([claimed.id, claimed.lease.token])
        if claimed.attempts == 0 and int(claimed.id.rsplit("-", 1)[1]) % 5 == 0:
            assert await broker.retry_job(claimed.lease, "mp")
            continue
        assert await broker.complete_job(claimed.lease, "mp")
        completed.append(claimed.id)
    await broker.aclose()
    print(json.dumps({"claims": claims, "completed": completed}))

trio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
"""


@pytest.mark.chaos
async def test_two_processes_push_and_pop_without_losing_or_doubling_a_job(
    tmp_path: Path, db_path: Path
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER_SCRIPT)
    async with await SqliteBroker.open(db_path):
        pass  # the schema exists before the race
    count = 300
    start_at = time.time() + 2.5  # both past their imports, even on a loaded machine
    outputs: dict[str, bytes] = {}

    async def run(name: str) -> None:
        done = await trio.run_process(
            [sys.executable, str(script), str(db_path), name, str(count), str(start_at)],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert done.returncode == 0, done.stderr.decode()
        outputs[name] = done.stdout

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "p1")
            nursery.start_soon(run, "p2")
    results = {name: json.loads(out) for name, out in outputs.items()}
    completed = [i for r in results.values() for i in r["completed"]]
    claims = [tuple(c) for r in results.values() for c in r["claims"]]
    expected = {f"{p}-{n}" for p in ("p1", "p2") for n in range(count)}
    assert sorted(completed) == sorted(expected)  # each job completed exactly once
    assert len({token for _, token in claims}) == len(claims)  # every claim its own lease
    retried = {job_id for job_id in expected if int(job_id.rsplit("-", 1)[1]) % 5 == 0}
    claimed_ids = sorted(job_id for job_id, _ in claims)
    assert claimed_ids == sorted([*expected, *retried])  # claimed once, retried ones twice
    assert await rows(db_path, "SELECT count(*) FROM dt_jobs") == [(0,)]
    # they really ran side by side: each finished some of the jobs the other pushed
    for me, them in (("p1", "p2"), ("p2", "p1")):
        assert any(i.startswith(f"{them}-") for i in results[me]["completed"]), me


# ----------------------------------------------------------------------- cancellation


async def test_cancelling_calls_at_random_points_leaves_every_job_accounted_for(
    db_path: Path, broker: SqliteBroker
) -> None:
    """Eight tasks push, pop, complete, retry and fail under random deadlines (0: cancelled
    before the call; tiny: while it waits in the queue or while its SQL runs, which another
    connection's write lock stretches). Whatever was cancelled changed nothing, and whatever
    returned is in the table: the claims the tasks hold are exactly the active jobs."""
    rng = random.Random(20261129)
    pushed: set[str] = set()
    held: dict[str, tuple[str, Lease]] = {}  # token -> (id, lease)
    finished: set[str] = set()
    failed: set[str] = set()
    outcomes = {"cancelled": 0, "returned": 0}
    counter = iter(range(10**9))

    async def worker() -> None:
        for _ in range(60):
            op = rng.choice(["push", "push", "pop", "pop", "complete", "retry", "fail"])
            deadline = rng.choice(
                [0.0, rng.uniform(0, 0.0003), rng.uniform(0, 0.002), rng.uniform(0, 0.01), 1.0]
            )
            token = rng.choice(sorted(held)) if held else None
            with trio.move_on_after(deadline) as scope:
                if op == "push":
                    job_id = f"job-{next(counter)}"
                    delay = rng.choice([0.0, 0.0, 5.0])
                    await broker.push_on(
                        Q, Job(job_id, b"{}"), priority=rng.randint(0, 2), delay=delay
                    )
                    pushed.add(job_id)
                elif op == "pop":
                    claimed = await broker.pop_from(Q, worker="w")
                    if claimed is not None:
                        held[claimed.lease.token] = (claimed.id, claimed.lease)
                elif token is not None and token in held:
                    job_id, lease = held[token]
                    if op == "complete":
                        ok = await broker.complete_job(lease, Q)
                    elif op == "retry":
                        ok = await broker.retry_job(lease, Q, count_attempt=rng.random() < 0.5)
                    else:
                        ok = await broker.fail_job(lease, Q, "boom")
                    if ok:
                        del held[token]
                        if op == "complete":
                            finished.add(job_id)
                        elif op == "fail":
                            failed.add(job_id)
                await trio.lowlevel.checkpoint()
            outcomes["cancelled" if scope.cancelled_caught else "returned"] += 1

    stop = threading.Event()

    def contender() -> None:
        """Another connection taking the write lock now and then, so the broker's thread
        spends time inside operations (waiting for the lock) and deadlines expire there."""
        db = sqlite3.connect(db_path, isolation_level=None, timeout=5)
        try:
            while not stop.is_set():
                db.execute("BEGIN IMMEDIATE")
                time.sleep(0.003)
                db.execute("COMMIT")
                time.sleep(0.007)
        finally:
            db.close()

    connection = broker.connection
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(trio.to_thread.run_sync, contender))
            for _ in range(30):  # rounds of ~0.1 s, until both cancellation paths were hit
                async with trio.open_nursery() as workers:
                    for _ in range(8):
                        workers.start_soon(worker)
                if connection.dropped >= 5 and connection.rolled_back >= 5:
                    break
            stop.set()
    assert connection.dropped >= 5  # cancelled while queued: never ran
    assert connection.rolled_back >= 5  # cancelled while running: rolled back
    assert outcomes["cancelled"] > 50, outcomes
    assert outcomes["returned"] > 50, outcomes
    jobs = await assert_consistent(db_path)
    in_table = {job_id for job_id, _, _ in jobs}
    assert in_table == pushed - finished
    assert {str(t) for _, state, t in jobs if state == "active"} == set(held)
    assert {job_id for job_id, state, _ in jobs if state == "failed"} == failed


async def test_a_call_cancelled_while_its_sql_runs_is_rolled_back(
    db_path: Path, broker: SqliteBroker
) -> None:
    await broker.push_on(Q, job("kept"))
    lock = HeldLock(db_path)  # the broker's next transaction waits for this lock, in its thread
    outcome: list[str] = []
    pop_scope = trio.CancelScope()

    async def pop() -> None:
        with pop_scope:
            outcome.append(f"returned {await broker.pop_from(Q)}")
        if pop_scope.cancelled_caught:
            outcome.append("cancelled")

    with trio.fail_after(3):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pop)
            await trio.sleep(0.05)
            pop_scope.cancel()  # while the connection thread waits for the lock
            await trio.sleep(0.05)
            assert outcome == []  # not abandoned: the call waits for its transaction
            lock.release()  # the pop claims, sees the cancellation, rolls back
    assert outcome == ["cancelled"]
    jobs = await assert_consistent(db_path)
    assert [(job_id, state) for job_id, state, _ in jobs] == [("job-kept", "ready")]
    claimed = await broker.pop_from(Q)
    assert claimed is not None
    assert claimed.id == "job-kept"


async def test_a_call_cancelled_while_queued_returns_at_once_and_never_runs(
    db_path: Path, broker: SqliteBroker
) -> None:
    lock = HeldLock(db_path)
    first_done = trio.Event()

    async def first() -> None:
        await broker.push_on(Q, job("first"))  # occupies the thread, waiting for the lock
        first_done.set()

    with trio.fail_after(3):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            await trio.sleep(0.05)
            with trio.move_on_after(0.05) as queued:
                await broker.push_on(Q, job("second"))
            assert queued.cancelled_caught  # returned at its deadline, the thread still busy
            assert not first_done.is_set()
            lock.release()
    jobs = await assert_consistent(db_path)
    assert [job_id for job_id, _, _ in jobs] == ["job-first"]


async def test_a_call_cancelled_before_it_starts_changes_nothing(
    db_path: Path, broker: SqliteBroker
) -> None:
    with trio.move_on_after(0):
        await broker.push_on(Q, job(1))
    assert await broker.size_of(Q) == 0


# ----------------------------------------------------------------------- errors, options, close


async def test_a_database_locked_past_busy_timeout_raises_broker_unavailable(
    db_path: Path,
) -> None:
    broker = await SqliteBroker.open(db_path, busy_timeout=0.1)
    try:
        lock = HeldLock(db_path)
        start = trio.current_time()
        with pytest.raises(BrokerUnavailable) as info:
            await broker.push_on(Q, job(1))
        assert trio.current_time() - start >= 0.09
        assert isinstance(info.value.__cause__, sqlite3.OperationalError)
        assert await broker.size_of(Q) == 0  # reads go on in WAL mode
        lock.release()
        await broker.push_on(Q, job(1))  # and the broker works again
        assert await broker.size_of(Q) == 1
    finally:
        await broker.aclose()


async def test_a_file_that_is_not_a_database_raises_broker_error(tmp_path: Path) -> None:
    path = tmp_path / "not.db"
    path.write_bytes(b"this is not an SQLite database, not at all" * 100)
    with pytest.raises(BrokerError) as info:
        await SqliteBroker.open(path)
    assert not isinstance(info.value, BrokerUnavailable)
    with pytest.raises(BrokerUnavailable):
        await SqliteBroker.open(tmp_path / "missing-directory" / "x.db")


async def test_a_closed_broker_refuses_calls_and_closes_once(db_path: Path) -> None:
    broker = await SqliteBroker.open(db_path)
    async with broker:
        await broker.push_on(Q, job(1))
    await broker.aclose()
    with pytest.raises(BrokerUnavailable):
        await broker.pop_from(Q)
    with pytest.raises(BrokerUnavailable):
        await broker.wait_for_work(Q)
    # durable: a new broker on the file finds the job
    async with await SqliteBroker.open(db_path) as again:
        claimed = await again.pop_from(Q)
        assert claimed is not None
        assert claimed.id == "job-1"


async def test_claims_survive_a_reopen_and_the_sweep_recovers_them(db_path: Path) -> None:
    async with await SqliteBroker.open(db_path) as crashed:
        await crashed.push_on(Q, job(1))
        assert await crashed.pop_from(Q, worker="dead-worker") is not None
    async with await SqliteBroker.open(db_path) as broker:
        await trio.sleep(0.02)
        recovery = await broker.recover_stalled_jobs(Q, 0.01, 3)
        assert recovery.recovered == 1
        back = await broker.pop_from(Q)
        assert back is not None
        assert back.stalled_count == 1
        assert [s.worker for s in back.stalls] == ["dead-worker"]


async def test_failed_jobs_keep_only_the_newest_per_queue(db_path: Path) -> None:
    async with await SqliteBroker.open(db_path, failed_retention=3) as broker:
        for n in range(5):
            await broker.push_on(Q, job(n))
            await broker.push_on(Q + ":other", job(n))
        for queue in (Q, Q + ":other"):
            for _ in range(5):
                claimed = await broker.pop_from(queue)
                assert claimed is not None
                assert await broker.fail_job(claimed.lease, queue, f"boom {claimed.id}")
        assert [f.id for f in await broker.failed_jobs(Q)] == ["job-4", "job-3", "job-2"]
        assert [f.error for f in await broker.failed_jobs(Q, limit=1)] == ["boom job-4"]
        assert await broker.failed_jobs(Q, limit=0) == []
    counts = await rows(db_path, "SELECT queue, count(*) FROM dt_jobs GROUP BY queue")
    assert sorted(counts) == [(Q, 3), (Q + ":other", 3)]


async def test_each_pop_promotes_a_bounded_batch_of_due_jobs_in_due_order(
    db_path: Path, broker: SqliteBroker
) -> None:
    total = PROMOTE_BATCH + 44
    for n in range(total):
        await broker.push_on(Q, job(n), delay=0.001)
    await trio.sleep(0.05)
    first = await broker.pop_from(Q)
    assert first is not None
    assert first.id == "job-0"
    grouped = await rows(db_path, "SELECT state, count(*) FROM dt_jobs GROUP BY state")
    states = {str(state): count for state, count in grouped}
    assert states == {"active": 1, "ready": PROMOTE_BATCH - 1, "delayed": 44}
    popped = [first.id]
    while (claimed := await broker.pop_from(Q)) is not None:
        popped.append(claimed.id)
    assert popped == [f"job-{n}" for n in range(total)]


async def test_pop_many_claims_in_pop_order_in_one_call(broker: SqliteBroker) -> None:
    for n, priority in enumerate([3, 1, 2, 1]):
        await broker.push_on(Q, job(n), priority=priority)
    claimed = await broker.pop_many(Q, 3, worker="w")
    assert [c.id for c in claimed] == ["job-1", "job-3", "job-2"]
    assert len({c.lease.token for c in claimed}) == 3
    assert [c.id for c in await broker.pop_many(Q, 5)] == ["job-0"]
    assert await broker.pop_many(Q, 5) == []


async def test_every_query_is_an_index_search_never_a_table_scan(db_path: Path) -> None:
    """Pop, promotion, lease checks, recovery, size, inspection, wake-up probes and key
    lookups all search an index: O(log n + rows returned), whatever the table holds."""
    async with await SqliteBroker.open(db_path), await SqliteKeyStore.open(db_path):
        pass
    statements = [
        value
        for module in (operations_module, rows_module, keys_module)
        for name, value in vars(module).items()
        if name.isupper() and isinstance(value, str) and "?" in value
    ]
    assert len(statements) >= 18
    for sql in statements:
        count = max(int(p) for p in re.findall(r"\?(\d+)", sql))
        plan = await rows(db_path, "EXPLAIN QUERY PLAN " + sql, (None,) * count)
        details = [str(row[3]) for row in plan]
        assert not any(d.startswith("SCAN dt_") for d in details), (sql, details)
        assert not any("TEMP B-TREE" in d for d in details), (sql, details)


# ----------------------------------------------------------------------- key store


async def test_key_store_put_remove_and_sorted_prefix_entries(db_path: Path) -> None:
    async with await SqliteKeyStore.open(db_path) as keys:
        for key in ("w:b", "w:a", "x:c", "w", "w;"):
            await keys.put(key, key.encode(), 10.0)
        assert [e.key for e in await keys.entries("w:")] == ["w:a", "w:b"]
        assert [e.key for e in await keys.entries("")] == ["w", "w:a", "w:b", "w;", "x:c"]
        assert (await keys.entries("x:"))[0].value == b"x:c"
        await keys.put("w:a", b"new", 10.0)
        await keys.remove(["w:b", "missing"])
        assert [(e.key, e.value) for e in await keys.entries("w:")] == [("w:a", b"new")]
        await keys.remove([])


async def test_keys_expire_after_their_ttl_and_a_write_renews_them(db_path: Path) -> None:
    async with await SqliteKeyStore.open(db_path) as keys:
        await keys.put("k:short", b"1", 0.2)
        await keys.put("k:renewed", b"2", 0.2)
        await keys.put("k:long", b"3", 10.0)
        assert len(await keys.entries("k:")) == 3
        await trio.sleep(0.1)
        await keys.put("k:renewed", b"2", 0.3)
        await trio.sleep(0.15)
        assert [e.key for e in await keys.entries("k:")] == ["k:long", "k:renewed"]
        await trio.sleep(0.2)
        assert [e.key for e in await keys.entries("k:")] == ["k:long"]
        await keys.put("k:gone", b"4", 0)
        assert [e.key for e in await keys.entries("k:")] == ["k:long"]


async def test_expired_keys_are_pruned_by_later_writes(db_path: Path) -> None:
    async with await SqliteKeyStore.open(db_path) as keys:
        for n in range(10):
            await keys.put(f"k:{n}", b"", 0.05)
        await trio.sleep(0.1)
        await keys.put("k:live", b"", 10.0)
    assert await rows(db_path, "SELECT key FROM dt_keys") == [("k:live",)]


async def test_key_store_shares_a_broker_connection_and_other_connections_see_it(
    db_path: Path,
) -> None:
    broker = await SqliteBroker.open(db_path)
    keys = await SqliteKeyStore.attach(broker)
    assert keys.path == broker.path
    await keys.put("hb:w1", b"alive", 10.0)
    await broker.aclose()
    await keys.put("hb:w2", b"alive", 10.0)  # the connection outlives the broker
    async with await SqliteKeyStore.open(db_path) as elsewhere:
        assert [e.key for e in await elsewhere.entries("hb:")] == ["hb:w1", "hb:w2"]
    await keys.aclose()
    await keys.aclose()
    assert broker.connection.closed
    with pytest.raises(BrokerUnavailable):
        await keys.entries("hb:")
    with pytest.raises(BrokerUnavailable):
        await SqliteKeyStore.attach(broker)


async def test_prefix_entries_are_exact_for_any_unicode_prefix(db_path: Path) -> None:
    top = chr(0x10FFFF)
    names = ["a", "a" + top, "a" + top + "z", "b", "é", "é1", "ê", "\ud7ff", "\ue000", top, top * 2]
    async with await SqliteKeyStore.open(db_path) as keys:
        for key in names:
            await keys.put(key, b"", 10.0)
        for prefix in ["", "a", "a" + top, "é", "\ud7ff", top, top * 2, "zz"]:
            expected = sorted(k for k in names if k.startswith(prefix))
            assert [e.key for e in await keys.entries(prefix)] == expected, prefix


def test_prefix_upper_bound() -> None:
    assert prefix_upper_bound("w:") == "w;"
    assert prefix_upper_bound("") is None
    assert prefix_upper_bound(chr(0x10FFFF)) is None
    assert prefix_upper_bound("a" + chr(0x10FFFF)) == "b"
    assert prefix_upper_bound("\ud7ff") == "\ue000"


# ----------------------------------------------------------------------- schema migration

async def _file_without_push_times(path: Path) -> None:
    """A file holding job ``job-old``, whose ``dt_jobs`` is back as the broker made it before
    push times were kept (no ``pushed_at`` column)."""
    async with await SqliteBroker.open(path) as broker:
        await broker.push_on(Q, job("old"))

    def drop() -> None:
        db = sqlite3.connect(path, isolation_level=None)
        try:
            db.execute("ALTER TABLE dt_jobs DROP COLUMN pushed_at")
            columns = {row[1] for row in db.execute("PRAGMA table_info(dt_jobs)")}
        finally:
            db.close()
        assert "pushed_at" not in columns

    await trio.to_thread.run_sync(drop)


async def test_a_file_of_the_old_schema_gets_push_times_and_its_old_jobs_count_as_unknown(
    db_path: Path,
) -> None:
    """A file made before ``pushed_at`` existed opens (the column is added, once, however many
    brokers open it); its old jobs are served as before and their age is unknown (``None``,
    never the 56 years since the epoch) until they are claimed; new pushes carry push times."""
    await _file_without_push_times(db_path)
    async with await SqliteBroker.open(db_path) as broker, await SqliteBroker.open(db_path):
        columns = [str(row[1]) for row in await rows(db_path, "PRAGMA table_info(dt_jobs)")]
        assert columns.count("pushed_at") == 1
        assert await rows(db_path, "SELECT id, pushed_at FROM dt_jobs") == [("job-old", None)]
        stats = await broker.queue_stats(Q)
        assert (stats.ready, stats.oldest_ready_age) == (1, None)
        await broker.push_on(Q, job("new"))
        await trio.sleep(0.2)
        assert (await broker.queue_stats(Q)).oldest_ready_age is None  # the old job may be older
        old = await broker.pop_from(Q)
        assert old is not None
        assert (old.id, old.data) == ("job-old", b'{"n":"old"}')
        age = (await broker.queue_stats(Q)).oldest_ready_age
        assert age is not None
        assert 0.2 <= age < 1.0
        assert await broker.complete_job(old.lease, Q)
        assert [c.id for c in await broker.pop_many(Q, 5)] == ["job-new"]
    await assert_consistent(db_path)
    async with await SqliteBroker.open(db_path) as broker:  # and opens again, unchanged
        columns = [str(row[1]) for row in await rows(db_path, "PRAGMA table_info(dt_jobs)")]
        assert columns.count("pushed_at") == 1
