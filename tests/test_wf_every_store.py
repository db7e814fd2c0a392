"""Exact virtual-time tests of the workflow primitives (issue 18) on every run store: memory,
SQLite, Redis and PostgreSQL, each store on trio's clock (see tests/_every_store.py): signals
and events, child workflows, cancellation inside a workflow, run timeouts."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from _every_store import open_store
from durable_trio._engine import App, RunStatus, WorkflowContext, open_engine, open_worker


async def test_signals_and_events_at_exact_times(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = App("exact-signals")

    @app.workflow("approve")
    async def approve(ctx: WorkflowContext, _: Any) -> list[Any]:
        got = [await ctx.wait_signal("ok")]
        await ctx.set_event("stage", "first")
        try:
            await ctx.wait_signal("ok", timeout=5)
        except dt.SignalTimeout:
            got.append(trio.current_time())
        got.append(await ctx.wait_signal("ok"))
        return got

    async with open_store(every_store, app.name) as (backend, store):
        async with (
            open_engine(app, backend, store=store, engine_id="a") as engine,
            open_engine(app, backend, store=store, engine_id="b", reconcile=False) as other,
        ):
            start = trio.current_time()
            run_id = await engine.start("approve", None)
            await trio.sleep(3)
            await other.signal(run_id, "ok", 1)  # not through the driving engine: its ring
            assert await other.get_event(run_id, "stage", timeout=10) == "first"
            assert trio.current_time() - start == 3
            await trio.sleep(7)
            await engine.signal(run_id, "ok", 2)
            got = await engine.result(run_id)
    assert got == [1, start + 8, 2]
    assert trio.current_time() - start == 10


def shop() -> App:
    app = App("exact-shop")

    @app.step("ship")
    async def ship(parcel: dict[str, Any]) -> str:
        await trio.sleep(parcel["seconds"])
        if parcel.get("lost"):
            raise RuntimeError(f"parcel {parcel['id']} lost")
        return f"shipped {parcel['id']}"

    @app.step("refund")
    async def refund(parcel: dict[str, Any]) -> str:
        return f"refunded {parcel['id']}"

    @app.workflow("shipment")
    async def shipment(ctx: WorkflowContext, parcel: dict[str, Any]) -> str:
        await ctx.sleep(parcel["seconds"])  # a durable timer, on the store's clock
        return str(await ctx.step("ship", parcel, retry=dt.Retry(max_attempts=1)))

    @app.workflow("order")
    async def order(ctx: WorkflowContext, parcels: list[dict[str, Any]]) -> list[str]:
        handles = [await ctx.start_child("shipment", p) for p in parcels]
        out = []
        for handle in handles:
            try:
                out.append(await handle)
            except dt.ChildFailed:
                out.append(await ctx.step("refund", parcels[len(out)]))
        return out

    return app


async def test_children_at_exact_times(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = shop()
    parcels = [
        {"id": "a", "seconds": 2},
        {"id": "b", "seconds": 3, "lost": True},
        {"id": "c", "seconds": 1},
    ]
    async with open_store(every_store, app.name) as (backend, store):
        async with open_worker(app, backend), open_engine(app, backend, store=store) as engine:
            start = trio.current_time()
            await engine.start("order", parcels, run_id="o")
            assert await engine.result("o") == ["shipped a", "refunded b", "shipped c"]
            # Each child: its durable sleep, then its step's sleep, side by side: b's 6 s last.
            assert trio.current_time() - start == 6
            children = [await engine.get(f"o/{n}") for n in (1, 2, 3)]
    assert [c.status for c in children] == [
        RunStatus.COMPLETED,
        RunStatus.FAILED,
        RunStatus.COMPLETED,
    ]
    assert [c.updated_at - start for c in children] == [4, 6, 2]


async def test_cancellation_inside_at_exact_times(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = App("exact-saga")
    undone: list[float] = []

    @app.workflow("trip")
    async def trip(ctx: WorkflowContext, _: Any) -> None:
        try:
            await ctx.sleep(3600)
        except dt.RunCancelled:
            await ctx.sleep(2)  # compensation: a durable timer too
            undone.append(trio.current_time())
            raise

    async with open_store(every_store, app.name) as (backend, store):
        async with (
            open_engine(app, backend, store=store, engine_id="a") as owner,
            open_engine(app, backend, store=store, engine_id="b", reconcile=False) as other,
        ):
            start = trio.current_time()
            await owner.start("trip", None, run_id="t")
            await trio.sleep(5)
            assert await other.cancel("t", reason="plans changed")  # the mark rings the owner
            record = await other.get("t")
    assert undone == [start + 7]
    assert record.status is RunStatus.CANCELLED
    assert record.updated_at - start == 7
    assert record.error == {"type": "RunCancelled", "message": "plans changed", "cut": False}


async def test_run_timeouts_at_exact_times(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    """A run's deadline is stored with it: an engine taking the run over after a restart keeps
    it (not restart + timeout), and a detached run counts its timeout from its start."""
    app = App("exact-timeouts")

    @app.workflow("wait")
    async def wait(ctx: WorkflowContext, _: Any) -> None:
        await ctx.sleep(100)

    async with open_store(every_store, app.name) as (backend, store):
        async with open_engine(app, backend, store=store, reconcile=False) as first:
            start = trio.current_time()
            await first.start("wait", None, run_id="w", timeout=10)
            await first.start("wait", None, run_id="d", timeout=8, detach=True)
            await trio.sleep(4)
        assert await first.status("w") is RunStatus.PENDING  # released on close
        await trio.sleep(2)
        async with open_engine(app, backend, store=store) as second:
            with pytest.raises(dt.RunTimedOut):
                await second.result("d")
            assert trio.current_time() - start == 8
            with pytest.raises(dt.RunTimedOut):
                await second.result("w")
            assert trio.current_time() - start == 10  # not 6 + 10
            runs = [await second.get(run_id) for run_id in ("w", "d")]
            stats = second.statistics()
    assert [(r.status, r.timeout, r.deadline - start) for r in runs if r.deadline] == [
        (RunStatus.FAILED, 10.0, 10.0),
        (RunStatus.FAILED, 8.0, 8.0),
    ]
    assert [r.error["type"] for r in runs if r.error] == ["RunTimedOut"] * 2
    assert (stats.runs_resumed, stats.runs_timed_out) == (2, 2)


async def test_a_name_that_is_not_utf8_is_a_config_error_at_the_call(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    """A run id, a signal name, a dedup key or a step name holding a lone surrogate (what a
    command line's non-UTF-8 bytes decode to) is refused at the call with a ConfigError naming
    it, on every store: no store (nor a queue's JSON) can hold it. Before, PostgreSQL and Redis
    raised a bare UnicodeEncodeError from their drivers, SQLite from its binding, and the
    memory store started the run and failed it at its first step's dispatch."""
    app = App("not-utf8")

    @app.workflow("w")
    async def w(ctx: WorkflowContext, step: str) -> Any:
        await ctx.run(step.replace("?", "\ud800"), lambda: 1)  # (no input holds one)
        return await ctx.wait_signal("go")

    odd = "r\ud800x"
    async with open_store(every_store, app.name) as (backend, store):
        async with open_engine(app, backend, store=store) as engine:
            refused = r"is not valid UTF-8 \(a lone surrogate at index 1\), got 'r\\ud800x'"
            with pytest.raises(dt.ConfigError, match=f"engine.start: run_id {refused}"):
                await engine.start("w", "a", run_id=odd)
            with pytest.raises(dt.ConfigError, match=f"engine.start: dedup_key {refused}"):
                await engine.start("w", "a", dedup_key=odd)
            for call in (engine.get, engine.status, engine.cancel, engine.history):
                with pytest.raises(dt.ConfigError, match=f"engine: run_id {refused}"):
                    await call(odd)
            with pytest.raises(dt.ConfigError, match=f"engine.result: run_id {refused}"):
                await engine.result(odd)
            with pytest.raises(dt.ConfigError, match=f"engine.signal: run_id {refused}"):
                await engine.signal(odd, "go", 1)
            run_id = await engine.start("w", "fine")
            with pytest.raises(dt.ConfigError, match=f"engine.signal: name {refused}"):
                await engine.signal(run_id, odd, 1)
            await engine.signal(run_id, "go", 1)
            assert await engine.result(run_id) == 1
            bad = await engine.start("w", "r?x")  # a local step's name: fails its run at once
            with pytest.raises(dt.RunFailed, match=f"ctx.run: name {refused}"):
                await engine.result(bad)
            assert (await engine.get(bad)).status is RunStatus.FAILED
            assert await engine.list() is not None  # and the engine goes on
