"""ONE run-store contract suite, run against every store: memory, SQLite, Redis, PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import pytest
import trio
import trio.testing

from _redis_server import *  # noqa: F403  (the private redis-server fixtures)
from durable_trio import BrokerError
from durable_trio._engine import Applied, RunRecord, RunStatus, RunStore, StepKind, StepRecord
from durable_trio._engine import StepState as S
from durable_trio._engine._cancel import CANCEL_MARK, cancel_mark, mark_in_store, mark_reason
from durable_trio._engine._stores.memory import MemoryRunStore
from durable_trio._engine._stores.sqlite import SqliteRunStore
from durable_trio._postgres import open_pool
from durable_trio._redis import open_redis, open_redis_cluster

if TYPE_CHECKING:
    from pathlib import Path

STORE_KINDS = [
    "memory",
    "sqlite",
    "redis",
    "redis-cluster",
    pytest.param("postgres", marks=pytest.mark.postgres),
]

StoreFactory = Callable[[str], AbstractAsyncContextManager[RunStore]]

#: JSON values that trip up stores: empty containers (Lua's cjson turns [] into {}), big
#: integers, unicode, nesting, null.
AWKWARD = {"empty": [], "obj": {}, "big": 2**60, "pi": 3.25, "s": "é✓\x00", "n": None, "t": True}


@pytest.fixture(params=STORE_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def stores(
    store_kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[StoreFactory]:
    """A factory of stores of ``store_kind`` by namespace, all on one fresh backend."""
    if store_kind == "memory":
        memory: dict[str, MemoryRunStore] = {}

        @asynccontextmanager
        async def make_memory(namespace: str) -> AsyncIterator[RunStore]:
            yield memory.setdefault(namespace, MemoryRunStore())

        yield make_memory
    elif store_kind == "sqlite":

        @asynccontextmanager
        async def make_sqlite(namespace: str) -> AsyncIterator[RunStore]:
            store = await SqliteRunStore.open(tmp_path / "runs.db", namespace)
            try:
                yield store
            finally:
                await store.aclose()

        yield make_sqlite
    elif store_kind == "redis-cluster":
        from durable_trio._engine._stores.redis import RedisRunStore
        from durable_trio.backends.redis import CLUSTER_RUN_SHARDS

        async with open_redis_cluster(request.getfixturevalue("redis_cluster_url")) as cluster:

            @asynccontextmanager
            async def make_sharded(namespace: str) -> AsyncIterator[RunStore]:
                yield RedisRunStore(cluster, namespace, shards=CLUSTER_RUN_SHARDS)

            yield make_sharded
    elif store_kind == "postgres":
        from durable_trio._engine._stores.postgres import PostgresRunStores

        async with open_pool(request.getfixturevalue("postgres_url"), size=4) as pool:
            opener = PostgresRunStores(pool, schema=fresh_schema(request))

            @asynccontextmanager
            async def make_postgres(namespace: str) -> AsyncIterator[RunStore]:
                async with opener.open(namespace) as store:
                    yield store

            yield make_postgres
    else:
        url = request.getfixturevalue("redis_url")
        from durable_trio._engine._stores.redis import RedisRunStore

        async with open_redis(url) as client:

            @asynccontextmanager
            async def make_redis(namespace: str) -> AsyncIterator[RunStore]:
                yield RedisRunStore(client, namespace)

            yield make_redis


def fresh_schema(request: pytest.FixtureRequest) -> str:
    """A schema of the test's own on the session's PostgreSQL server (thrown away with it)."""
    return f"t_{uuid.uuid4().hex[:16]}"


@pytest.fixture
async def store(stores: StoreFactory) -> AsyncIterator[RunStore]:
    async with stores("shop") as s:
        yield s


def run(run_id: str, *, status: RunStatus = RunStatus.PENDING, **kw: Any) -> RunRecord:
    return RunRecord(run_id, kw.pop("workflow", "order"), kw.pop("input", None), status, 0, 0, **kw)


def step(run_id: str, step_id: str, **kw: Any) -> StepRecord:
    kind = kw.pop("kind", StepKind.REMOTE)
    return StepRecord(
        run_id, step_id, kind, kw.pop("name", "charge"), kw.pop("status", S.PENDING), **kw
    )


# --------------------------------------------------------------------------- runs


async def test_create_get_and_json_fidelity(store: RunStore) -> None:
    stored, created = await store.create_run(run("r1", input=AWKWARD))
    assert created
    assert (stored.run_id, stored.workflow, stored.status) == ("r1", "order", RunStatus.PENDING)
    assert stored.input == AWKWARD
    assert stored.owner is None
    assert stored.lease_until is None
    assert abs(stored.created_at - store.now()) < 5
    again, created_again = await store.create_run(run("r1", input="other", workflow="x"))
    assert not created_again
    assert (again.input, again.workflow) == (AWKWARD, "order")
    fetched = await store.get_run("r1")
    assert fetched is not None
    assert fetched.input == AWKWARD
    assert await store.get_run("missing") is None


async def test_a_runs_timeout_is_stored_and_its_deadline_counts_from_creation(
    store: RunStore,
) -> None:
    stored, _ = await store.create_run(run("t", status=RunStatus.RUNNING, timeout=12.5))
    await store.create_run(run("none"))
    assert stored.timeout == 12.5
    assert stored.deadline == stored.created_at + 12.5
    fetched = await store.get_run("t")
    assert fetched is not None
    assert (fetched.timeout, fetched.deadline) == (12.5, stored.deadline)
    claimed = {r.run_id: r for r in await store.claim_runs("A", 30.0)}
    assert (claimed["t"].timeout, claimed["t"].deadline) == (12.5, stored.deadline)
    assert claimed["none"].timeout is None
    listed = {r.run_id: r for r in await store.list_runs()}
    assert (listed["t"].timeout, listed["none"].timeout, listed["none"].deadline) == (
        12.5,
        None,
        None,
    )
    await store.finish_run("t", RunStatus.FAILED, error={"type": "RunTimedOut"})
    finished = await store.get_run("t")
    assert finished is not None
    assert finished.timeout == 12.5


async def test_list_runs_newest_first_with_filters(store: RunStore) -> None:
    await store.create_run(run("a", workflow="order"))
    await store.create_run(run("b", workflow="refund"))
    await store.create_run(run("c", workflow="order", status=RunStatus.RUNNING, owner="e"))
    assert [r.run_id for r in await store.list_runs()] == ["c", "b", "a"]
    assert [r.run_id for r in await store.list_runs(limit=2)] == ["c", "b"]
    assert [r.run_id for r in await store.list_runs(workflow="order")] == ["c", "a"]
    assert [r.run_id for r in await store.list_runs(status=RunStatus.PENDING)] == ["b", "a"]
    pending_orders = await store.list_runs(status=RunStatus.PENDING, workflow="order")
    assert [r.run_id for r in pending_orders] == ["a"]
    await store.finish_run("a", RunStatus.COMPLETED, output=[])
    assert [r.run_id for r in await store.list_runs(status=RunStatus.COMPLETED)] == ["a"]
    assert [r.run_id for r in await store.list_runs(status=RunStatus.PENDING)] == ["b"]


async def test_claim_takes_only_runs_nobody_drives(store: RunStore) -> None:
    now = store.now()
    await store.create_run(run("free"))
    await store.create_run(run("held", status=RunStatus.RUNNING, owner="A", lease_until=now + 60))
    await store.create_run(run("mine", status=RunStatus.RUNNING, owner="B", lease_until=now + 60))
    await store.create_run(run("lapsed", status=RunStatus.RUNNING, owner="A", lease_until=now - 1))
    await store.create_run(run("over", status=RunStatus.RUNNING))
    await store.finish_run("over", RunStatus.FAILED, error={"type": "X"})

    claimed = await store.claim_runs("B", 30.0)
    assert sorted(r.run_id for r in claimed) == ["free", "lapsed"]
    for record in claimed:
        assert (record.owner, record.status) == ("B", RunStatus.RUNNING)
        assert record.lease_until is not None
        assert record.lease_until > store.now() + 20
    assert await store.claim_runs("B", 30.0) == []
    own = await store.claim_runs("B", 30.0, include_own=True)
    assert sorted(r.run_id for r in own) == ["free", "lapsed", "mine"]
    assert await store.claim_runs("C", 30.0) == []


async def test_claim_respects_its_limit(store: RunStore) -> None:
    for n in range(5):
        await store.create_run(run(f"r{n}"))
    first = await store.claim_runs("A", 30.0, limit=2)
    rest = await store.claim_runs("A", 30.0, limit=10)
    assert len(first) == 2
    assert len(rest) == 3
    assert {r.run_id for r in first} | {r.run_id for r in rest} == {f"r{n}" for n in range(5)}


async def test_leases_renew_lapse_and_release(store: RunStore) -> None:
    await store.create_run(run("a"))
    await store.create_run(run("b"))
    assert len(await store.claim_runs("A", 0.2)) == 2
    assert await store.renew_runs("A", ["a"], 0.2) == {"a"}
    assert await store.renew_runs("Z", ["a", "b"], 0.2) == set()
    assert await store.renew_runs("A", [], 0.2) == set()
    await trio.sleep(0.25)  # b's lease lapses; a's was renewed later, it lapses too by now
    taken = await store.claim_runs("B", 30.0)
    assert sorted(r.run_id for r in taken) == ["a", "b"]
    assert await store.renew_runs("A", ["a", "b"], 30.0) == set()  # lost to B
    await store.release_runs("B", ["a"])
    released = await store.get_run("a")
    assert released is not None
    assert (released.owner, released.lease_until, released.status) == (
        None,
        None,
        RunStatus.PENDING,
    )
    await store.release_runs("A", ["b"])  # not A's: nothing happens
    kept = await store.get_run("b")
    assert kept is not None
    assert kept.owner == "B"
    assert [r.run_id for r in await store.claim_runs("C", 30.0)] == ["a"]


async def test_finish_settles_once(store: RunStore) -> None:
    await store.create_run(run("r", status=RunStatus.RUNNING, owner="A", lease_until=1e12))
    assert await store.finish_run("r", RunStatus.COMPLETED, output=AWKWARD)
    assert not await store.finish_run("r", RunStatus.CANCELLED, error={"type": "RunCancelled"})
    assert not await store.finish_run("missing", RunStatus.COMPLETED)
    done = await store.get_run("r")
    assert done is not None
    assert (done.status, done.output, done.error, done.owner) == (
        RunStatus.COMPLETED,
        AWKWARD,
        None,
        None,
    )
    assert await store.renew_runs("A", ["r"], 30.0) == set()
    assert await store.claim_runs("A", 30.0, include_own=True) == []


# --------------------------------------------------------------------------- checkpoints


async def test_begin_step_inserts_once_and_history_is_in_step_order(store: RunStore) -> None:
    await store.create_run(run("r"))
    for step_id in ("10", "2", "1"):
        await store.begin_step(step("r", step_id, input={"n": step_id}))
    first = await store.begin_step(
        step("r", "11", kind=StepKind.TIMER, name="sleep", wake_at=123.5, input=5.0)
    )
    again = await store.begin_step(step("r", "11", name="other", wake_at=1.0))
    assert again == first
    assert (first.kind, first.name, first.wake_at, first.attempt) == (
        StepKind.TIMER,
        "sleep",
        123.5,
        1,
    )
    assert [s.step_id for s in await store.get_steps("r")] == ["1", "2", "10", "11"]
    assert await store.get_steps("nobody") == []
    found = await store.get_steps_many([("r", "2"), ("r", "99"), ("x", "1")])
    assert [None if s is None else s.input for s in found] == [{"n": "2"}, None, None]
    assert await store.get_step("r", "99") is None


async def test_a_guarded_begin_writes_nothing_into_a_finished_or_unknown_run(
    store: RunStore,
) -> None:
    await store.create_run(run("r", status=RunStatus.RUNNING, owner="A", lease_until=1e12))
    first = await store.begin_step_unless_finished(step("r", "1", input={"n": 1}))
    assert first is not None
    assert first.input == {"n": 1}
    again = await store.begin_step_unless_finished(step("r", "1", input={"n": 2}))
    assert again is not None
    assert again.input == {"n": 1}  # the existing one, as begin_step
    assert await store.begin_step_unless_finished(step("nobody", "1")) is None
    assert await store.get_steps("nobody") == []
    for status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED):
        run_id = f"r-{status.value}"
        await store.create_run(run(run_id, status=RunStatus.RUNNING, owner="A", lease_until=1e12))
        assert await store.finish_run(run_id, status)
        assert await store.begin_step_unless_finished(step(run_id, "cancel:run")) is None
        assert await store.get_step(run_id, "cancel:run") is None
    # An existing checkpoint of a finished run is not returned either: nothing may be begun.
    assert await store.finish_run("r", RunStatus.COMPLETED)
    assert await store.begin_step_unless_finished(step("r", "1")) is None
    assert [s.step_id for s in await store.get_steps("r")] == ["1"]


async def test_a_cancel_mark_never_lands_on_a_run_that_ended_since_the_caller_looked(
    store: RunStore,
) -> None:
    """The operator's and the engine's cancel look at the run, then write the mark: a run
    that completes (or fails) in between keeps its history as it ended. (A failed run with a
    mark would be cancelled by its own retry.)"""
    for status in (RunStatus.COMPLETED, RunStatus.FAILED):
        run_id = f"r-{status.value}"
        await store.create_run(run(run_id, status=RunStatus.RUNNING, owner="A", lease_until=1e12))
        await store.begin_step(step(run_id, "1"))
        assert await store.finish_run(run_id, status)  # it ends here, after the look
        assert not await mark_in_store(store, run_id, "operator")
        assert await store.get_step(run_id, CANCEL_MARK) is None
    await store.create_run(run("live", status=RunStatus.RUNNING, owner="A", lease_until=1e12))
    assert await mark_in_store(store, "live", "operator")
    assert not await mark_in_store(store, "live", "again")  # one cancel at a time
    mark = await store.get_step("live", CANCEL_MARK)
    assert mark is not None
    assert mark_reason(mark) == "operator"


async def test_a_run_ending_before_its_cancel_reached_it_keeps_no_mark(store: RunStore) -> None:
    """Issue 36: a mark written while the run was unfinished, then the run ends completed or
    failed before the cancel reached the workflow (it ended first): the end drops the mark in
    the same atomic change, so no ended history holds one and a retry re-runs the failed step.
    A cancelled run keeps its mark, and so does a run parked blocked (still to be ended)."""
    for status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.BLOCKED):
        run_id = f"r-{status.value}"
        await store.create_run(run(run_id, status=RunStatus.RUNNING, owner="A", lease_until=1e12))
        await store.begin_step(step(run_id, "1"))
        assert await mark_in_store(store, run_id, "operator")
        assert await store.finish_run(run_id, status)
        kept = await store.get_step(run_id, CANCEL_MARK)
        assert (kept is not None) is (status in (RunStatus.CANCELLED, RunStatus.BLOCKED))
        assert sorted(s.step_id for s in await store.get_steps(run_id)) == (
            ["1", CANCEL_MARK] if kept else ["1"]
        )
    # A failed run holding a mark from its previous life (written by an older version): the
    # reopening of its retry drops it; a blocked run's mark stays (its cancel still stands).
    await store.create_run(run("old", status=RunStatus.RUNNING, owner="A", lease_until=1e12))
    await store.begin_step(step("old", "1", status=S.FAILED))
    assert await store.finish_run("old", RunStatus.FAILED)
    await store.begin_step(cancel_mark("old", "stale"))  # as the unguarded begin once wrote it
    assert await store.get_step("old", CANCEL_MARK) is not None
    assert await store.reopen_run("old", [step("old", "1", attempt=2)], run_timeout=None)
    assert await store.get_step("old", CANCEL_MARK) is None
    assert await store.reopen_run("r-blocked", [], run_timeout=None)
    assert await store.get_step("r-blocked", CANCEL_MARK) is not None


async def test_step_fields_round_trip(store: RunStore) -> None:
    await store.create_run(run("r"))
    original = step(
        "r",
        "1",
        attempt=3,
        input=AWKWARD,
        output=[],
        error={"message": "m", "retryable": True, "details": {"stalls": []}},
        retry={"maxAttempts": 5, "nonRetryable": ["X"]},
        wake_at=9.5,
        dispatched=True,
        priority=-4,
    )
    stored = await store.begin_step(original)
    assert stored.created_at > 0
    assert stored.updated_at >= stored.created_at
    fetched = await store.get_step("r", "1")
    assert fetched is not None
    for field in ("attempt", "input", "output", "error", "retry", "wake_at", "dispatched"):
        assert getattr(fetched, field) == getattr(original, field), field
    assert fetched.priority == -4


async def test_update_step_is_a_compare_and_set(store: RunStore) -> None:
    await store.create_run(run("r", status=RunStatus.RUNNING))
    pending = await store.begin_step(step("r", "1"))
    retried = attrs.evolve(pending, attempt=2, wake_at=5.0)
    assert await store.update_step(retried, expect_attempt=1) is Applied.APPLIED
    assert await store.update_step(retried, expect_attempt=1) is Applied.STALE
    done = attrs.evolve(retried, status=S.COMPLETED, output=[])
    assert await store.update_step(done, expect_attempt=2) is Applied.APPLIED
    assert await store.update_step(done, expect_attempt=2) is Applied.DUPLICATE
    assert await store.update_step(step("r", "9"), expect_attempt=1) is Applied.MISSING
    stored = await store.get_step("r", "1")
    assert stored is not None
    assert (stored.status, stored.attempt, stored.output, stored.wake_at) == (
        S.COMPLETED,
        2,
        [],
        5.0,
    )

    await store.begin_step(step("r", "2"))
    await store.finish_run("r", RunStatus.CANCELLED)
    late = step("r", "2", status=S.COMPLETED, output=1)
    assert await store.update_step(late, expect_attempt=1) is Applied.RUN_FINISHED


async def test_mark_dispatched_only_for_the_current_pending_attempt(store: RunStore) -> None:
    await store.create_run(run("r"))
    await store.begin_step(step("r", "1", attempt=2))
    assert not await store.mark_dispatched("r", "1", 1)
    assert await store.mark_dispatched("r", "1", 2)
    marked = await store.get_step("r", "1")
    assert marked is not None
    assert marked.dispatched
    assert not await store.mark_dispatched("r", "missing", 1)


async def test_concurrent_marks_each_get_their_own_answer(store: RunStore) -> None:
    await store.create_run(run("r"))
    for n in range(12):
        await store.begin_step(step("r", str(n), attempt=2 if n % 3 == 0 else 1))
    answers: dict[tuple[str, int], bool] = {}

    async def mark(step_id: str, attempt: int) -> None:
        answers[step_id, attempt] = await store.mark_dispatched("r", step_id, attempt)

    async with trio.open_nursery() as nursery:
        for n in range(12):
            nursery.start_soon(mark, str(n), 1)
        nursery.start_soon(mark, "5", 1)  # twice at once: both answered yes
        nursery.start_soon(mark, "missing", 1)
    assert answers == {
        **{(str(n), 1): n % 3 != 0 for n in range(12)},
        ("missing", 1): False,
    }
    for record in await store.get_steps("r"):
        assert record.dispatched is (int(record.step_id) % 3 != 0)


async def test_a_begin_of_an_existing_checkpoint_returns_it_as_stored(store: RunStore) -> None:
    await store.create_run(run("r"))
    first = await store.begin_step(step("r", "1", input={"n": 1}))
    results: list[StepRecord] = []

    async def begin(n: int) -> None:
        results.append(await store.begin_step(step("r", "1", input={"n": n})))

    async with trio.open_nursery() as nursery:
        for n in range(2, 6):
            nursery.start_soon(begin, n)
    assert [r.input for r in results] == [{"n": 1}] * 4
    assert all(r.created_at == first.created_at for r in results)
    again, created = await store.create_run(run("r", input="other"))
    assert not created
    assert again.input == run("r").input


async def test_namespaces_are_isolated(stores: StoreFactory) -> None:
    async with stores("one") as one, stores("two") as two:
        await one.create_run(run("same", input=1))
        await two.create_run(run("same", input=2))
        await one.begin_step(step("same", "1", input="one"))
        first, second = await one.get_run("same"), await two.get_run("same")
        assert first is not None
        assert second is not None
        assert (first.input, second.input) == (1, 2)
        assert await two.get_steps("same") == []
        assert [r.run_id for r in await two.claim_runs("E", 30.0)] == ["same"]
        assert [r.run_id for r in await one.claim_runs("E", 30.0)] == ["same"]


# --------------------------------------------------------------------------- concurrency


async def test_concurrent_changes_apply_exactly_once(store: RunStore) -> None:
    created: list[bool] = []
    verdicts: list[Applied] = []
    await store.create_run(run("r", status=RunStatus.RUNNING))
    pending = await store.begin_step(step("r", "1"))

    async def create() -> None:
        created.append((await store.create_run(run("same")))[1])

    async def complete(n: int) -> None:
        done = attrs.evolve(pending, status=S.COMPLETED, output=n)
        verdicts.append(await store.update_step(done, expect_attempt=1))

    async with trio.open_nursery() as nursery:
        for n in range(20):
            nursery.start_soon(create)
            nursery.start_soon(complete, n)
    assert sorted(created) == [False] * 19 + [True]
    assert sorted(verdicts) == sorted([Applied.APPLIED] + [Applied.DUPLICATE] * 19)


async def test_sqlite_commits_concurrent_changes_together_and_isolates_a_failure(
    tmp_path: Path,
) -> None:
    store = await SqliteRunStore.open(tmp_path / "runs.db", "shop")
    failures: list[BaseException] = []
    try:

        async def good(n: int) -> None:
            await store.create_run(run(f"r{n}", input=n))

        async def bad() -> None:
            try:
                await store.create_run(run("bad", workflow=None))
            except BrokerError as exc:
                failures.append(exc)

        async with trio.open_nursery() as nursery:
            for n in range(30):
                nursery.start_soon(good, n)
            nursery.start_soon(bad)
        assert len(failures) == 1
        assert "NOT NULL" in str(failures[0])
        assert store.writes == 31
        assert store.batches < 10  # a few transactions, not 31
        assert len(await store.list_runs(limit=100)) == 30
        assert await store.get_run("bad") is None
    finally:
        await store.aclose()


async def test_sqlite_adds_the_timeout_and_trace_columns_to_a_file_written_before_them(
    tmp_path: Path,
) -> None:
    import sqlite3

    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.execute(
        """CREATE TABLE dt_runs (
            namespace TEXT NOT NULL, run_id TEXT NOT NULL, seq INTEGER NOT NULL,
            workflow TEXT NOT NULL, status TEXT NOT NULL, input TEXT NOT NULL,
            output TEXT NOT NULL DEFAULT 'null', error TEXT NOT NULL DEFAULT 'null',
            owner TEXT, lease_until REAL, created_at REAL NOT NULL, updated_at REAL NOT NULL,
            PRIMARY KEY (namespace, run_id)
        ) WITHOUT ROWID"""
    )
    db.execute(
        "INSERT INTO dt_runs (namespace, run_id, seq, workflow, status, input, created_at, "
        "updated_at) VALUES ('shop', 'old', 1, 'order', 'pending', '1', 5.0, 5.0)"
    )
    db.commit()
    db.close()
    for _ in range(2):  # and opening it again changes nothing
        store = await SqliteRunStore.open(path, "shop")
        try:
            old = await store.get_run("old")
            assert old is not None
            assert (old.input, old.timeout, old.deadline, old.trace) == (1, None, None, None)
            await store.create_run(run(f"new{_}", timeout=3.0, trace=TRACE))
            new = await store.get_run(f"new{_}")
            assert new is not None
            assert (new.timeout, new.trace) == (3.0, TRACE)
        finally:
            await store.aclose()


TRACE = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


async def test_a_runs_trace_context_is_stored_with_it(store: RunStore) -> None:
    """The trace a run belongs to (docs/observability.md) is written by ``create_run`` and
    read back by every read; a run without one reads ``None``."""
    traced = {**TRACE, "tracestate": "vendor=1"}
    stored, created = await store.create_run(run("t", trace=traced))
    assert created
    assert stored.trace == traced
    again, created = await store.create_run(run("t"))  # the existing run, its trace kept
    assert not created
    assert again.trace == traced
    await store.create_run(run("u"))
    found = await store.get_run("t"), await store.get_run("u")
    assert [r.trace if r else "missing" for r in found] == [traced, None]
    (claimed,) = await store.claim_runs("e1", 30.0, limit=1)
    assert claimed.trace in (traced, None)  # whichever it took first, whole
    page = await store.page_runs(limit=10)
    assert {r.run_id: r.trace for r in page.runs} == {"t": traced, "u": None}


@pytest.mark.parametrize("damage", ["{not json", '"a string"', '{"traceparent": 5}', "[]"])
async def test_a_damaged_stored_trace_reads_as_none(
    store_kind: str,
    stores: StoreFactory,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    damage: str,
) -> None:
    """A stored trace is advisory: one that does not read as a trace context is none (the
    run is then traced afresh), never an error; the rest of the run reads as stored."""
    async with stores("shop") as store:
        await store.create_run(run("r", input=7, trace=TRACE))
        if store_kind == "memory":
            store._runs["r"].trace = damage.encode()  # type: ignore[attr-defined]
        elif store_kind == "sqlite":
            import sqlite3

            db = sqlite3.connect(tmp_path / "runs.db")
            db.execute("UPDATE dt_runs SET trace = ?", (damage,))
            db.commit()
            db.close()
        elif store_kind == "redis-cluster":
            async with open_redis_cluster(request.getfixturevalue("redis_cluster_url")) as cluster:
                key = store._run_key("r")  # type: ignore[attr-defined]
                await cluster.execute("HSET", key, "trace", damage)
        elif store_kind == "postgres":
            async with open_pool(request.getfixturevalue("postgres_url"), size=1) as pool:
                schema = store.schema  # type: ignore[attr-defined]
                await pool.execute(f'UPDATE "{schema}".runs SET trace = $1', damage)
        else:
            async with open_redis(request.getfixturevalue("redis_url")) as client:
                key = store._run_key("r")  # type: ignore[attr-defined]
                await client.execute("HSET", key, "trace", damage)
        found = await store.get_run("r")
        assert found is not None
        assert (found.input, found.trace) == (7, None)


async def test_a_steps_heartbeat_timeout_and_last_beat_are_stored(store: RunStore) -> None:
    """Step heartbeats (issue #15, item 3): the timeout is written with the step; the last
    beat by ``update_step``, and a change made without one keeps the stored beat."""
    await store.create_run(run("r"))
    await store.begin_step(step("r", "1", heartbeat_timeout=2.5))
    fetched = await store.get_step("r", "1")
    assert fetched is not None
    assert (fetched.heartbeat_timeout, fetched.heartbeat) == (2.5, None)
    beat = {"attempt": 1, "at": 4.0, "sentAt": 1.7e9, "details": AWKWARD}
    assert (
        await store.update_step(
            attrs.evolve(fetched, heartbeat=beat, dispatched=True), expect_attempt=1
        )
        is Applied.APPLIED
    )
    beaten = await store.get_step("r", "1")
    assert beaten is not None
    assert (beaten.heartbeat, beaten.dispatched) == (beat, True)
    retry = attrs.evolve(fetched, attempt=2, heartbeat=None)  # a change made without it
    assert await store.update_step(retry, expect_attempt=1) is Applied.APPLIED
    (kept,) = await store.get_steps_many([("r", "1")])
    assert kept is not None
    assert (kept.attempt, kept.heartbeat, kept.heartbeat_timeout) == (2, beat, 2.5)


async def _file_without(tmp_path: Path, *columns: str) -> Path:
    """A file holding run ``old`` and its step ``"1"``, whose ``dt_steps`` table is back as
    it was before ``columns`` existed."""
    import sqlite3

    path = tmp_path / "old.db"
    store = await SqliteRunStore.open(path, "shop")
    try:
        await store.create_run(run("old"))
        await store.begin_step(step("old", "1"))
    finally:
        await store.aclose()
    db = sqlite3.connect(path)
    for column in columns:
        db.execute(f"ALTER TABLE dt_steps DROP COLUMN {column}")
    db.commit()
    left = {row[1] for row in db.execute("PRAGMA table_info(dt_steps)")}
    db.close()
    assert left.isdisjoint(columns)
    return path


async def test_sqlite_adds_the_heartbeat_columns_to_a_file_written_before_them(
    tmp_path: Path,
) -> None:
    path = await _file_without(tmp_path, "heartbeat", "heartbeat_timeout")
    for n in range(2):  # and opening it again changes nothing
        store = await SqliteRunStore.open(path, "shop")
        try:
            old = await store.get_step("old", "1")
            assert old is not None
            assert (old.heartbeat_timeout, old.heartbeat) == (None, None)
            await store.begin_step(step("old", f"new{n}", heartbeat_timeout=1.0))
            new = await store.get_step("old", f"new{n}")
            assert new is not None
            assert new.heartbeat_timeout == 1.0
        finally:
            await store.aclose()


async def test_a_damaged_stored_beat_reads_as_none(tmp_path: Path) -> None:
    """A last beat is advisory: one that does not read as JSON is no beat, not an error."""
    import sqlite3

    path = tmp_path / "runs.db"
    store = await SqliteRunStore.open(path, "shop")
    try:
        await store.create_run(run("r"))
        await store.begin_step(step("r", "1", heartbeat={"attempt": 1, "at": 1.0}))
    finally:
        await store.aclose()
    db = sqlite3.connect(path)
    db.execute("UPDATE dt_steps SET heartbeat = '{not json'")
    db.commit()
    db.close()
    store = await SqliteRunStore.open(path, "shop")
    try:
        found = await store.get_step("r", "1")
        assert found is not None
        assert (found.name, found.heartbeat) == ("charge", None)
    finally:
        await store.aclose()


async def test_the_attempt_log_is_written_with_the_change_that_ends_an_attempt(
    store: RunStore,
) -> None:
    """Issue 16, item 1: the log rides on the checkpoint's compare-and-set (a stale change
    writes none of it) and on an operator's reopen; JSON inside it keeps its shape."""
    await store.create_run(run("r"))
    begun = await store.begin_step(step("r", "1"))
    assert begun.attempts == ()
    first = {"attempt": 1, "outcome": "failed", "startedAt": 1.0, "endedAt": 2.5,
             "worker": "w-1", "error": {"message": "boom", "details": AWKWARD}}  # fmt: skip
    retry = attrs.evolve(begun, attempt=2, wake_at=3.0, attempts=(first,))
    assert await store.update_step(retry, expect_attempt=1) is Applied.APPLIED
    stale = attrs.evolve(begun, status=S.COMPLETED, attempts=({"attempt": 9},))
    assert await store.update_step(stale, expect_attempt=1) is Applied.STALE
    fetched = await store.get_step("r", "1")
    assert fetched is not None
    assert fetched.attempts == (first,)
    second = {"attempt": 2, "outcome": "failed", "startedAt": 3.0, "endedAt": 4.0}
    failed = attrs.evolve(fetched, status=S.FAILED, attempts=(first, second))
    assert await store.update_step(failed, expect_attempt=2) is Applied.APPLIED
    await store.finish_run("r", RunStatus.FAILED, error={"stepId": "1"})
    reopened = attrs.evolve(failed, status=S.PENDING, attempt=3, wake_at=5.0)
    assert await store.reopen_run("r", [reopened], run_timeout=None)
    (kept,) = await store.get_steps_many([("r", "1")])
    assert kept is not None
    assert (kept.attempt, kept.attempts) == (3, (first, second))


async def test_sqlite_adds_the_attempts_column_to_a_file_written_before_it(
    tmp_path: Path,
) -> None:
    path = await _file_without(tmp_path, "attempts")
    entry = {"attempt": 1, "outcome": "failed", "startedAt": 1.0, "endedAt": 2.0}
    for n in range(2):  # and opening it again changes nothing
        store = await SqliteRunStore.open(path, "shop")
        try:
            old = await store.get_step("old", "1")
            assert old is not None
            assert old.attempts == (() if n == 0 else (entry,))
            if n == 0:
                moved = attrs.evolve(old, attempt=2, attempts=(entry,))
                assert await store.update_step(moved, expect_attempt=1) is Applied.APPLIED
        finally:
            await store.aclose()


# --------------------------------------------------------------------------- signals, events


async def test_signals_and_events(store: RunStore) -> None:
    """Issue 18: a per-run, per-name signal log (only while the run is unfinished), and events
    (latest wins)."""
    await store.create_run(run("r1"))
    assert await store.append_signal("missing", "go", "1") is None
    assert await store.read_signal("r1", "go", 1) is None
    assert await store.append_signal("r1", "go", '"a"') == 1
    assert await store.append_signal("r1", "other", "{}") == 1
    assert await store.append_signal("r1", "go", '{"b": 2}') == 2
    assert [await store.read_signal("r1", "go", n) for n in (0, 1, 2, 3)] == [
        None,
        '"a"',
        '{"b": 2}',
        None,
    ]
    assert await store.read_signal("r1", "other", 1) == "{}"
    assert await store.get_events("r1") == {}
    await store.put_event("r1", "stage", '"one"')
    await store.put_event("r1", "stage", '"two"')
    await store.put_event("r1", "n", "3")
    assert await store.get_events("r1") == {"stage": '"two"', "n": "3"}
    assert await store.finish_run("r1", RunStatus.COMPLETED)
    assert await store.append_signal("r1", "go", "1") is None
    assert await store.read_signal("r1", "go", 2) == '{"b": 2}'


# -- dedup keys and debounced starts (issue 33, item 4) --------------------------------------


def fresh(**kw: Any) -> RunRecord:
    """A run under a fresh id (what the engine gives these calls; a store may draw another)."""
    return run(uuid.uuid4().hex, **kw)


async def test_a_dedup_key_names_one_unfinished_run(
    store: RunStore, store_clock: trio.testing.MockClock
) -> None:
    first, created = await store.create_run_deduped(fresh(input=AWKWARD), "k")
    assert created
    assert first.input == AWKWARD
    assert await store.get_run(first.run_id) == first
    again, created = await store.create_run_deduped(fresh(input=2), "k")
    assert (again.run_id, again.input, created) == (first.run_id, AWKWARD, False)
    other, created = await store.create_run_deduped(fresh(), "k2")
    assert created
    assert other.run_id != first.run_id
    await store.finish_run(first.run_id, RunStatus.COMPLETED)
    second, created = await store.create_run_deduped(fresh(input=3), "k")
    assert created
    assert second.run_id not in (first.run_id, other.run_id)
    await store.finish_run(second.run_id, RunStatus.BLOCKED)  # not over: still the key's
    blocked, created = await store.create_run_deduped(fresh(), "k")
    assert (blocked.run_id, created) == (second.run_id, False)
    # Racing starts of a fresh key: one run.
    got: list[tuple[str, bool]] = []

    async def start() -> None:
        stored, made = await store.create_run_deduped(fresh(), "race")
        got.append((stored.run_id, made))

    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(start)
    assert len({run_id for run_id, _ in got}) == 1
    assert sorted(made for _, made in got) == [False] * 7 + [True]


async def test_debounced_starts_fold_until_due(
    store: RunStore, store_clock: trio.testing.MockClock
) -> None:
    follow = getattr(store, "follow_trio_clock", None)
    if follow is not None:
        follow()
    t0 = trio.current_time()
    first = await store.debounce_run("k", fresh(input=1), delay=5, max_wait=8)
    assert await store.debounced_due(first) == t0 + 5
    assert await store.get_run(first) is None
    await trio.sleep(3)
    trace = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    folded = await store.debounce_run(
        "k", fresh(input=AWKWARD, timeout=9.5, trace=trace), delay=5, max_wait=8
    )
    assert folded == first
    assert await store.debounced_due(first) == t0 + 8  # min(t0 + 3 + 5, t0 + 8)
    quick = await store.debounce_run("j", fresh(input=3), delay=1, max_wait=None)
    assert quick != first
    assert await store.start_debounced() == ([], t0 + 4)
    await trio.sleep(1)
    runs, soonest = await store.start_debounced()
    assert [(r.run_id, r.input, r.status, r.owner, r.created_at) for r in runs] == [
        (quick, 3, RunStatus.PENDING, None, t0 + 4)
    ]
    assert soonest == t0 + 8
    assert await store.get_run(quick) == runs[0]
    assert await store.debounced_due(quick) is None
    await trio.sleep(4)
    runs, soonest = await store.start_debounced()
    assert [(r.run_id, r.input, r.timeout, r.trace) for r in runs] == [
        (first, AWKWARD, 9.5, trace)
    ]
    assert soonest is None
    assert await store.start_debounced() == ([], None)
    # The window closed: the key opens a new one; the runs are taken over as any orphan.
    later = await store.debounce_run("k", fresh(), delay=5, max_wait=None)
    assert later not in (first, quick)
    claimed = await store.claim_runs("e", 30)
    assert {r.run_id for r in claimed} == {first, quick}
    # Many due at once: ``limit`` at a time.
    await trio.sleep(10)
    for key in "abc":
        await store.debounce_run(key, fresh(), delay=1, max_wait=None)
        await trio.sleep(1)
    runs, _ = await store.start_debounced(limit=2)
    more, soonest = await store.start_debounced(limit=2)
    assert (len(runs), len(more), soonest) == (2, 2, None)
    assert later in {r.run_id for r in runs + more}
# --------------------------------------------------------------------------- retention (issue 34)

def _on_trio_clock(store: RunStore) -> None:
    follow = getattr(store, "follow_trio_clock", None)
    if follow is not None:
        follow()


async def _finished_run(store: RunStore, run_id: str, status: RunStatus, **kw: Any) -> float:
    """A run with a checkpoint, a signal and an event, ended with ``status``: its end time."""
    await store.create_run(run(run_id, **kw))
    await store.begin_step(step(run_id, "1", attempts=({"attempt": 1, "outcome": "failed"},)))
    assert await store.append_signal(run_id, "go", '"x"') == 1
    await store.put_event(run_id, "stage", '"done"')
    assert await store.finish_run(run_id, status, output={"n": 1})
    ended = await store.get_run(run_id)
    assert ended is not None
    return ended.updated_at


async def _gone(store: RunStore, run_id: str) -> bool:
    """Whether nothing of the run is left (and, if something is, that it is whole)."""
    found = (
        await store.get_run(run_id),
        await store.get_steps(run_id),
        await store.read_signal(run_id, "go", 1),
        await store.get_events(run_id),
    )
    if found[0] is None:
        assert found[1:] == ([], None, {}), f"{run_id}: half deleted"
        return True
    assert found[1:] != ([], None, {}), f"{run_id}: half deleted"
    assert found[1], f"{run_id}: half deleted"
    assert found[2] is not None, f"{run_id}: half deleted"
    assert found[3], f"{run_id}: half deleted"
    return False


async def test_prune_deletes_finished_runs_ended_before_the_cutoff_oldest_first(
    store: RunStore, store_clock: trio.testing.MockClock
) -> None:
    _on_trio_clock(store)
    start = trio.current_time()
    ends = {}
    for n, status in enumerate((RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED)):
        ends[f"old{n}"] = await _finished_run(store, f"old{n}", status)
        assert ends[f"old{n}"] == start + n  # exact: a finished run's end is its updated_at
        await trio.sleep(1)
    await trio.sleep(7)
    assert trio.current_time() == start + 10
    ends["new"] = await _finished_run(store, "new", RunStatus.COMPLETED)
    await store.create_run(run("live"))
    await store.create_run(run("parked"))
    assert await store.finish_run("parked", RunStatus.BLOCKED)  # not finished: never pruned
    assert await store.finished_workflows() == ["order"]
    assert await store.count_finished(start + 2) == 2  # ended at start + 0 and + 1
    assert await store.count_finished(start + 10) == 3  # the cut-off is exclusive
    assert await store.prune_finished(start + 1, limit=10) == ["old0"]
    assert await store.prune_finished(start + 10, limit=1) == ["old1"]  # oldest end first
    assert await store.prune_finished(start + 10, limit=10) == ["old2"]
    assert await store.prune_finished(start + 10, limit=10) == []  # idempotent
    for run_id in ("old0", "old1", "old2"):
        assert await _gone(store, run_id)
    assert not await _gone(store, "new")
    assert await store.count_runs() == {
        RunStatus.COMPLETED: 1, RunStatus.PENDING: 1, RunStatus.BLOCKED: 1
    }  # fmt: skip
    assert sorted(r.run_id for r in await store.list_runs()) == ["live", "new", "parked"]
    assert sorted(r.run_id for r in (await store.page_runs()).runs) == ["live", "new", "parked"]
    assert [r.run_id for r in await store.list_runs(status=RunStatus.FAILED)] == []
    assert await store.prune_finished(trio.current_time() + 1) == ["new"]
    assert await store.finished_workflows() == []
    assert trio.current_time() == start + 10  # (the store's calls take no virtual time)


async def test_prune_by_workflow_and_a_reopened_run_is_not_finished(
    store: RunStore, store_clock: trio.testing.MockClock
) -> None:
    _on_trio_clock(store)
    start = trio.current_time()
    await _finished_run(store, "a1", RunStatus.COMPLETED, workflow="a")
    await _finished_run(store, "b1", RunStatus.FAILED, workflow="b")
    await _finished_run(store, "b2", RunStatus.COMPLETED, workflow="b")
    assert await store.finished_workflows() == ["a", "b"]
    assert await store.reopen_run("b1", [], run_timeout=None)  # pending again
    await trio.sleep(5)
    assert await store.count_finished(start + 5, workflow="b") == 1
    assert await store.prune_finished(start + 5, workflow="b") == ["b2"]
    assert await store.finished_workflows() == ["a"]
    assert not await _gone(store, "b1")
    assert await store.finish_run("b1", RunStatus.FAILED)  # ends again, at start + 5
    assert await store.prune_finished(start + 5, workflow="b") == []
    assert await store.prune_finished(start + 6, workflow="b") == ["b1"]
    assert await store.prune_finished(start + 6, workflow="c") == []
    assert await store.prune_finished(start + 6) == ["a1"]


async def test_prune_keeps_a_child_while_its_parent_is_unfinished(
    store: RunStore, store_clock: trio.testing.MockClock
) -> None:
    _on_trio_clock(store)
    start = trio.current_time()
    await store.create_run(run("parent"))
    await _finished_run(store, "parent/1", RunStatus.COMPLETED, parent="parent", depth=1)
    await _finished_run(store, "orphan/1", RunStatus.COMPLETED, parent="gone", depth=1)
    await trio.sleep(10)
    # The parent has not recorded its child's end yet: the child stays.
    assert await store.prune_finished(start + 10) == ["orphan/1"]
    assert not await _gone(store, "parent/1")
    await trio.sleep(10)
    assert await store.finish_run("parent", RunStatus.COMPLETED)
    assert await store.prune_finished(start + 20) == ["parent/1"]
    assert await store.prune_finished(start + 21) == ["parent"]


async def test_a_cancelled_or_concurrent_prune_leaves_no_run_half_deleted(
    store: RunStore, store_clock: trio.testing.MockClock
) -> None:
    _on_trio_clock(store)
    ids = [f"r{n:02}" for n in range(24)]
    for run_id in ids:
        await _finished_run(store, run_id, RunStatus.COMPLETED)
    cutoff = trio.current_time() + 1
    for delay in (0, 0.001, 0.01):  # cancelled before, while and after its change is made
        with trio.move_on_after(delay):
            await store.prune_finished(cutoff, limit=4)
        assert sum([await _gone(store, run_id) for run_id in ids]) % 4 == 0
    got: list[list[str]] = []

    async def prune() -> None:
        while batch := await store.prune_finished(cutoff, limit=3):
            got.append(batch)

    async with trio.open_nursery() as nursery:
        for _ in range(3):  # engines prune the same runs concurrently: each deleted once
            nursery.start_soon(prune)
    pruned = [run_id for batch in got for run_id in batch]
    assert len(pruned) == len(set(pruned))
    assert [await _gone(store, run_id) for run_id in ids] == [True] * len(ids)
    assert await store.count_runs() == {}


@pytest.mark.parametrize("store_kind", ["redis", "redis-cluster"])
async def test_redis_prune_leaves_no_key_and_indexes_runs_that_ended_before_its_index(
    store: Any, store_clock: trio.testing.MockClock
) -> None:
    _on_trio_clock(store)
    client = store._client
    for n in range(5):
        await _finished_run(store, f"old{n}", RunStatus.COMPLETED)
    # As a store written before retention: no end index, no backfill progress.
    for prefix in store._prefixes:
        for key in ("ended:order", "ended-workflows", "ended-backfill"):
            await client.execute("DEL", f"{prefix}:{key}")
    store._pruner._indexed.clear()
    assert await store.count_finished(trio.current_time() + 1) == 5
    assert len(await store.prune_finished(trio.current_time() + 1)) == 5
    if len(store._prefixes) == 1:  # one server: only the namespace's bookkeeping is left
        keys = await client.execute("KEYS", "*")
        left = {bytes(k).decode().split("}:", 1)[1] for k in keys}
        assert left <= {"seq", "ended-backfill"}, left
