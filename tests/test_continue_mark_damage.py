"""A continue-as-new mark (issue 34, item 5) whose input is JSON of the wrong shape, and a
timer's wake-up time that is no time (damaged data, on SQLite and PostgreSQL).

A mark is JSON naming where its generation starts (``{"generation": 2, "lastStep": 4, ...}``).
Text that is not JSON was already reported; JSON whose numbers are not numbers (``"x"``, a
list) reached ``int()``: ``runs show`` ended in a traceback, and an engine adopting the run
crashed building its context. Now the mark is a :class:`~durable_trio.RunDataError` naming the
run: ``runs show`` says so in one line (exit status 2), and an engine sets the run aside
(failed with that error) and drives the runs beside it. A timer's ``wake_at`` of infinity
showed a traceback in ``runs show`` (``datetime`` refuses it): it is printed as stored.

The damage is written with raw SQL, as an operator's mistake or a bad restore would leave it;
engines run at exact virtual times (``store_clock``, tests/_every_store.py).
"""

from __future__ import annotations

import sqlite3
import uuid
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from _every_store import open_store
from durable_trio._engine import App, WorkflowContext, open_engine, open_worker
from durable_trio._postgres import open_pool
from durable_trio.cli import main

if TYPE_CHECKING:
    from pathlib import Path

_QUIET: dict[str, Any] = {
    "reconcile_interval": None, "watch_interval": None, "audit_interval": None,
}  # fmt: skip


def _app() -> App:
    app = App("marks")

    @app.step("double")
    async def double(n: int) -> int:
        return 2 * n

    @app.workflow("counter")
    async def counter(ctx: WorkflowContext, state: dict[str, int]) -> dict[str, int]:
        doubled = await ctx.step("double", state["n"])
        await ctx.sleep(10)
        if state["n"] < 4:
            ctx.continue_as_new({"n": state["n"] + 1, "total": state["total"] + doubled})
        return {"n": state["n"], "total": state["total"] + doubled}

    @app.workflow("plain")
    async def plain(ctx: WorkflowContext, n: int) -> int:
        doubled: int = await ctx.step("double", n)
        return doubled

    return app


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgres":
        return f"{request.getfixturevalue('postgres_url')}?schema=m_{uuid.uuid4().hex[:12]}"
    return "sqlite:///" + str(tmp_path / "runs.db")


async def _sql(url: str, statement: str, *params: Any) -> None:
    """One statement (``$1`` parameters) on a connection of the test's own; ``{steps}`` names
    the run store's table of checkpoints."""
    if url.startswith("sqlite:"):
        db = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        try:
            db.execute(statement.format(steps="dt_steps").replace("$", "?"), params)
        finally:
            db.close()
        return
    base, schema = url.split("?schema=")
    async with open_pool(base, size=1) as pool:
        await pool.fetch(statement.format(steps=f'"{schema}".run_steps'), *params)


def _cli(capsys: pytest.CaptureFixture[str], url: str, *argv: str) -> tuple[int, str, str]:
    status = main([*argv, "--backend", url, "--namespace", "marks"])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


#: Marks of the right JSON and the wrong shape.
WRONG_MARKS = [
    pytest.param('{"generation": "x", "lastStep": 2}', id="generation-not-a-number"),
    pytest.param('{"generation": 1, "lastStep": [2]}', id="last-step-a-list"),
    pytest.param('{"generation": 1, "lastStep": 2, "signals": {"s": [1]}}', id="signal-count"),
]


@pytest.mark.parametrize("mark", WRONG_MARKS)
async def test_a_mark_of_the_wrong_shape_sets_its_run_aside_and_shows_as_damaged(
    store_url: str,
    store_clock: trio.testing.MockClock,
    capsys: pytest.CaptureFixture[str],
    mark: str,
) -> None:
    url = store_url
    app = _app()
    async with open_store(url, app.name) as (backend, store):
        async with open_worker(app, backend), open_engine(
            app, backend, store=store, **_QUIET
        ) as engine:  # fmt: skip
            await engine.start("counter", {"n": 2, "total": 0}, run_id="loop", detach=True)
            await trio.sleep(15)  # generation 1 sleeps (its mark written at 10 s)
        await _sql(
            url, "UPDATE {steps} SET input = $2 WHERE run_id = $1 AND step_id = 'continue:run'",
            "loop", mark,
        )  # fmt: skip
        # Shown: one error line naming the run and its mark, no traceback.
        status, out, err = await trio.to_thread.run_sync(
            partial(_cli, capsys, url, "runs", "show", "loop")
        )
        assert (status, out) == (2, "")
        assert err.startswith("error: run 'loop': its continue-as-new mark cannot be read (")
        # Adopted by the next engine: set aside, failed with that error; the engine lives on
        # and drives a run beside it.
        async with open_worker(app, backend), open_engine(
            app, backend, store=store, **_QUIET
        ) as engine:  # fmt: skip
            with pytest.raises(dt.RunFailed) as failed:
                await engine.result("loop")
            assert "its continue-as-new mark cannot be read" in str(failed.value)
            assert await engine.result(await engine.start("plain", 21)) == 42


async def test_a_timer_waking_at_infinity_is_shown_as_stored(
    store_url: str,
    store_clock: trio.testing.MockClock,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = store_url
    app = _app()
    async with open_store(url, app.name) as (backend, store):
        async with open_worker(app, backend), open_engine(
            app, backend, store=store, **_QUIET
        ) as engine:  # fmt: skip
            await engine.start("counter", {"n": 4, "total": 0}, run_id="one", detach=True)
            await trio.sleep(5)  # its timer is set
        await _sql(
            url, "UPDATE {steps} SET wake_at = $2 WHERE run_id = $1 AND wake_at IS NOT NULL",
            "one", float("inf"),
        )  # fmt: skip
        for argv in (["runs", "show", "one"], ["runs", "show", "one", "--json"]):
            status, out, err = await trio.to_thread.run_sync(partial(_cli, capsys, url, *argv))
            assert (status, err) == (0, ""), err
            assert "inf" in out.lower()
