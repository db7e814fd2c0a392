"""Debounce and dedup keys of ``engine.start`` (issue 33, item 4), exact virtual-time tests on
every run store (memory, SQLite, Redis, PostgreSQL; tests/_every_store.py): folding, the latest
input winning, ``max_wait``, the ids returned, a dedup key refusing a second run until the
first ended, two engines racing one key, and a debounced start outliving its engine."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from _every_store import open_store
from durable_trio._engine import App, RunStatus, WorkflowContext, open_engine


def inbox() -> App:
    app = App("debounce")

    @app.workflow("digest")
    async def digest(ctx: WorkflowContext, item: Any) -> list[Any]:
        return [item, trio.current_time()]

    @app.workflow("slow")
    async def slow(ctx: WorkflowContext, item: Any) -> Any:
        await ctx.sleep(10)
        return item

    return app


async def test_starts_fold_into_one_run_with_the_latest_input(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = inbox()
    async with open_store(every_store, app.name) as (backend, store):
        async with open_engine(app, backend, store=store) as engine:
            t0 = trio.current_time()
            debounce = dt.Debounce(key="user-7", delay=5)
            first = await engine.start("digest", 1, debounce=debounce)
            with pytest.raises(dt.RunNotFound):
                await engine.get(first)  # not a run before it starts
            await trio.sleep(3)
            second = await engine.start("digest", 2, debounce=debounce)
            await trio.sleep(3)  # t0 + 6: the first start's 5 s passed, the second's did not
            third = await engine.start("digest", 3, debounce=debounce)
            assert first == second == third
            other = await engine.start("digest", "x", debounce=dt.Debounce(key="user-8", delay=1))
            assert other != first
            assert await engine.result(first) == [3, t0 + 11]  # 5 s after the last start
            assert await engine.result(other) == ["x", t0 + 7]
            run = await engine.get(first)
            assert run.created_at == t0 + 11
            assert run.status is RunStatus.COMPLETED
            # The window closed: the key opens a new one, a new run.
            fourth = await engine.start("digest", 4, debounce=debounce)
            assert fourth != first
            assert await engine.result(fourth) == [4, t0 + 16]
            assert len(await engine.list(workflow="digest")) == 3


async def test_max_wait_starts_a_steady_stream(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = inbox()
    async with open_store(every_store, app.name) as (backend, store):
        async with open_engine(app, backend, store=store) as engine:
            t0 = trio.current_time()
            debounce = dt.Debounce(key="k", delay=4, max_wait=9)
            ids = []
            for i in range(12):  # a start every 2 s: never 4 s of quiet
                ids.append(await engine.start("digest", i, debounce=debounce))
                await trio.sleep(2)
            # Starts at t0 + 0 .. 8 fold into one run, started at t0 + 9 (max_wait); those
            # at t0 + 10 .. 18 into the next (t0 + 19); t0 + 20 and 22 into a third, started
            # after 4 s of quiet.
            assert ids == [ids[0]] * 5 + [ids[5]] * 5 + [ids[10]] * 2
            assert len(set(ids)) == 3
            assert await engine.result(ids[0]) == [4, t0 + 9]
            assert await engine.result(ids[5]) == [9, t0 + 19]
            assert await engine.result(ids[10]) == [11, t0 + 26]


async def test_a_dedup_key_refuses_a_second_run_until_the_first_ended(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = inbox()
    async with open_store(every_store, app.name) as (backend, store):
        async with open_engine(app, backend, store=store) as engine:
            t0 = trio.current_time()
            first = await engine.start("slow", 1, dedup_key="invoice-9")
            await trio.sleep(4)
            again = await engine.start("slow", 2, dedup_key="invoice-9")
            detached = await engine.start("slow", 3, dedup_key="invoice-9", detach=True)
            assert again == detached == first
            elsewhere = await engine.start("digest", 0, dedup_key="invoice-9")  # its workflow's
            assert elsewhere != first
            assert await engine.result(first) == 1  # its input: the others made nothing
            assert trio.current_time() == t0 + 10
            fresh = await engine.start("slow", 5, dedup_key="invoice-9")
            assert fresh != first
            await engine.cancel(fresh)
            after_cancel = await engine.start("slow", 6, dedup_key="invoice-9")
            assert after_cancel not in (first, fresh)
            assert await engine.result(after_cancel) == 6
            assert trio.current_time() == t0 + 20
            assert len(await engine.list(workflow="slow")) == 3


async def test_two_engines_racing_one_key_make_one_run(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = inbox()
    async with open_store(every_store, app.name) as (backend, store):
        async with (
            open_engine(app, backend, store=store, engine_id="a") as a,
            open_engine(app, backend, store=store, engine_id="b") as b,
        ):
            t0 = trio.current_time()
            debounce = dt.Debounce(key="race", delay=2)
            deduped: list[str] = []
            debounced: list[str] = []

            async def start(engine: dt.Engine, i: int) -> None:
                deduped.append(await engine.start("slow", i, dedup_key="race"))
                debounced.append(await engine.start("digest", i, debounce=debounce))

            async with trio.open_nursery() as nursery:
                for i in range(6):
                    nursery.start_soon(start, (a, b)[i % 2], i)
            assert len(set(deduped)) == 1
            assert len(set(debounced)) == 1
            folded = await a.result(debounced[0])
            assert folded[1] == t0 + 2
            assert folded[0] in range(6)
            assert len(await a.list(workflow="slow")) == 1
            assert len(await b.list(workflow="digest")) == 1
            assert await b.result(deduped[0]) in range(6)
            assert (await b.get(deduped[0])).updated_at == t0 + 10  # ended, wherever driven


async def test_a_debounced_start_outlives_its_engine(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = inbox()
    async with open_store(every_store, app.name) as (backend, store):
        t0 = trio.current_time()
        async with open_engine(app, backend, store=store, engine_id="gone") as engine:
            run_id = await engine.start("digest", "late", debounce=dt.Debounce(key="k", delay=30))
        assert trio.current_time() == t0  # closed with the start pending
        await trio.sleep(5)
        async with open_engine(app, backend, store=store, engine_id="heir") as heir:
            assert await heir.result(run_id) == ["late", t0 + 30]
            run = await heir.get(run_id)
            assert run.owner is None
            assert run.status is RunStatus.COMPLETED


async def test_bad_keys_and_delays_fail_the_call() -> None:
    with pytest.raises(dt.ConfigError, match="key must not be empty"):
        dt.Debounce(key="", delay=1)
    with pytest.raises(dt.ConfigError, match="at most 512"):
        dt.Debounce(key="k" * 513, delay=1)
    with pytest.raises(TypeError, match="key must be a str"):
        dt.Debounce(key=7, delay=1)  # type: ignore[arg-type]
    for delay in (0, -1, float("nan"), float("inf"), 8 * 24 * 3600):
        with pytest.raises(dt.ConfigError, match="delay must be a finite number"):
            dt.Debounce(key="k", delay=delay)
    with pytest.raises(TypeError, match="delay must be a number"):
        dt.Debounce(key="k", delay="5")
    with pytest.raises(dt.ConfigError, match=r"max_wait \(4 s\) must be at least delay"):
        dt.Debounce(key="k", delay=5, max_wait=4)
    assert dt.Debounce(key="k", delay=5, max_wait=5).max_wait == 5.0
    app = inbox()
    async with dt.open_backend("memory://") as backend, open_engine(app, backend) as engine:
        debounce = dt.Debounce(key="k", delay=1)
        with pytest.raises(dt.ConfigError, match="dedup_key must not be empty"):
            await engine.start("digest", dedup_key="")
        with pytest.raises(TypeError, match="dedup_key must be a str"):
            await engine.start("digest", dedup_key=3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"debounce must be a dt\.Debounce"):
            await engine.start("digest", debounce={"key": "k"})  # type: ignore[arg-type]
        with pytest.raises(dt.ConfigError, match="together"):
            await engine.start("digest", dedup_key="k", debounce=debounce)
        with pytest.raises(dt.ConfigError, match="give no run_id"):
            await engine.start("digest", run_id="r", debounce=debounce)
        with pytest.raises(dt.ConfigError, match="give no run_id"):
            await engine.start("digest", run_id="r", dedup_key="k")
        with pytest.raises(dt.ConfigError, match="takes no dedup_key"):
            await engine.start("digest", parent="p", dedup_key="k")
        with pytest.raises(dt.UnknownWorkflow):
            await engine.start("nope", debounce=debounce)
        with pytest.raises(dt.PayloadError):
            await engine.start("digest", {1, 2}, debounce=debounce)
        with pytest.raises(dt.RunNotFound):
            await engine.result("never")
        assert await engine.list() == []
