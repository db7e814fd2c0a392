"""An outage of the run store while many runs are in flight: every run rides it out, and the
engine's reports of it are folded (docs/engine.md, "When the store or broker is down")."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import trio
import trio.testing

import durable_trio as dt
from durable_trio import App, WorkflowContext, open_engine
from durable_trio._outages import PER_WINDOW, WINDOW, OutageReports
from durable_trio._transport._options import log_error
from helpers import Errors

if TYPE_CHECKING:
    import pytest

    from durable_trio._engine import RunStore, StepRecord

RUNS = 50
DOWN_UNTIL = 30.0


class DownStore:
    """Wraps a run store: every step write raises ``BrokerUnavailable`` until ``DOWN_UNTIL``."""

    def __init__(self, inner: RunStore) -> None:
        self.inner = inner
        self.failures = 0
        self.trio_clock = getattr(inner, "trio_clock", False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def _down(self) -> None:
        await trio.lowlevel.checkpoint()
        if trio.current_time() < DOWN_UNTIL:
            self.failures += 1
            raise dt.BrokerUnavailable("the store is down")

    async def begin_step(self, step: StepRecord) -> StepRecord:
        await self._down()
        return await self.inner.begin_step(step)

    async def begin_step_unless_finished(self, step: StepRecord) -> StepRecord | None:
        await self._down()
        return await self.inner.begin_step_unless_finished(step)


async def test_an_outage_under_many_runs_is_a_handful_of_reports(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    app = App("shop")

    @app.workflow("one")
    async def one(ctx: WorkflowContext, n: int) -> int:
        return await ctx.run("local", lambda: n) * 2

    errors = Errors()
    caplog.set_level(logging.WARNING, logger="durable_trio.engine")
    async with dt.open_backend("memory://") as backend:
        async with dt.open_run_store(backend, "shop") as inner:
            store = DownStore(inner)
            async with open_engine(app, backend, store=store, on_error=errors) as engine:
                ids = [await engine.start("one", n, run_id=f"r{n}") for n in range(RUNS)]
                assert [await engine.result(run_id) for run_id in ids] == [
                    n * 2 for n in range(RUNS)
                ]
                folded = engine.statistics().reports_folded
    # every run failed again and again (about a dozen tries each over 30 s of backoff) ...
    assert store.failures > 10 * RUNS
    # ... and every failure is either reported or counted as folded
    assert len(errors.seen) + folded == store.failures
    # at most PER_WINDOW reports in each window of WINDOW seconds of the outage
    windows = int(DOWN_UNTIL // WINDOW) + 1
    assert len(errors.seen) <= PER_WINDOW * windows
    messages = errors.messages()
    assert all(m.startswith("checkpointing failed (retrying in ") for m in messages)
    assert "the store is down" in messages[0]
    # a report after the first window says how many it did not report one by one
    later = [m for m in messages if "not reported one by one" in m]
    assert later
    assert "the store is down (and " in later[0]
    assert later[0].endswith(" s before, not reported one by one)")
    # the end of the outage is said once, with what was folded
    back = [r.getMessage() for r in caplog.records if "works again" in r.getMessage()]
    assert len(back) == 1
    assert back[0].startswith("checkpointing works again (")


async def test_reports_fold_by_kind_and_window(autojump_clock: trio.testing.MockClock) -> None:
    reports = OutageReports()
    assert [reports.failed("reading") for _ in range(PER_WINDOW)] == [""] * PER_WINDOW
    assert reports.failed("reading") is None  # folded
    assert reports.failed("checkpointing") == ""  # another kind: its own window
    assert reports.folded == 1
    await trio.sleep(WINDOW)
    assert trio.current_time() == WINDOW
    text = reports.failed("reading")  # a new window: reported, with the last one's count
    assert text == " (and 1 more failure(s) of it in the 10 s before, not reported one by one)"
    reports.succeeded("reading")
    assert reports.failed("reading") == ""  # after a success, a fresh outage


def _a_connect() -> None:
    raise dt.BrokerUnavailable("could not connect to PostgreSQL at 127.0.0.1:1/postgres")


def _a_loop() -> None:
    """As a loop of the engine or the worker: meets the error and reports it."""
    try:
        _a_connect()
    except dt.BrokerUnavailable as exc:
        log_error(exc)


def test_the_default_hook_logs_an_unavailable_store_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="durable_trio")
    _a_loop()
    [record] = caplog.records
    assert record.exc_info is None  # no traceback: every loop meets it through an outage
    assert record.getMessage() == (
        "BrokerUnavailable: could not connect to PostgreSQL at 127.0.0.1:1/postgres (in _a_loop)"
    )
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger="durable_trio")  # ... unless asked for
    _a_loop()
    [record] = caplog.records
    assert record.exc_info is not None


def _a_damaged_read(message: str) -> None:
    """As a loop meeting a store that answers with an error every time (a damaged file)."""
    try:
        raise dt.BrokerError(message)
    except dt.BrokerError as exc:
        log_error(exc)


def test_a_broker_error_met_again_and_again_has_its_traceback_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A damaged SQLite file: the engine's debounced-start loop logged the same 20-line
    traceback every few seconds, for as long as nobody repaired it. The first time with its
    traceback, the same error from the same place within TRACEBACK_AGAIN_AFTER in one line."""
    from durable_trio import _logs

    now = [1000.0]
    monkeypatch.setattr(_logs, "_shown", {})
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    caplog.set_level(logging.ERROR, logger="durable_trio")
    damaged = "SQLite error: database disk image is malformed (SQLITE_CORRUPT)"
    for _ in range(3):
        _a_damaged_read(damaged)
    _a_damaged_read("another error")
    now[0] += _logs.TRACEBACK_AGAIN_AFTER
    _a_damaged_read(damaged)
    shown = [r.exc_info is not None for r in caplog.records]
    assert shown == [True, False, False, True, True]
    assert caplog.records[1].getMessage() == f"BrokerError: {damaged} (in _a_damaged_read)"
