"""Dedup keys do not outlive their runs (issue 33): retention deletes a finished run's dedup
key row with the run (in the same atomic delete), in the prune's bounded batches, on every run
store; a key a newer run took over stays with that run; a start with the key after the first
run finished makes a new run. Exact virtual time (tests/_every_store.py)."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from _every_store import open_store
from durable_trio._engine import App, WorkflowContext, open_engine


def slow_app() -> App:
    app = App("dedupgc")

    @app.workflow("slow")
    async def slow(ctx: WorkflowContext, item: Any) -> Any:
        await ctx.sleep(10)
        return item

    return app


async def dedup_rows(store: Any) -> set[str]:
    """The run ids the store's dedup key rows name (each store's own layout)."""
    kind = type(store).__name__
    if kind == "MemoryRunStore":
        return set(store._dedup.values())
    if kind == "SqliteRunStore":

        def read(db: Any) -> set[str]:
            rows = db.execute(
                "SELECT run_id FROM dt_dedup_keys WHERE namespace = ?", (store._ns,)
            )
            return {str(r[0]) for r in rows}

        found: set[str] = await store._read(read)
        return found
    if kind == "PostgresRunStore":
        rows = await store._fetch(
            "SELECT run_id FROM {schema}.run_dedup_keys WHERE namespace = $1", store._ns
        )
        return {str(r[0]) for r in rows}
    assert kind == "RedisRunStore", kind
    ids: set[str] = set()
    for prefix in store._prefixes:
        reply = await store._client.execute("HVALS", f"{prefix}:dedup")
        ids |= {bytes(v).decode() for v in reply}
    return ids


async def test_retention_deletes_a_finished_run_s_dedup_key(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = slow_app()
    async with open_store(every_store, app.name) as (backend, store):
        async with open_engine(app, backend, store=store) as engine:
            t0 = trio.current_time()
            first = await engine.start("slow", 1, dedup_key="invoice")
            assert await engine.result(first) == 1
            assert trio.current_time() == t0 + 10
            assert await dedup_rows(store) == {first}  # finished: kept until retention
            second = await engine.start("slow", 2, dedup_key="invoice")  # a new run
            other = await engine.start("slow", 3, dedup_key="receipt")
            assert len({first, second, other}) == 3
            assert await dedup_rows(store) == {second, other}  # "invoice" names the newer run
            assert await store.prune_finished(store.now() + 1, limit=10) == [first]
            assert await dedup_rows(store) == {second, other}  # the newer run's row stays
            assert await engine.result(second) == 2
            assert await engine.result(other) == 3
            assert trio.current_time() == t0 + 20
            # Bounded batches: one run (and its key) per call.
            assert len(await store.prune_finished(store.now() + 1, limit=1)) == 1
            assert len(await dedup_rows(store)) == 1
            assert len(await store.prune_finished(store.now() + 1, limit=1)) == 1
            assert await dedup_rows(store) == set()
            third = await engine.start("slow", 4, dedup_key="invoice")
            assert third not in (first, second)
            assert await dedup_rows(store) == {third}
            assert await engine.result(third) == 4


async def test_an_engine_s_retention_loop_cleans_the_keys(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = slow_app()
    async with open_store(every_store, app.name) as (backend, store):
        async with open_engine(
            app, backend, store=store, retention=5, retention_interval=1
        ) as engine:
            t0 = trio.current_time()
            ids = [await engine.start("slow", n, dedup_key=f"k{n}") for n in range(3)]
            for run_id in ids:
                await engine.result(run_id)
            assert trio.current_time() == t0 + 10
            assert await dedup_rows(store) == set(ids)
            await trio.sleep_until(t0 + 20)  # ended at t0 + 10, kept 5 s, a prune each ~1 s
            assert await dedup_rows(store) == set()
            assert await engine.list(workflow="slow") == []
            again = await engine.start("slow", 9, dedup_key="k0")
            assert again not in ids
            assert await dedup_rows(store) == {again}


async def test_a_deduped_start_carries_its_tags(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    """``tags=`` with ``dedup_key=``: the run created carries the tags and is found by them; a
    refused start (the key's run unfinished) changes nothing, its tags dropped like its
    input."""
    import durable_trio as dt

    app = slow_app()
    async with open_store(every_store, app.name) as (backend, store):
        async with open_engine(app, backend, store=store) as engine:
            t0 = trio.current_time()
            first = await engine.start("slow", 1, dedup_key="k", tags={"customer": "c1"})
            again = await engine.start("slow", 2, dedup_key="k", tags={"customer": "c2"})
            assert again == first
            assert (await engine.get(first)).tags == {"customer": "c1"}
            async with dt.open_operations(backend, namespace=app.name) as ops:
                found = (await ops.list_runs(tags={"customer": "c1"})).runs
                assert [r.run_id for r in found] == [first]
                assert (await ops.list_runs(tags={"customer": "c2"})).runs == []
            assert await engine.result(first) == 1
            assert trio.current_time() == t0 + 10


async def test_a_debounced_run_carries_the_latest_start_s_tags(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    """``tags=`` with ``debounce=``: the run carries the tags of the latest start folded into
    it (like its input), indexed: found by them, not by an earlier start's."""
    import durable_trio as dt

    app = slow_app()
    async with open_store(every_store, app.name) as (backend, store):
        async with open_engine(app, backend, store=store) as engine:
            t0 = trio.current_time()
            quiet = dt.Debounce(key="user-7", delay=5)
            first = await engine.start("slow", 1, debounce=quiet, tags={"batch": "a"})
            await trio.sleep(2)
            last = await engine.start("slow", 2, debounce=quiet, tags={"batch": "b", "x": "y"})
            assert last == first
            assert await engine.result(first) == 2
            assert trio.current_time() == t0 + 17  # due 5 s after the last start, then 10 s
            assert (await engine.get(first)).tags == {"batch": "b", "x": "y"}
            async with dt.open_operations(backend, namespace=app.name) as ops:
                found = (await ops.list_runs(tags={"batch": "b"})).runs
                assert [r.run_id for r in found] == [first]
                assert (await ops.list_runs(tags={"batch": "a"})).runs == []
            plain = await engine.start("slow", 3, debounce=quiet)  # a new window, no tags
            assert plain != first
            assert await engine.result(plain) == 3
            assert (await engine.get(plain)).tags == {}
