"""A damaged run row never fails a listing: ``page_runs`` (the operators' listing: ``runs
list``, the console) names it in :attr:`RunPage.damaged`, ``list_runs`` leaves it out with a
WARNING, and paging goes on past it (SQLite, PostgreSQL, Redis, Redis with run shards).

The damage is written on a connection of the test's own, as an operator's mistake or a bad
restore would leave it: one run's input that is not JSON."""

from __future__ import annotations

import json
import logging
import sqlite3
import uuid
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from _every_store import STORED_KINDS, stored_url
from _pg_fault_process import NAMESPACE, app
from durable_trio._engine import open_engine, open_run_store
from durable_trio._postgres import open_pool
from durable_trio.cli._main import main
from durable_trio.console._runs_view import RunFilters, render_runs

if TYPE_CHECKING:
    from pathlib import Path

GOOD = 4


@pytest.fixture(params=STORED_KINDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return stored_url(request, tmp_path, "l_")


async def _damage(url: str, run_id: str) -> None:
    """Make ``run_id``'s stored input unreadable (not JSON)."""
    if url.startswith("sqlite:"):
        db = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        try:
            db.execute("UPDATE dt_runs SET input = '[1, 2' WHERE run_id = ?", (run_id,))
        finally:
            db.close()
    elif url.startswith("postgresql:"):
        base, schema = url.split("?schema=")
        async with open_pool(base, size=1) as pool:
            statement = f"UPDATE \"{schema}\".runs SET input = '[1, 2' WHERE run_id = $1"
            await pool.fetch(statement, run_id)
    else:
        from durable_trio._engine._stores.redis import RedisRunStore
        from durable_trio._redis import open_redis

        async with dt.open_backend(url) as backend, open_run_store(backend, NAMESPACE) as store:
            assert isinstance(store, RedisRunStore)
            key = store._run_key(run_id)
        async with open_redis(url) as client:
            assert await client.execute("HSET", key, "input", b"[1, 2") == 0


async def _start(url: str) -> None:
    """``GOOD`` runs and one to damage (``bad``, the third newest), nobody driving them."""
    async with (
        dt.open_backend(url) as backend,
        open_engine(app, backend, namespace=NAMESPACE, reconcile=False) as caller,
    ):
        for n in range(GOOD):
            await caller.start("chain", n, run_id=f"good-{n}", detach=True)
            if n == 1:
                await caller.start("chain", 9, run_id="bad", detach=True)
    await _damage(url, "bad")


async def _listings(url: str) -> tuple[list[dt.RunPage], list[str]]:
    pages = []
    async with (
        dt.open_backend(url) as backend,
        dt.open_operations(backend, namespace=NAMESPACE) as ops,
    ):
        cursor = None
        while True:
            page = await ops.list_runs(limit=2, cursor=cursor)
            pages.append(page)
            if (cursor := page.next_cursor) is None:
                break
        async with open_run_store(backend, NAMESPACE) as store:
            listed = [run.run_id for run in await store.list_runs(limit=100)]
    return pages, listed


def test_a_damaged_row_is_named_by_the_listing_and_paging_goes_on(
    store_url: str, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    trio.run(_start, store_url)
    with caplog.at_level(logging.WARNING, logger="durable_trio.engine"):
        pages, listed = trio.run(_listings, store_url)
    # Newest first, two rows a page, the damaged one counting toward its page's limit.
    rows = [[r.run_id for r in p.runs] + [d.run_id for d in p.damaged] for p in pages]
    assert rows == [["good-3", "good-2"], ["good-1", "bad"], ["good-0"]]
    ((damaged,),) = [p.damaged for p in pages if p.damaged]
    assert damaged.run_id == "bad"
    assert "run 'bad'" in damaged.reason
    # list_runs leaves it out, with a WARNING naming it.
    assert listed == ["good-3", "good-2", "good-1", "good-0"]
    assert any("run 'bad'" in r.getMessage() for r in caplog.records)
    # runs list: the others as ever, the damaged row named after them; exit 0.
    base = ["--backend", store_url, "--namespace", NAMESPACE]
    assert main(["runs", "list", *base]) == 0
    out = capsys.readouterr().out
    assert "good-0" in out
    assert "1 damaged (unreadable) run row(s):" in out
    assert "bad" in out.split("damaged (unreadable)")[1]
    assert main(["runs", "list", "--json", *base]) == 0
    data: Any = json.loads(capsys.readouterr().out)
    assert len(data["runs"]) == GOOD
    assert [d["runId"] for d in data["damaged"]] == ["bad"]


@pytest.mark.redis
def test_a_damaged_hash_in_a_sharded_redis_store_is_named_in_its_place(redis_url: str) -> None:
    """Runs spread over run shards: the pages merge the shards by creation time, a damaged
    hash in its place as far as its fields can be read."""
    from durable_trio._engine._stores.redis import RedisRunStore
    from durable_trio._redis import open_redis

    async def check() -> None:
        async with open_redis(redis_url) as client:
            store = RedisRunStore(client, f"sharded-{uuid.uuid4().hex[:6]}", shards=3)
            for n in range(6):
                run = dt.RunRecord(
                    run_id=f"r{n}", workflow="w", input=n, status=dt.RunStatus.PENDING,
                    created_at=0.0, updated_at=0.0,
                )  # fmt: skip
                await store.create_run(run)
                await trio.sleep(0.01)
            assert await client.execute("HSET", store._run_key("r2"), "input", b"[1") == 0
            seen: list[str] = []
            cursor = None
            while True:
                page = await store.page_runs(limit=2, cursor=cursor)
                seen += [r.run_id for r in page.runs] + [f"!{d.run_id}" for d in page.damaged]
                if (cursor := page.next_cursor) is None:
                    break
            assert seen == ["r5", "r4", "r3", "!r2", "r1", "r0"]
            assert [r.run_id for r in await store.list_runs(limit=10)] == [
                "r5", "r4", "r3", "r1", "r0"
            ]  # fmt: skip

    trio.run(check)


def test_the_console_names_damaged_rows_escaped() -> None:
    body = render_runs(
        RunFilters({}),
        [],
        None,
        damaged=[dt.DamagedRun("<b>x</b>", "run '<b>x</b>': its stored row cannot be read")],
    )
    assert "Damaged run rows (1)" in body
    assert "&lt;b&gt;x&lt;/b&gt;" in body
    assert "<b>x</b>" not in body
    assert "no run matches" not in body
