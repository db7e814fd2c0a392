"""A debounced start whose stored due time or deadline is no time (damaged data), on SQLite and
PostgreSQL (the Redis store keeps the due time as a sorted set's score, which is always one).

* SQLite keeps text or a blob in a REAL column and sorts it above every number: such a start
  was never due, and once it was the only one left the loop's ``float()`` of the soonest due
  time raised a ``ValueError`` that ended the engine, every engine of the namespace in turn.
* PostgreSQL's double precision keeps NaN, which sorts above every number too: never due, and
  the soonest due time was NaN, so the loop read the store again at once, for ever (5,560
  reads in 3 s from one idle engine).
* A deadline of text made the next start of the same key raise a ``ValueError``.

Now a due time that is no number (text, a blob, NaN) is due at once: the run is made (and set
aside by its claim if the rest of the row is damaged too, as any damaged row); a deadline that
is no number is none. The loop also reports an error no store check foresaw and goes on.
The real clock, on a real file and the suite's private PostgreSQL.
"""

from __future__ import annotations

import sqlite3
import uuid
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from _pg_fault_process import NAMESPACE, app, expected
from durable_trio._engine import open_engine, open_worker
from durable_trio._engine._stores.postgres import PostgresRunStore
from durable_trio._postgres import open_pool
from helpers import Errors

if TYPE_CHECKING:
    from pathlib import Path

GOOD = 3


async def _sql(url: str, statement: str, *params: Any) -> None:
    """One statement (``$1`` parameters) on a connection of the test's own; ``{debounced}``
    names the store's table of debounced starts."""
    if url.startswith("sqlite:"):
        db = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        try:
            db.execute(statement.format(debounced="dt_debounced").replace("$", "?"), params)
        finally:
            db.close()
        return
    base, schema = url.split("?schema=")
    async with open_pool(base, size=1) as pool:
        await pool.fetch(statement.format(debounced=f'"{schema}".run_debounced'), *params)


async def _debounced(url: str, count: int) -> list[str]:
    """``count`` runs of ``chain`` started debounced (2 s, keys ``k0``...), no engine taking
    them yet: their ids."""
    async with dt.open_backend(url) as backend:
        async with open_engine(app, backend, namespace=NAMESPACE, reconcile=False) as caller:
            return [
                await caller.start("chain", n, debounce=dt.Debounce(key=f"k{n}", delay=2))
                for n in range(count)
            ]


@pytest.fixture(
    params=[
        pytest.param(("sqlite", "'x'"), id="sqlite-text"),
        pytest.param(("sqlite", "x'00'"), id="sqlite-blob"),
        pytest.param(("postgres", "'NaN'"), id="postgres-nan", marks=pytest.mark.postgres),
    ]
)
def damaged(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """A store's URL and a due time that is no number as that store keeps it."""
    kind, value = request.param
    if kind == "postgres":
        url = f"{request.getfixturevalue('postgres_url')}?schema=db_{uuid.uuid4().hex[:12]}"
        return url, f"{value}::float8"
    return "sqlite:///" + str(tmp_path / "runs.db"), value


async def test_a_start_due_at_no_time_is_due_now_and_the_loop_goes_on(
    damaged: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, value = damaged
    ids = await _debounced(url, GOOD + 1)
    bad = ids[GOOD]
    await _sql(url, f"UPDATE {{debounced}} SET due_at = {value} WHERE run_id = $1", bad)
    reads = [0]
    kind = PostgresRunStore if url.startswith("postgres") else None
    if kind is not None:
        real = kind.start_debounced

        async def counted(self: Any, limit: int = 100) -> Any:
            reads[0] += 1
            return await real(self, limit)

        monkeypatch.setattr(kind, "start_debounced", counted)
    errors = Errors()
    async with dt.open_backend(url) as backend:
        async with open_worker(app, backend, namespace=NAMESPACE), open_engine(
            app, backend, namespace=NAMESPACE, on_error=errors, reconcile_interval=0.5
        ) as engine:  # fmt: skip
            with trio.fail_after(30):
                # The damaged start is due now: its run is made and completes first.
                assert await engine.result(bad) == expected(GOOD)
                outputs = [await engine.result(run_id) for run_id in ids[:GOOD]]
                assert outputs == [expected(n) for n in range(GOOD)]
                # The loop lives on: a start debounced now is made when due.
                later = await engine.start("chain", 9, debounce=dt.Debounce(key="x", delay=0.1))
                assert await engine.result(later) == expected(9)
            reads[0] = 0
            await trio.sleep(3)  # idle: the loop waits for its next recheck, it does not spin
            if kind is not None:
                assert reads[0] < 10, reads
    assert errors.seen == [], errors.messages()


async def test_a_deadline_that_is_no_time_is_none(tmp_path: Path) -> None:
    url = "sqlite:///" + str(tmp_path / "runs.db")
    async with dt.open_backend(url) as backend:
        async with open_engine(app, backend, namespace=NAMESPACE, reconcile=False) as caller:
            first = await caller.start(
                "chain", 1, debounce=dt.Debounce(key="k", delay=2, max_wait=5)
            )
            await _sql(url, "UPDATE {debounced} SET deadline = 'x' WHERE run_id = $1", first)
            # The next start of the key folds into it (it raised a ValueError).
            again = await caller.start("chain", 2, debounce=dt.Debounce(key="k", delay=0.1))
            assert again == first
        async with open_worker(app, backend, namespace=NAMESPACE), open_engine(
            app, backend, namespace=NAMESPACE, reconcile_interval=0.5
        ) as engine:  # fmt: skip
            with trio.fail_after(30):
                assert await engine.result(first) == expected(2)  # (the last input wins)
