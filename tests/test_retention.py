"""Retention (issue 34): the engine deletes finished runs past their retention, on every run
store, at exact virtual times (tests/_every_store.py); a prune killed between or inside its
batches leaves no run half deleted; under a steady flow of runs the store stays flat (rows on
SQLite, keys on Redis); ``Operations.prune_runs`` and ``durable-trio runs prune``."""

from __future__ import annotations

import math
import sqlite3
from typing import Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from _every_store import open_store
from durable_trio._engine import App, WorkflowContext, open_engine, open_worker
from durable_trio._engine._retention import RetentionPolicy

#: Loops that would wake the virtual clock often (each wake costs the clock 250 ms of real
#: idleness on a store doing real I/O): off, or rare.
_QUIET: dict[str, Any] = {
    "reconcile_interval": None, "watch_interval": None, "audit_interval": None,
}  # fmt: skip


_WORKFLOWS = ("quick", "audit", "ledger")


def _app() -> App:
    app = App("keep")

    @app.workflow("quick")
    async def quick(ctx: WorkflowContext, n: Any) -> Any:
        await ctx.set_event("seen", n)
        return n

    @app.workflow("audit", retention=40)
    async def audit(ctx: WorkflowContext, n: Any) -> Any:
        return n

    @app.workflow("ledger", retention=math.inf)
    async def ledger(ctx: WorkflowContext, n: Any) -> Any:
        return n

    return app


async def test_the_engine_deletes_finished_runs_past_their_retention_at_exact_times(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = _app()
    async with open_store(every_store, app.name) as (backend, store):
        async with open_engine(
            app, backend, store=store, engine_id="e", retention=20, retention_interval=4,
            **_QUIET,
        ) as engine:  # fmt: skip
            start = trio.current_time()
            ids = {w: await engine.start(w, 1, run_id=f"{w}-1") for w in _WORKFLOWS}
            for run_id in ids.values():
                assert await engine.result(run_id) == 1
            ended = {w: (await store.get_run(i)).updated_at for w, i in ids.items()}
            assert ended == dict.fromkeys(ids, start)  # they end at once, in virtual time
            # The loop sleeps 3 to 5 s between prunes: a run is gone at most 5 s after its
            # retention, never before it.
            await trio.sleep(20)
            assert await store.get_run(ids["quick"]) is not None
            await trio.sleep(5)
            assert await store.get_run(ids["quick"]) is None
            assert await store.get_events(ids["quick"]) == {}
            assert await store.get_run(ids["audit"]) is not None  # its own: 40 s
            await trio.sleep(15)
            assert await store.get_run(ids["audit"]) is not None
            await trio.sleep(5)
            assert await store.get_run(ids["audit"]) is None
            await trio.sleep(60)
            assert await store.get_run(ids["ledger"]) is not None  # math.inf: for good
            assert engine.statistics().runs_pruned == 2
            assert trio.current_time() == start + 105


async def test_no_retention_keeps_every_run_and_the_loop_does_not_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = App("forever")

    @app.workflow("quick")
    async def quick(ctx: WorkflowContext, n: Any) -> Any:
        return n

    assert not RetentionPolicy.of(app, None).prunes
    async with dt.open_backend("memory://") as backend, open_engine(app, backend) as engine:
        run_id = await engine.start("quick", 1)
        await engine.result(run_id)
        await trio.sleep(3600)
        assert (await engine.store.get_run(run_id)) is not None


def test_retention_is_checked() -> None:
    app = App("checked")
    for bad in (0, -1, math.nan):
        with pytest.raises(dt.ConfigError):
            app.workflow("w", retention=bad)
    with pytest.raises(TypeError):
        app.workflow("w", retention="7d")  # type: ignore[arg-type]
    with pytest.raises(dt.ConfigError):
        dt.EngineOptions(retention=0)
    with pytest.raises(dt.ConfigError):
        dt.EngineOptions(retention_batch=0)
    assert dt.EngineOptions(retention=math.inf).retention == math.inf


class _KilledAfter:
    """The engine's store, killed (the engine's scope cancelled) after ``batches`` prunes: as
    a process killed between two batches, or (``inside``) while its change is being made."""

    def __init__(self, store: Any, scope: trio.CancelScope, batches: int, inside: bool) -> None:
        self._store, self._scope, self._left, self._inside = store, scope, batches, inside

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def prune_finished(self, ended_before: float, **kw: Any) -> list[str]:
        self._left -= 1
        if self._left == 0 and self._inside:
            self._scope.cancel()  # the change is made (a store's write runs to its end) or not
        ids: list[str] = await self._store.prune_finished(ended_before, **kw)
        if self._left == 0:
            self._scope.cancel()
            await trio.lowlevel.checkpoint()
        return ids


@pytest.mark.parametrize("inside", [False, True], ids=["between-batches", "inside-a-batch"])
async def test_an_engine_killed_mid_prune_leaves_no_run_half_deleted_and_another_finishes(
    every_store: str, store_clock: trio.testing.MockClock, inside: bool
) -> None:
    app = App("killed")

    @app.workflow("quick")
    async def quick(ctx: WorkflowContext, n: Any) -> Any:
        await ctx.set_event("seen", n)
        return n

    async with open_store(every_store, app.name) as (backend, store):
        async with open_engine(app, backend, store=store, engine_id="starter") as starter:
            start = trio.current_time()
            ids = [await starter.start("quick", n, run_id=f"r{n:02}") for n in range(20)]
            for run_id in ids:
                await starter.result(run_id)
        await trio.sleep(10)  # every run past its retention
        with trio.CancelScope() as scope:
            killed = _KilledAfter(store, scope, batches=2, inside=inside)
            async with open_engine(
                app, backend, store=killed, engine_id="a", retention=10, retention_interval=10,
                retention_batch=3, reconcile=False, release_on_close=False,
            ):  # fmt: skip
                await trio.sleep_forever()
        assert scope.cancelled_caught
        left = []
        for run_id in ids:  # each run whole or gone
            run, events = await store.get_run(run_id), await store.get_events(run_id)
            assert (run is None) == (events == {}), run_id
            if run is not None:
                left.append(run_id)
        assert 20 - 6 <= len(left) <= 20 - 3  # two batches of 3: the second's change or not
        async with open_engine(
            app, backend, store=store, engine_id="b", retention=10, retention_interval=10,
            retention_batch=3,
        ):  # fmt: skip
            await trio.sleep(12.5)
            assert [await store.get_run(run_id) for run_id in ids] == [None] * 20
        assert await store.count_runs() == {}
        assert trio.current_time() <= start + 10 + 2 * 12.5 + 12.5


async def test_operations_prune_runs_and_its_dry_run(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = App("ops-prune")

    @app.workflow("a")
    async def a(ctx: WorkflowContext, n: Any) -> Any:
        return n

    @app.workflow("b")
    async def b(ctx: WorkflowContext, n: Any) -> Any:
        return n

    async with open_store(every_store, app.name) as (backend, store):
        async with open_engine(app, backend, store=store, **_QUIET) as engine:
            for n in range(5):
                await engine.result(await engine.start("a", n))
                await engine.result(await engine.start("b", n))
                await trio.sleep(10)  # ended at start + 0, 10, 20, 30, 40
            async with dt.open_operations(backend, namespace=app.name) as ops:
                follow = getattr(ops.store, "follow_trio_clock", None)
                if follow is not None:
                    follow()
                # now: start + 50; older than 25 s: ended before start + 25 (0, 10, 20)
                dry = await ops.prune_runs(25, workflow="a", dry_run=True)
                assert (dry.count, dry.dry_run) == (3, True)
                assert (await ops.prune_runs(25, workflow="a", batch=2)).count == 3
                assert (await ops.prune_runs(25, workflow="a")).count == 0
                assert (await ops.prune_runs(25, dry_run=True)).count == 3
                assert (await ops.prune_runs(25)).count == 3
                assert (await ops.prune_runs(5)).count == 4
                with pytest.raises(dt.ConfigError):
                    await ops.prune_runs(0)
            assert await store.count_runs() == {}


async def test_a_steady_flow_of_runs_under_retention_keeps_the_store_flat(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    """Runs finish as fast as they start (one step each, through a worker): with retention
    the store's size (SQLite and PostgreSQL rows, Redis keys, runs on memory) stops growing."""
    app = App("soak")

    @app.step("work")
    async def work(n: int) -> int:
        return n

    @app.workflow("order")
    async def order(ctx: WorkflowContext, n: int) -> int:
        got: int = await ctx.step("work", n)
        await ctx.set_event("done", got)
        return got

    sizes: list[int] = []

    async def size(store: Any) -> int:
        if every_store.startswith("sqlite"):
            path = every_store.removeprefix("sqlite:///")
            with sqlite3.connect(path) as db:
                return sum(
                    db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
                    for table in ("dt_runs", "dt_steps", "dt_signals", "dt_events")
                )
        if every_store.startswith("redis"):
            return int(await store._client.execute("DBSIZE"))
        if every_store.startswith("postgres"):
            tables = ("runs", "run_steps", "run_signals", "run_events", "run_tags")
            counts = [await store._fetch(f"SELECT count(*) FROM {{schema}}.{t}") for t in tables]
            return sum(int(rows[0][0]) for rows in counts)
        return sum((await store.count_runs()).values())

    async with open_store(every_store, app.name) as (backend, store):
        async with (
            open_worker(app, backend),
            open_engine(app, backend, store=store, retention=5, retention_interval=2) as engine,
        ):
            for second in range(40):
                for n in range(5):
                    await engine.start("order", n, run_id=f"s{second}-{n}")
                await trio.sleep(1)
                if second % 10 == 9:
                    sizes.append(await size(store))
            assert engine.statistics().runs_pruned > 120
    # 5 runs/s kept 5 s plus at most 2.5 s until a prune: at most ~40 runs, each a few rows
    # or keys; the samples at 10, 20, 30 and 40 s are all about that, not growing (without
    # retention they would be 50, 100, 150 and 200 runs).
    assert max(sizes) - min(sizes) <= max(sizes) // 2, sizes
    assert sizes[-1] <= sizes[0] * 1.5, sizes


def test_the_cli_reads_durations() -> None:
    from durable_trio.cli._operations import duration

    assert [duration(t) for t in ("90", "30s", "15m", "12h", "7d", "2w", "1.5h")] == [
        90.0, 30.0, 900.0, 43_200.0, 604_800.0, 1_209_600.0, 5400.0
    ]  # fmt: skip
    for bad in ("", "0", "-1d", "7x", "d", "nan", "inf"):
        with pytest.raises(dt.ConfigError):
            duration(bad)
