"""Run tags (issue 34, item 2) on every run store, in exact virtual time: given at the start,
checked at the entry, stored with the run, paged by the store's tag index (several tags: every
one), with the other filters and a cursor that runs created meanwhile never shift."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from _every_store import open_store
from durable_trio._engine import App, WorkflowContext, open_engine
from durable_trio._ops import Operations


def _app() -> App:
    app = App(f"tagged-{uuid.uuid4().hex[:6]}")

    @app.workflow("order")
    async def order(ctx: WorkflowContext, n: Any) -> Any:
        return n

    @app.workflow("refund")
    async def refund(ctx: WorkflowContext, n: Any) -> Any:
        return n

    return app


async def _ids(ops: Operations, cursor: str | None = None, **filters: Any) -> list[str]:
    """Every run of the listing, page after page of 2 (the cursor tested too)."""
    seen: list[str] = []
    while True:
        page = await ops.list_runs(limit=2, cursor=cursor, **filters)
        seen += [run.run_id for run in page.runs]
        if (cursor := page.next_cursor) is None:
            return seen


async def test_tags_are_stored_and_listed_by_their_index(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = _app()
    async with open_store(every_store, app.name) as (backend, store):
        ops = Operations(backend, store, app.name)
        async with open_engine(app, backend, store=store, engine_id="a", reconcile=False) as e:
            start = trio.current_time()
            for n in range(7):  # one second apart: r0 at start, ..., r6 at start + 6
                tags = {"customer": f"c{n % 3}", "tier": "gold" if n % 2 else "basic"}
                workflow = "refund" if n == 4 else "order"
                await e.start(workflow, n, run_id=f"r{n}", detach=True, tags=tags)
                await trio.sleep(1)
            await e.start("order", 9, run_id="untagged", detach=True)
            assert trio.current_time() - start == 7
            # newest first, paged by 2
            assert await _ids(ops, tags={"customer": "c1"}) == ["r4", "r1"]
            assert await _ids(ops, tags={"customer": "c0"}) == ["r6", "r3", "r0"]
            # several tags: every one (an intersection)
            assert await _ids(ops, tags={"customer": "c0", "tier": "gold"}) == ["r3"]
            assert await _ids(ops, tags={"tier": "gold"}) == ["r5", "r3", "r1"]
            # with the other filters: workflow, the creation times (exact, store clock)
            assert await _ids(ops, tags={"customer": "c1"}, workflow="order") == ["r1"]
            got = await _ids(ops, tags={"tier": "basic"}, since=start + 2, until=start + 6)
            assert got == ["r4", "r2"]
            assert await _ids(ops, tags={"customer": "nobody"}) == []
            # stored with the run
            run = await store.get_run("r5")
            assert run is not None
            assert run.tags == {"customer": "c2", "tier": "gold"}
            plain = await store.get_run("untagged")
            assert plain is not None
            assert plain.tags == {}
            # a start of an existing id keeps its tags (and indexes nothing new)
            await e.start("order", 0, run_id="r0", detach=True, tags={"customer": "c9"})
            assert await _ids(ops, tags={"customer": "c9"}) == []


async def test_a_tagged_cursor_is_stable_while_runs_are_created_and_end(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = _app()
    async with open_store(every_store, app.name) as (backend, store):
        ops = Operations(backend, store, app.name)
        for n in range(5):
            await ops.start_run("order", n, run_id=f"r{n}", tags={"batch": "b1"})
            await trio.sleep(1)
        first = await ops.list_runs(tags={"batch": "b1"}, status="pending", limit=2)
        assert [r.run_id for r in first.runs] == ["r4", "r3"]
        # meanwhile: a new tagged run, and one already listed ends
        await ops.start_run("order", 9, run_id="late", tags={"batch": "b1"})
        await store.finish_run("r3", dt.RunStatus.CANCELLED)
        rest = await _ids(ops, tags={"batch": "b1"}, status="pending", cursor=first.next_cursor)
        assert rest == ["r2", "r1", "r0"]


async def test_bad_tags_are_refused_at_the_entry(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = _app()
    async with open_store(every_store, app.name) as (backend, store):
        ops = Operations(backend, store, app.name)
        async with open_engine(app, backend, store=store, engine_id="a", reconcile=False) as e:
            bad: list[Any] = [
                ["customer"],
                {f"k{n}": "v" for n in range(17)},
                {"": "v"},
                {"cust:omer": "v"},
                {"k" * 65: "v"},
                {"k": ""},
                {"k": "v" * 257},
                {"k": "line\nbreak"},
                {"k": "\x1b[2J"},
                {"k": 1},
            ]
            for tags in bad:
                with pytest.raises(dt.ConfigError, match="tag"):
                    await e.start("order", 1, tags=tags)
            with pytest.raises(dt.ConfigError, match="tag"):
                await ops.list_runs(tags={"k": "a\u202eb"})
            assert (await ops.list_runs()).runs == []


@pytest.mark.redis
async def test_tags_on_redis_run_shards(
    redis_url: str, store_clock: trio.testing.MockClock
) -> None:
    """Runs spread over run shards (a Cluster's layout, on one server here): each shard keeps
    its own tag indexes, a page merges the shards by creation time, the cursor holds a bound
    per shard."""
    from durable_trio._engine._stores.redis import RedisRunStore
    from durable_trio._redis import open_redis

    async with open_redis(redis_url) as client:
        store = RedisRunStore(client, f"sharded-{uuid.uuid4().hex[:6]}", shards=3)
        store.follow_trio_clock()
        start = trio.current_time()
        for n in range(9):
            run = dt.RunRecord(
                run_id=f"r{n}", workflow="w", input=n, status=dt.RunStatus.PENDING,
                created_at=0.0, updated_at=0.0,
                tags={"customer": "c1" if n % 3 else "c0", "tier": "gold" if n % 2 else "basic"},
            )  # fmt: skip
            await store.create_run(run)
            await trio.sleep(1)
        assert trio.current_time() - start == 9
        assert {store._shard_of(f"r{n}") for n in range(9)} == {0, 1, 2}

        async def ids(**filters: Any) -> list[str]:
            seen: list[str] = []
            cursor = None
            while True:
                page = await store.page_runs(limit=2, cursor=cursor, **filters)
                seen += [r.run_id for r in page.runs]
                if (cursor := page.next_cursor) is None:
                    return seen

        assert await ids(tags={"customer": "c0"}) == ["r6", "r3", "r0"]
        assert await ids(tags={"customer": "c1", "tier": "gold"}) == ["r7", "r5", "r1"]
        await store.finish_run("r5", dt.RunStatus.FAILED)
        got = await ids(tags={"customer": "c1"}, status=dt.RunStatus.FAILED)
        assert got == ["r5"]
        assert await ids(tags={"tier": "basic"}, since=start + 2, until=start + 7) == [
            "r6", "r4", "r2"
        ]  # fmt: skip
        r7 = await store.get_run("r7")
        assert r7 is not None
        keys = store._tag_keys(r7)
        assert len(keys) == 2
        for key in keys:
            assert await client.execute("ZSCORE", key, "r7") is not None


async def test_a_sqlite_file_written_before_tags_is_brought_up_to_date(tmp_path: Any) -> None:
    """The column and the index table are added on open; the runs stored before have none."""
    import sqlite3

    url = f"sqlite:///{tmp_path / 'old.db'}"
    async with open_store(url, "shop") as (_, store):
        await store.create_run(
            dt.RunRecord("old", "order", 1, dt.RunStatus.PENDING, 0.0, 0.0)
        )
    db = sqlite3.connect(tmp_path / "old.db")
    db.execute("ALTER TABLE dt_runs DROP COLUMN tags")
    db.execute("DROP TABLE dt_run_tags")
    db.commit()
    db.close()
    async with open_store(url, "shop") as (backend, store):
        old = await store.get_run("old")
        assert old is not None
        assert old.tags == {}
        ops = Operations(backend, store, "shop")
        await ops.start_run("order", 2, run_id="new", tags={"customer": "c1"})
        assert await _ids(ops, tags={"customer": "c1"}) == ["new"]
        assert await _ids(ops) == ["new", "old"]


async def test_a_tagged_page_walks_the_tag_index_not_every_run(tmp_path: Any) -> None:
    """SQLite: the query plan ranges over the tag index's primary key, newest first (no sort,
    no scan of ``dt_runs``: each run is found by its key)."""
    import sqlite3

    from durable_trio._engine._stores import _sqlite_tables as tables

    db = sqlite3.connect(":memory:")
    tables.create_schema(db)
    where, params = tables.tagged_filters({"customer": "c1", "tier": "gold"})
    query = (
        "EXPLAIN QUERY PLAN SELECT t.seq FROM dt_run_tags AS t JOIN dt_runs AS r"
        " ON r.namespace = t.namespace AND r.run_id = t.run_id WHERE t.namespace = ? AND "
        + where.replace("{tags}", "dt_run_tags")
        + " AND t.seq < ? AND r.status = ? ORDER BY t.seq DESC LIMIT 51"
    )
    plan = [row[3] for row in db.execute(query, ["ns", *params, 100, "failed"])]
    assert plan[0].startswith("SEARCH t USING PRIMARY KEY (namespace=? AND key=? AND value=?")
    assert any(step.startswith("SEARCH r USING PRIMARY KEY") for step in plan)
    assert not any("SCAN" in step or "TEMP B-TREE" in step for step in plan), plan


@pytest.mark.redis
async def test_a_redis_tagged_page_is_not_bounded_by_the_untagged_runs(redis_url: str) -> None:
    """More untagged runs than one page call examines (``PAGE_BUDGET``): the tagged run is
    found in one call, with no cursor (its index holds it alone)."""
    from durable_trio._engine._stores._redis_scripts import PAGE_BUDGET
    from durable_trio._engine._stores.redis import RedisRunStore
    from durable_trio._redis import open_redis

    async with open_redis(redis_url) as client:
        store = RedisRunStore(client, f"budget-{uuid.uuid4().hex[:6]}")
        tagged = dt.RunRecord("t", "w", 0, dt.RunStatus.FAILED, 0.0, 0.0, tags={"k": "v"})
        await store.create_run(tagged)
        for n in range(PAGE_BUDGET + 10):
            await store.create_run(dt.RunRecord(f"u{n}", "w", n, dt.RunStatus.FAILED, 0.0, 0.0))
        page = await store.page_runs(tags={"k": "v"}, status=dt.RunStatus.FAILED)
        assert ([r.run_id for r in page.runs], page.next_cursor) == (["t"], None)
        plain = await store.page_runs(workflow="other")
        assert (plain.runs, plain.next_cursor is not None) == ([], True)  # the budget, spent
