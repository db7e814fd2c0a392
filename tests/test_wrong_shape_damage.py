"""Values of the wrong shape in the SQLite run store's columns (damaged data, written with raw
SQL as an operator's mistake or a bad restore would leave them), in a run that is mid-flight.

SQLite keeps any value in any column: a REAL or INTEGER column may hold text (``'x'``), and an
INTEGER one a REAL (``9e999``, infinity). Such a value reached arithmetic late: an engine
adopting a run whose ``timeout`` was text raised out of ``open_engine`` (``run.deadline``), so
no engine of the namespace could start; ``runs show``, ``runs list`` and the console's pages
ended in a traceback on a text time or attempt. The row mappers now check the number columns,
so the row is a :class:`~durable_trio.RunDataError` naming the column: an engine sets the run
aside (failed with that error) and drives the runs beside it, ``runs show`` says so in one
line, a listing names it beside the others. A time no calendar has (infinity, which is a REAL
like any other) is shown by the console as stored, as ``runs show`` already did; a CHILD step
whose input names no child is left out of ``runs show``'s children, and its run is set aside
by the engine adopting it.

Engines run at exact virtual times (``store_clock``, tests/_every_store.py).
"""

from __future__ import annotations

import sqlite3
from functools import partial
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio
import trio.testing

import durable_trio as dt
from _every_store import open_store
from durable_trio._engine import App, WorkflowContext, open_engine, open_worker
from durable_trio.cli import main
from durable_trio.console import create_app

if TYPE_CHECKING:
    from pathlib import Path

pytest.importorskip("starlette")

_QUIET: dict[str, Any] = {
    "reconcile_interval": None, "watch_interval": None, "audit_interval": None,
}  # fmt: skip


def _app(beating: list[bool]) -> App:
    app = App("shapes")

    @app.step("double")
    async def double(n: int) -> int:
        return 2 * n

    @app.step("slow", heartbeat_timeout=50)
    async def slow(n: int) -> int:
        if beating[0]:  # the first engine's worker: beats, then works on past its close
            dt.step_info().heartbeat({"n": n})
            await trio.sleep(1000)
        return 3 * n

    @app.workflow("sleeper")
    async def sleeper(ctx: WorkflowContext, n: int) -> int:
        doubled: int = await ctx.step("double", n)
        await ctx.sleep(100)
        return doubled

    @app.workflow("waiter")
    async def waiter(ctx: WorkflowContext, n: int) -> int:
        out: int = await ctx.step("slow", n)
        return out

    @app.workflow("parent")
    async def parent(ctx: WorkflowContext, n: int) -> int:
        out: int = await ctx.child("sleeper", n, run_id="kid")
        return out

    @app.workflow("plain")
    async def plain(ctx: WorkflowContext, n: int) -> int:
        doubled: int = await ctx.step("double", n)
        return doubled

    @app.workflow("listener")
    async def listener(ctx: WorkflowContext, n: int) -> Any:
        return await ctx.wait_signal("go")

    return app


def _cli(capsys: pytest.CaptureFixture[str], url: str, *argv: str) -> tuple[int, str, str]:
    status = main([*argv, "--backend", url, "--namespace", "shapes"])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


async def _damaged(
    tmp_path: Path, workflow: str, damage: str, owned: bool = False
) -> tuple[str, App]:
    """The store's URL, after run ``hurt`` of ``workflow`` ran 15 s (then its engine closed)
    and ``damage`` (one SQL statement; ``hurt`` given an owner whose lease holds if
    ``owned``) was written to it, and the app (its later workers' steps end at once)."""
    path = tmp_path / "runs.db"
    url = f"sqlite:///{path}"
    beating = [True]
    app = _app(beating)
    async with open_store(url, app.name) as (backend, store):
        async with open_worker(app, backend), open_engine(
            app, backend, store=store, **_QUIET
        ) as engine:  # fmt: skip
            await engine.start(workflow, 2, run_id="hurt", detach=True)
            await trio.sleep(15)  # sleeper: at its timer; waiter: its step beat, running
    beating[0] = False
    db = sqlite3.connect(path, isolation_level=None)
    try:
        if owned:
            db.execute("UPDATE dt_runs SET owner = 'ghost' WHERE run_id = 'hurt'")
        assert db.execute(damage).rowcount == 1
    finally:
        db.close()
    return url, app


async def _console(backend: dt.Backend) -> dict[str, httpx.Response]:
    """The console's answers about run ``hurt``: its JSON, its page, and the runs page."""
    async with dt.open_operations(backend, namespace="shapes") as ops:
        transport = httpx.ASGITransport(app=create_app(ops))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            pages = ("/raw/run?id=hurt", "/runs/hurt", "/runs")
            return {page: await http.get(page) for page in pages}


async def _plain_beside(app: App, backend: dt.Backend, store: Any) -> Exception | None:
    """Open an engine on the damaged store: it starts and drives a run beside ``hurt``.
    Returns how ``engine.result("hurt")`` failed (``None``: it completed, or did not end
    within two minutes)."""
    async with open_worker(app, backend), open_engine(
        app, backend, store=store, **_QUIET
    ) as engine:  # fmt: skip
        with trio.fail_after(60):
            assert await engine.result(await engine.start("plain", 21)) == 42
        try:
            with trio.move_on_after(120):
                await engine.result("hurt")
        except (dt.RunFailed, dt.RunDataError) as exc:
            return exc
    return None


async def _set_aside_beside(app: App, backend: dt.Backend, store: Any, url: str, said: str) -> None:
    """:func:`_plain_beside`, and run ``hurt`` was set aside: it failed saying ``said``, and is
    stored failed with a RunDataError."""
    failed = await _plain_beside(app, backend, store)
    assert isinstance(failed, dt.RunFailed | dt.RunDataError), failed
    assert said in str(failed)
    stored, error = _stored(url)
    assert stored == "failed"
    assert "RunDataError" in error


def _stored(url: str) -> tuple[str, str]:
    """Run ``hurt``'s stored status and error."""
    db = sqlite3.connect(url.removeprefix("sqlite:///"))
    try:
        row = db.execute("SELECT status, error FROM dt_runs WHERE run_id = 'hurt'").fetchone()
    finally:
        db.close()
    return str(row[0]), str(row[1])


#: (workflow, the damage, whether an engine sets the run aside): each column holds a value
#: that is no number, text in a REAL or an INTEGER column, a REAL (infinity) in an INTEGER
#: one. A text ``updated_at`` is mended by the claim (it writes the column): the run goes on.
NO_NUMBER = [
    pytest.param("sleeper", "UPDATE dt_runs SET timeout = 'x'", True, id="run-timeout"),
    pytest.param("sleeper", "UPDATE dt_runs SET created_at = 'x'", True, id="run-created"),
    pytest.param("sleeper", "UPDATE dt_runs SET updated_at = 'x'", False, id="run-updated"),
    pytest.param("sleeper", "UPDATE dt_runs SET depth = 'x'", True, id="run-depth"),
    pytest.param("sleeper", "UPDATE dt_steps SET attempt = 'x'", True, id="step-attempt-text"),
    pytest.param("waiter", "UPDATE dt_steps SET attempt = 9e999", True, id="step-attempt-inf"),
    # (an attempt below 1, attempts counting from 1: every result was stale, the run waited)
    pytest.param("waiter", "UPDATE dt_steps SET attempt = 0", True, id="step-attempt-zero"),
    pytest.param("sleeper", "UPDATE dt_steps SET attempt = -3", True, id="step-attempt-below"),
    pytest.param("sleeper", "UPDATE dt_steps SET created_at = 'x'", True, id="step-created"),
    pytest.param("waiter", "UPDATE dt_steps SET priority = 'x'", True, id="step-priority"),
    pytest.param(
        "waiter", "UPDATE dt_steps SET heartbeat_timeout = 'x'", True, id="step-heartbeat-timeout"
    ),
    pytest.param(
        "sleeper", "UPDATE dt_steps SET wake_at = 'x' WHERE step_id = '2'", True, id="timer-wake-at"
    ),
]


def _on_hurt(damage: str) -> str:
    """``damage`` (an UPDATE) limited to run ``hurt`` (and its step ``1`` unless it says)."""
    if "WHERE" in damage:
        return damage + " AND run_id = 'hurt'"
    if damage.startswith("UPDATE dt_steps"):
        return damage + " WHERE run_id = 'hurt' AND step_id = '1'"
    return damage + " WHERE run_id = 'hurt'"


@pytest.mark.parametrize(("workflow", "damage", "set_aside"), NO_NUMBER)
async def test_a_number_column_holding_no_number_sets_its_run_aside(
    tmp_path: Path,
    store_clock: trio.testing.MockClock,
    capsys: pytest.CaptureFixture[str],
    workflow: str,
    damage: str,
    set_aside: bool,
) -> None:
    url, app = await _damaged(tmp_path, workflow, _on_hurt(damage))
    # Shown: one error line naming the run, no traceback; listed beside the others.
    status, out, err = await trio.to_thread.run_sync(
        partial(_cli, capsys, url, "runs", "show", "hurt")
    )
    assert (status, out) == (2, "")
    assert err.startswith("error: run 'hurt': its stored "), err
    assert "cannot be read" in err
    assert "Traceback" not in err
    status, out, err = await trio.to_thread.run_sync(partial(_cli, capsys, url, "runs", "list"))
    assert status == 0, err
    assert "hurt" in out + err
    assert "Traceback" not in err
    async with open_store(url, app.name) as (backend, store):
        # The console answers: an error status for the run, the runs page as usual.
        pages = await _console(backend)
        assert pages["/raw/run?id=hurt"].status_code == 503
        assert pages["/runs/hurt"].status_code == 503
        assert pages["/runs"].status_code == 200
        # The next engine starts, sets the run aside and drives the run beside it. (A run
        # whose own row cannot be read stays so: asked for, it is that RunDataError.)
        if not set_aside:
            assert await _plain_beside(app, backend, store) is None
            assert _stored(url)[0] == "completed"
            return
        await _set_aside_beside(app, backend, store, url, "cannot be read")


#: Times no calendar has (infinity is a REAL like any other): the console shows them as stored.
NO_TIME = [
    pytest.param("sleeper", "UPDATE dt_runs SET created_at = 9e999", False, id="run-created"),
    pytest.param("sleeper", "UPDATE dt_runs SET lease_until = 9e999", True, id="run-lease"),
    pytest.param("sleeper", "UPDATE dt_steps SET updated_at = 9e999", False, id="step-updated"),
    pytest.param(
        "sleeper", "UPDATE dt_steps SET wake_at = 9e999 WHERE step_id = '2'", False, id="timer"
    ),
    pytest.param(
        "waiter",
        'UPDATE dt_steps SET heartbeat = \'{"attempt": 1, "at": 1e308, "sentAt": 1e308}\'',
        False,
        id="step-last-beat",
    ),
]


@pytest.mark.parametrize(("workflow", "damage", "owned"), NO_TIME)
async def test_a_time_no_calendar_has_is_shown_as_stored(
    tmp_path: Path,
    store_clock: trio.testing.MockClock,
    capsys: pytest.CaptureFixture[str],
    workflow: str,
    damage: str,
    owned: bool,
) -> None:
    url, app = await _damaged(tmp_path, workflow, _on_hurt(damage), owned)
    for argv in (["runs", "show", "hurt"], ["runs", "list"]):
        status, _, err = await trio.to_thread.run_sync(partial(_cli, capsys, url, *argv))
        assert (status, err) == (0, ""), err
    async with open_store(url, app.name) as (backend, store):
        pages = await _console(backend)
        assert [reply.status_code for reply in pages.values()] == [200, 200, 200]
        page = pages["/runs/hurt"].text
        assert 'title="not a time">inf<' in page or 'title="not a time">1e+308<' in page
        await _plain_beside(app, backend, store)  # whatever becomes of the run


@pytest.mark.parametrize(
    "child_input",
    [
        pytest.param("{}", id="empty"),
        pytest.param('{"input": 2, "onParentCancel": "cancel"}', id="no-run-id"),
    ],
)
async def test_a_child_step_naming_no_child_is_shown_without_it(
    tmp_path: Path,
    store_clock: trio.testing.MockClock,
    capsys: pytest.CaptureFixture[str],
    child_input: str,
) -> None:
    damage = f"UPDATE dt_steps SET input = '{child_input}' WHERE run_id = 'hurt' AND step_id = '1'"
    url, app = await _damaged(tmp_path, "parent", damage)
    for argv in (["runs", "show", "hurt"], ["runs", "show", "hurt", "--json"]):
        status, out, err = await trio.to_thread.run_sync(partial(_cli, capsys, url, *argv))
        assert (status, err) == (0, ""), err
        assert "kid" not in out
    async with open_store(url, app.name) as (backend, store):
        pages = await _console(backend)
        assert [reply.status_code for reply in pages.values()] == [200, 200, 200]
        # The engine lives on and sets the run aside, saying what is damaged (replayed, the
        # child step met a KeyError or an assertion).
        await _set_aside_beside(
            app, backend, store, url, "a child step whose input names no child run"
        )


@pytest.mark.parametrize(
    "seq",
    [
        pytest.param("'x'", id="text"),
        pytest.param("9e999", id="real"),
        pytest.param("9223372036854775807", id="the-last-integer"),
    ],
)
async def test_a_signal_whose_stored_seq_is_damaged_is_passed_over_or_said(
    tmp_path: Path,
    store_clock: trio.testing.MockClock,
    capsys: pytest.CaptureFixture[str],
    seq: str,
) -> None:
    # A signal's next seq was ``int(MAX(seq)) + 1``: over a seq of text or a REAL a bare
    # ValueError or OverflowError (``runs signal`` a traceback); over the last integer an
    # overflow. Now a seq that is no integer is passed over (its row is never read), and one
    # that leaves no next is a RunDataError naming the signal. The other names go on.
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    app = _app([False])
    async with open_store(url, app.name) as (backend, store):
        async with open_worker(app, backend), open_engine(
            app, backend, store=store, **_QUIET
        ) as engine:  # fmt: skip
            await engine.start("listener", 1, run_id="hurt", detach=True)
            await engine.signal("hurt", "pre", 0)
    db = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
    try:
        assert db.execute(f"UPDATE dt_signals SET seq = {seq} WHERE name = 'pre'").rowcount == 1
    finally:
        db.close()
    last = seq == "9223372036854775807"
    status, _, err = await trio.to_thread.run_sync(
        partial(_cli, capsys, url, "runs", "signal", "hurt", "pre", "1")
    )
    assert "Traceback" not in err
    assert (status, "cannot take another" in err) == ((2, True) if last else (0, False)), err
    async with open_store(url, app.name) as (backend, store):
        async with open_worker(app, backend), open_engine(
            app, backend, store=store, **_QUIET
        ) as engine:  # fmt: skip
            if last:
                with pytest.raises(dt.RunDataError, match="signals 'pre' cannot take another"):
                    await engine.signal("hurt", "pre", 2)
            else:
                await engine.signal("hurt", "pre", 2)
            await engine.signal("hurt", "go", 7)
            with trio.fail_after(60):
                assert await engine.result("hurt") == 7
