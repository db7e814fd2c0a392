"""A schedule's workflow checked against the engines of the namespace (issue 30, item 11).

Engines advertise the workflows they run in the key store (``{prefix}-engine:{engine_id}``):
written at start, again at every lease renewal tick, removed at close. ``durable-trio schedules
add`` (without ``--app``) refuses a workflow no live engine runs (``--force`` adds it anyway) and
warns when no engine is live to ask; ``schedules list`` and the console mark such a schedule.
An engine skips a schedule of a workflow its app does not register with one WARNING line.

Engines on the memory backend under trio's virtual clock; the CLI over a real SQLite file,
beside a real engine on it (the CLI runs in a thread: it makes its own ``trio.run``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any

import orjson
import trio
import trio.testing

import durable_trio as dt
from durable_trio._engine._advert import engine_key, known_workflows, read_engines
from durable_trio._engine._schedules import Schedules
from durable_trio._naming import QueueNames
from durable_trio.cli._main import main

if TYPE_CHECKING:
    from pathlib import Path

    import pytest


def billing() -> dt.App:
    app = dt.App("billing")

    @app.workflow("remind")
    async def remind(ctx: dt.WorkflowContext, x: Any) -> Any:
        return x

    @app.workflow("invoice")
    async def invoice(ctx: dt.WorkflowContext, x: Any) -> Any:
        return x

    return app


def other_app() -> dt.App:
    """Another app whose engines share billing's namespace."""
    app = dt.App("ledger")

    @app.workflow("close-books")
    async def close_books(ctx: dt.WorkflowContext, x: Any) -> Any:
        return x

    return app


async def test_an_engine_advertises_its_workflows_while_it_runs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Written at start, refreshed every lease renewal tick (it outlives its 35 s time-to-live
    by far), removed at once on close."""
    names = QueueNames("billing")
    async with dt.open_backend("memory://") as backend:
        keys = backend.keys
        assert keys is not None
        async with dt.open_engine(billing(), backend, engine_id="e1", run_lease=30.0):
            (entry,) = await keys.entries(engine_key(names))
            assert entry.key == "billing-engine:e1"
            raw = orjson.loads(entry.value)
            assert set(raw) == {"engineId", "app", "workflows", "startedAt", "host", "pid"}
            (engine,) = await read_engines(keys, names)
            assert (engine.engine_id, engine.app) == ("e1", "billing")
            assert engine.workflows == ("invoice", "remind")
            assert (engine.host, engine.pid) == (socket.gethostname(), os.getpid())
            assert abs(engine.started_at - time.time()) < 3600
            assert engine.to_json() == raw
            await trio.sleep(200)  # ~6 time-to-lives: alive only because it is written again
            assert [e.engine_id for e in await read_engines(keys, names)] == ["e1"]
            async with dt.open_operations(backend, namespace="billing") as ops:
                assert [e.engine_id for e in await ops.engines()] == ["e1"]
        assert await keys.entries(engine_key(names)) == []  # not left to expire


async def test_the_engines_of_two_apps_on_one_namespace_are_known_together(
    autojump_clock: trio.testing.MockClock,
) -> None:
    names = QueueNames("billing")
    async with dt.open_backend("memory://") as backend:
        assert backend.keys is not None
        async with (
            dt.open_engine(billing(), backend, engine_id="b1"),
            dt.open_engine(other_app(), backend, engine_id="l1", namespace="billing"),
        ):
            engines = await read_engines(backend.keys, names)
            assert [(e.engine_id, e.app) for e in engines] == [("b1", "billing"), ("l1", "ledger")]
            assert known_workflows(engines) == frozenset({"invoice", "remind", "close-books"})
            # Another namespace's engines are not these.
            assert await read_engines(backend.keys, QueueNames("ledger")) == []
        assert await read_engines(backend.keys, names) == []
    assert known_workflows([]) is None


async def test_a_damaged_engine_key_is_skipped(autojump_clock: trio.testing.MockClock) -> None:
    names = QueueNames("billing")
    async with dt.open_backend("memory://") as backend:
        assert backend.keys is not None
        await backend.keys.put_many(
            [
                (engine_key(names, "bad-json"), b"{", 60.0),
                (engine_key(names, "no-list"), b'{"engineId": "x", "workflows": "ab"}', 60.0),
            ]
        )
        async with dt.open_engine(billing(), backend, engine_id="e1"):
            assert [e.engine_id for e in await read_engines(backend.keys, names)] == ["e1"]


async def test_an_engine_skips_a_schedule_of_an_unknown_workflow_with_one_warning(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """One WARNING line per schedule, not per tick nor per pass (nothing to the error hook:
    the engines of another app of the namespace may run it); again if it names another
    unknown workflow; the schedules it knows tick on."""
    errors: list[BaseException] = []
    caplog.set_level(logging.WARNING, logger="durable_trio")
    async with dt.open_backend("memory://") as backend:
        async with dt.open_engine(
            billing(), backend, on_error=errors.append, schedule_recheck=5.0
        ) as engine:
            schedules = Schedules(engine.store, engine.options.wall_clock)  # no app: no check
            assert await schedules.add("books", "close-books", every=10)
            assert await schedules.add("bills", "invoice", every=10)
            await trio.sleep(100)
            runs = await engine.list(workflow="invoice")
            warned = [r for r in caplog.records if "'books'" in r.getMessage()]
            assert [r.levelname for r in warned] == ["WARNING"]
            assert "workflow 'close-books', which app 'billing' does not register" in (
                warned[0].getMessage()
            )
            assert await schedules.add("books", "archive", every=10, replace=True)
            await trio.sleep(100)
    assert len(runs) >= 9  # the schedule it knows ticked on
    lines = [r.getMessage() for r in caplog.records if "'books'" in r.getMessage()]
    assert len(lines) == 2
    assert "'archive'" in lines[1]
    assert errors == []


async def test_list_marks_a_schedule_no_live_engine_runs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with dt.open_backend("memory://") as backend:
        async with (
            dt.open_engine(billing(), backend),
            dt.open_operations(backend, namespace="billing") as ops,
        ):
            known = known_workflows(await ops.engines())
            schedules = Schedules(ops.store, time.time, known=known)
            assert await schedules.add("bills", "invoice", every=60)
            assert await schedules.add("books", "close-books", every=60)
            infos = {i.name: i for i in await schedules.list()}
            assert infos["bills"].error is None
            assert infos["books"].error == (
                "unknown workflow: no live engine runs 'close-books' (they run: invoice, remind)"
            )
            # No engine known (none live, or not asked): nothing to mark.
            unknown = {i.name: i for i in await Schedules(ops.store, time.time).list()}
            assert unknown["books"].error is None


# --------------------------------------------------------------------------- the CLI


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_schedules_add_checks_the_workflow_against_the_live_engines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Beside a live engine: an unknown workflow is refused (exit 2, one line naming the ones
    the engines run), ``--force`` adds it (a warning), ``list`` marks it; a known one is added
    silently. Once the engine closed, nothing is known: ``add`` warns, ``list`` marks none."""
    url = f"sqlite:///{tmp_path / 'known.db'}"
    where = ("--backend", url, "--namespace", "billing")
    add = ("schedules", "add")
    seen: dict[str, tuple[int, str, str]] = {}

    def commands() -> None:
        seen["typo"] = _cli(capsys, *add, "bills", "invoce", "--every", "60", *where)
        seen["known"] = _cli(capsys, *add, "bills", "invoice", "--every", "60", *where)
        seen["forced"] = _cli(
            capsys, *add, "books", "close-books", "--every", "60", "--force", *where
        )
        seen["list"] = _cli(capsys, "schedules", "list", *where)
        seen["json"] = _cli(capsys, "schedules", "list", "--json", *where)

    async def beside_an_engine() -> None:
        async with (
            dt.open_backend(url) as backend,
            dt.open_engine(billing(), backend, reconcile=False),
        ):
            await trio.to_thread.run_sync(commands)

    trio.run(beside_an_engine)
    code, out, err = seen["typo"]
    assert (code, out) == (2, "")
    assert err == (
        "error: no live engine of namespace 'billing' runs workflow 'invoce' "
        "(they run: invoice, remind); --force adds it anyway\n"
    )
    assert seen["known"] == (0, "added schedule 'bills'\n", "")
    code, out, err = seen["forced"]
    assert (code, out) == (0, "added schedule 'books'\n")
    assert err == (
        "warning: no live engine of namespace 'billing' runs workflow 'close-books' "
        "(they run: invoice, remind): added anyway (--force)\n"
    )
    code, out, _ = seen["list"]
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert set(rows) == {"bills", "books"}
    assert "unknown workflow" in rows["books"]
    assert "unknown workflow" not in rows["bills"]
    listed = {s["name"]: s for s in json.loads(seen["json"][1])}
    assert "no live engine runs 'close-books'" in listed["books"]["error"]
    assert listed["bills"]["error"] is None

    # The engine closed (its key removed): nothing to check against.
    code, out, err = _cli(capsys, *add, "later", "anything", "--every", "60", *where)
    assert (code, out) == (0, "added schedule 'later'\n")
    assert err == (
        "warning: no live engine of namespace 'billing' to check workflow 'anything' "
        "against: added unchecked\n"
    )
    code, out, _ = _cli(capsys, "schedules", "list", *where)
    assert "unknown workflow" not in out


def test_schedules_add_with_app_checks_the_app_not_the_engines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--app`` is the authority: its workflows are checked, no engine is asked (no warning),
    and ``--force`` does not override it."""
    module = tmp_path / "billing_app.py"
    module.write_text(
        "import durable_trio as dt\n"
        "app = dt.App('billing')\n"
        "@app.workflow('invoice')\n"
        "async def invoice(ctx, input):\n"
        "    return input\n"
    )
    where = ("--backend", f"sqlite:///{tmp_path / 'app.db'}", "--app", f"{module}:app")
    code, out, err = _cli(capsys, "schedules", "add", "bills", "invoice", "--every", "60", *where)
    assert (code, out, err) == (0, "added schedule 'bills'\n", "")
    code, _, err = _cli(
        capsys, "schedules", "add", "books", "nope", "--every", "60", "--force", *where
    )
    assert code == 2
    assert "no workflow 'nope' in app 'billing'" in err
    assert err.count("\n") == 1
