"""Retention of previous generations (issue 34, item 5): a loop workflow that continues as new
for good keeps only the generations that ended within its retention, on every run store at
exact virtual times (tests/_every_store.py). A previous generation ended when the next one's
mark was made; it is deleted ``retention`` seconds after that, by any engine's retention loop
or by ``runs prune --older-than``; the run and its current generation are never touched."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from _every_store import open_store
from durable_trio._engine import App, WorkflowContext, open_engine
from durable_trio._engine._generations import CONTINUE_STEP_ID, continuation_of
from durable_trio._engine._stores._generations import generations_of
from durable_trio.cli import main

if TYPE_CHECKING:
    from pathlib import Path

_QUIET: dict[str, Any] = {
    "reconcile_interval": None, "watch_interval": None, "audit_interval": None,
}  # fmt: skip
_PERIOD = 5  # each generation sleeps this long, then continues as new
_LAST = 11  # the generation that returns


def _app() -> App:
    app = App("tickers")

    @app.workflow("ticker")
    async def ticker(ctx: WorkflowContext, n: int) -> int:
        await ctx.sleep(_PERIOD)
        if n < _LAST:
            ctx.continue_as_new(n + 1)
        return n

    return app


async def _rows(store: Any) -> int:
    """The store's own count of previous generations' checkpoint rows (hashes on Redis)."""
    kind = type(store).__name__
    if kind == "MemoryRunStore":
        return sum(len(g) for run in store._runs.values() for g in run.generations.values())
    if kind == "SqliteRunStore":
        return int(
            await store._read(
                lambda db: db.execute("SELECT count(*) FROM dt_generations").fetchone()[0]
            )
        )
    if kind == "PostgresRunStore":
        rows = await store._fetch(
            "SELECT count(*) FROM {schema}.run_generations WHERE namespace = $1", store._ns
        )
        return int(rows[0][0])
    total = 0
    for prefix in store._prefixes:
        total += len(await store._client.execute("KEYS", f"{prefix}:gstep:*"))
    return total


async def test_a_loop_keeps_only_the_generations_that_ended_within_retention(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = _app()
    async with open_store(every_store, app.name) as (backend, store):
        async with open_engine(
            app, backend, store=store, engine_id="e", retention=12, retention_interval=2,
            **_QUIET,
        ) as engine:  # fmt: skip
            start = trio.current_time()
            run_id = await engine.start("ticker", 0, run_id="ticker")
            generations = generations_of(store)
            # Generation g ends at start + 5 (g + 1). At +37 (a prune every 1.5 to 2.5 s):
            # those that ended before +25 are gone, those from +25 on kept (likewise at +47 and
            # +57: no generation ends in a window where it may or may not be gone yet).
            for at, kept in [(37, [4, 5, 6]), (47, [6, 7, 8]), (57, [8, 9, 10])]:
                await trio.sleep_until(start + at)
                assert await generations.list_generations(run_id) == kept, at
                assert await _rows(store) == 2 * len(kept)  # a mark and a timer each
                run = await store.get_run(run_id)
                assert run is not None
                assert run.status is dt.RunStatus.RUNNING
                mark = await store.get_step(run_id, CONTINUE_STEP_ID)
                assert mark is not None
                assert continuation_of(mark).generation == kept[-1] + 1
            assert await engine.result(run_id) == _LAST
            assert trio.current_time() == start + _PERIOD * (_LAST + 1)
            assert engine.statistics().generations_pruned >= 7
            # Finished: the run goes with the rest of its generations a retention later.
            await trio.sleep(15)
            assert await store.get_run(run_id) is None
            assert await generations.list_generations(run_id) == []
            assert await _rows(store) == 0
            assert engine.statistics().runs_pruned == 1
            # Nothing of the run left in the index of ends either.
            assert await generations.count_generations(float("inf")) == 0
            assert await generations.generation_workflows() in ([], ["ticker"])  # (Redis: a name)


async def test_prune_deletes_the_generations_that_ended_before_the_cut_off(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = _app()
    async with open_store(every_store, app.name) as (backend, store):
        async with open_engine(app, backend, store=store, engine_id="e", **_QUIET) as engine:
            start = trio.current_time()
            run_id = await engine.start("ticker", 0, run_id="ticker")
            await trio.sleep_until(start + 37)
            async with dt.open_operations(backend, namespace=app.name) as ops:
                follow = getattr(ops.store, "follow_trio_clock", None)
                if follow is not None:
                    follow()
                # Ended before +25: generations 0 to 3 (ends +5, +10, +15, +20); +25 is kept.
                preview = await ops.prune_runs(12, dry_run=True)
                assert (preview.count, preview.generations) == (0, 4)
                assert await _rows(store) == 14
                report = await ops.prune_runs(12, batch=3)  # two batches
                assert (report.count, report.generations, report.ended_before) == (
                    0, 4, start + 25
                )  # fmt: skip
                assert await generations_of(store).list_generations(run_id) == [4, 5, 6]
                assert await _rows(store) == 6
                assert (await ops.prune_runs(12)).generations == 0  # nothing left to do
                shown = await ops.show_run(run_id)
                assert (shown.generation, shown.previous) == (7, (4, 5, 6))
                with pytest.raises(dt.ConfigError, match="generation 2 of run 'ticker' was "
                                   "removed by retention \\(kept: 4, 5, 6; current: 7\\)"):
                    await ops.show_run(run_id, generation=2)
                with pytest.raises(dt.ConfigError, match="no previous generation 9"):
                    await ops.show_run(run_id, generation=9)
                assert (await ops.show_run(run_id, generation=4)).generation == 4
            # The run goes on unaffected.
            assert await engine.result(run_id) == _LAST
            assert trio.current_time() == start + _PERIOD * (_LAST + 1)


async def test_the_cli_prunes_and_counts_generations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], store_clock: trio.testing.MockClock
) -> None:
    app = _app()
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    async with open_store(url, app.name) as (backend, store):
        async with open_engine(app, backend, store=store, engine_id="e", **_QUIET) as engine:
            await engine.start("ticker", _LAST - 3, run_id="ticker")
            await engine.result("ticker")
    common = ["--backend", url, "--namespace", app.name]

    def cli(*argv: str) -> tuple[int, str]:
        status = main(list(argv))
        return status, capsys.readouterr().out

    # Generations 0, 1 and 2 ended on the store's virtual clock, long before the wall clock's
    # cut-off: the dry run counts them (with the run's own); the prune deletes them with it.
    status, out = await trio.to_thread.run_sync(
        lambda: cli("runs", "prune", "--older-than", "60", "--dry-run", *common)
    )
    assert status == 0
    assert "would delete 1 finished run that ended before " in out
    assert ", and 3 previous generations (continue-as-new) (dry run" in out
    status, out = await trio.to_thread.run_sync(
        lambda: cli("runs", "prune", "--older-than", "60", "--yes", "--json", *common)
    )
    assert status == 0
    assert json.loads(out)["count"] == 1
    assert json.loads(out)["generations"] == 0  # deleted with their run


async def test_sqlite_backfills_the_ends_of_generations_archived_before_them(
    tmp_path: Path, store_clock: trio.testing.MockClock
) -> None:
    import sqlite3

    app = _app()
    path = tmp_path / "runs.db"
    url = f"sqlite:///{path}"
    async with open_store(url, app.name) as (backend, store):
        async with open_engine(app, backend, store=store, engine_id="e", **_QUIET) as engine:
            start = trio.current_time()
            await engine.start("ticker", _LAST - 3, run_id="ticker")
            await engine.result("ticker")
    with sqlite3.connect(path) as db:  # a file written before the ends existed
        db.execute("DROP TABLE dt_generation_ends")
    async with open_store(url, app.name) as (backend, store):
        ends = await store._read(
            lambda db: db.execute(
                "SELECT generation, workflow, ended_at FROM dt_generation_ends ORDER BY generation"
            ).fetchall()
        )
        # Each ended when the next one's mark was made.
        assert ends == [(g, "ticker", start + _PERIOD * (g + 1)) for g in (0, 1, 2)]
