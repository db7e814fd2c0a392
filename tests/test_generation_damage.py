"""Damaged generations (continue-as-new, issue 34, item 5), on PostgreSQL and SQLite.

A damaged checkpoint of a run's previous generation: ``ops.show_run(run, generation=N)`` and
``durable-trio runs show RUN --generation N`` report it as they report the same damage in the
run's current generation.

A column of a checkpoint that cannot be read (not JSON, an unknown kind) fails the view with
:class:`~durable_trio.RunDataError` naming the run and the checkpoint, and the CLI says so in
one ``error:`` line with exit status 2, no traceback; the run's other generations still show.
A damaged attempt log is advisory: the step is shown with a note, exit status 0.

The damage is written with raw SQL on a connection of the test's own, as an operator's mistake
or a bad restore would leave it; the run itself is driven by an engine at exact virtual times
(``store_clock``, tests/_every_store.py).

A continue-as-new mark of the wrong shape, and a timer's wake-up time that is no time. A mark
is JSON naming where its generation starts (``{"generation": 2, "lastStep": 4, ...}``).
Text that is not JSON was already reported; JSON whose numbers are not numbers (``"x"``, a
list) reached ``int()``: ``runs show`` ended in a traceback, and an engine adopting the run
crashed building its context. Now the mark is a :class:`~durable_trio.RunDataError` naming the
run: ``runs show`` says so in one line (exit status 2), and an engine sets the run aside
(failed with that error) and drives the runs beside it. A timer's ``wake_at`` of infinity
showed a traceback in ``runs show`` (``datetime`` refuses it): it is printed as stored.
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

RUN = "loop"

#: The damages that make a checkpoint unreadable: (column, stored text, the damaged checkpoint in
#: generation 0, the same checkpoint's counterpart in the current generation 2).
UNREADABLE = [
    pytest.param("output", "{garbage", "1", "5", id="output-not-json"),
    pytest.param("kind", "bogus", "1", "5", id="unknown-kind"),
    pytest.param("input", "[1, 2", "continue:run", "continue:run", id="mark-not-json"),
]


def _app() -> App:
    app = App("loops")

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
        return f"{request.getfixturevalue('postgres_url')}?schema=g_{uuid.uuid4().hex[:12]}"
    return "sqlite:///" + str(tmp_path / "runs.db")


async def _sql(url: str, statement: str, *params: Any) -> None:
    """One statement (``$1`` parameters) on a connection of the test's own; ``{steps}`` and
    ``{generations}`` name the run store's tables of the current and previous generations."""
    if url.startswith("sqlite:"):
        statement = statement.format(steps="dt_steps", generations="dt_generations")
        db = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        try:
            db.execute(statement.replace("$", "?"), params)
        finally:
            db.close()
        return
    base, schema = url.split("?schema=")
    statement = statement.format(
        steps=f'"{schema}".run_steps', generations=f'"{schema}".run_generations'
    )
    async with open_pool(base, size=1) as pool:
        await pool.fetch(statement, *params)


async def _damage(url: str, column: str, value: str, step_id: str, *, generation: int) -> None:
    """Set text column ``column`` of checkpoint ``step_id`` to ``value``: in previous generation
    ``generation``, or in the current one if that is the run's current (2)."""
    if generation == 2:
        statement = f"UPDATE {{steps}} SET {column} = $3 WHERE run_id = $1 AND step_id = $2"
        await _sql(url, statement, RUN, step_id, value)
        return
    statement = (
        f"UPDATE {{generations}} SET {column} = $3 "
        "WHERE run_id = $1 AND step_id = $2 AND generation = $4"
    )
    await _sql(url, statement, RUN, step_id, value, generation)


async def _run_three_generations(url: str) -> None:
    """Run ``RUN`` to its end: previous generations 0 and 1, and the current one, 2."""
    app = _app()
    async with open_store(url, app.name) as (backend, store):
        async with open_worker(app, backend), open_engine(
            app, backend, store=store, **_QUIET
        ) as engine:  # fmt: skip
            await engine.start("counter", {"n": 2, "total": 0}, run_id=RUN)
            assert await engine.result(RUN) == {"n": 4, "total": 18}


async def _shown(url: str, generation: int | None) -> dt.RunDetails | dt.RunDataError:
    """The operations API's view of ``RUN``'s ``generation``, or the RunDataError it raised."""
    async with open_store(url, "loops") as (backend, _), dt.open_operations(
        backend, namespace="loops"
    ) as ops:  # fmt: skip
        try:
            return await ops.show_run(RUN, generation=generation)
        except dt.RunDataError as exc:
            return exc


def _cli(capsys: pytest.CaptureFixture[str], url: str, *argv: str) -> tuple[int, str, str]:
    """``durable-trio runs show RUN *argv`` on ``url``: its status, stdout and stderr."""
    status = main(["runs", "show", RUN, *argv, "--backend", url, "--namespace", "loops"])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize(("column", "value", "previous", "current"), UNREADABLE)
async def test_an_unreadable_checkpoint_of_a_previous_generation_is_reported_as_a_current_one(
    store_url: str,
    store_clock: trio.testing.MockClock,
    capsys: pytest.CaptureFixture[str],
    column: str,
    value: str,
    previous: str,
    current: str,
) -> None:
    url = store_url
    await _run_three_generations(url)
    await _damage(url, column, value, previous, generation=0)
    # The damaged generation: a RunDataError naming the run and the checkpoint.
    failed = await _shown(url, 0)
    assert isinstance(failed, dt.RunDataError), failed
    assert str(failed).startswith(f"run {RUN!r}: its stored checkpoint {previous!r} cannot be read")
    # The run's other generations still show.
    kept = await _shown(url, 1)
    assert isinstance(kept, dt.RunDetails), kept
    assert [s.step_id for s in kept.steps] == ["3"]
    now = await _shown(url, None)
    assert isinstance(now, dt.RunDetails), now
    assert (now.generation, now.previous) == (2, (0, 1))
    # The CLI: one error line, exit status 2, whether as text or as JSON.
    for argv in (["--generation", "0"], ["--generation", "0", "--json"]):
        status, out, err = await trio.to_thread.run_sync(partial(_cli, capsys, url, *argv))
        assert (status, out) == (2, "")
        assert err == f"error: {failed}\n"
    status, out, err = await trio.to_thread.run_sync(partial(_cli, capsys, url))
    assert status == 0, err
    assert "generation 2  previous 0 1" in out
    # The same damage in the current generation: reported the same way.
    await _damage(url, column, value, current, generation=2)
    failed_now = await _shown(url, None)
    assert isinstance(failed_now, dt.RunDataError), failed_now
    reason = str(failed).partition(" cannot be read ")[2]
    assert str(failed_now) == (
        f"run {RUN!r}: its stored checkpoint {current!r} cannot be read {reason}"
    )
    status, out, err = await trio.to_thread.run_sync(partial(_cli, capsys, url))
    assert (status, out, err) == (2, "", f"error: {failed_now}\n")


async def test_a_damaged_attempt_log_of_a_previous_generation_is_a_note_as_in_a_current_one(
    store_url: str, store_clock: trio.testing.MockClock, capsys: pytest.CaptureFixture[str]
) -> None:
    url = store_url
    await _run_three_generations(url)
    note = "attempt log damaged: the stored attempt log is not JSON"
    for step_id, generation in (("1", 0), ("5", 2)):
        await _damage(url, "attempts", "{garbage", step_id, generation=generation)
        shown = await _shown(url, generation)
        assert isinstance(shown, dt.RunDetails), shown
        (step,) = shown.steps
        assert step.step_id == step_id
        assert step.notes[0].startswith(note)
        argv = ["--generation", str(generation)]
        status, out, err = await trio.to_thread.run_sync(partial(_cli, capsys, url, *argv))
        assert (status, err) == (0, "")
        assert f"note: step {step_id} (double): {note}" in out


async def _left_mid_flight(
    app: App, backend: dt.Backend, store: Any, state: dict[str, int], seconds: float
) -> None:
    """``RUN`` started from ``state`` and driven ``seconds``, then its engine closed (the run
    left pending in the store, mid-flight)."""
    async with open_worker(app, backend), open_engine(
        app, backend, store=store, **_QUIET
    ) as engine:  # fmt: skip
        await engine.start("counter", state, run_id=RUN, detach=True)
        await trio.sleep(seconds)


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
        # Generation 1 sleeps (its mark written at 10 s).
        await _left_mid_flight(app, backend, store, {"n": 2, "total": 0}, 15)
        await _sql(
            url, "UPDATE {steps} SET input = $2 WHERE run_id = $1 AND step_id = 'continue:run'",
            RUN, mark,
        )  # fmt: skip
        # Shown: one error line naming the run and its mark, no traceback.
        status, out, err = await trio.to_thread.run_sync(partial(_cli, capsys, url))
        assert (status, out) == (2, "")
        assert err.startswith("error: run 'loop': its continue-as-new mark cannot be read (")
        # Adopted by the next engine: set aside, failed with that error; the engine lives on
        # and drives a run beside it.
        async with open_worker(app, backend), open_engine(
            app, backend, store=store, **_QUIET
        ) as engine:  # fmt: skip
            with pytest.raises(dt.RunFailed) as failed:
                await engine.result(RUN)
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
        await _left_mid_flight(app, backend, store, {"n": 4, "total": 0}, 5)  # its timer set
        await _sql(
            url, "UPDATE {steps} SET wake_at = $2 WHERE run_id = $1 AND wake_at IS NOT NULL",
            RUN, float("inf"),
        )  # fmt: skip
        for argv in ([], ["--json"]):
            status, out, err = await trio.to_thread.run_sync(partial(_cli, capsys, url, *argv))
            assert (status, err) == (0, ""), err
            assert "inf" in out.lower()
