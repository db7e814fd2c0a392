"""Operations.cancel_run, the operator's cancel (the CLI's ``runs cancel``, the console's
button): a run an engine drives gets the cancel mark, the engine raises RunCancelled inside
the workflow, its compensation runs, and the long step it left running on a real worker is
cancelled (its handler sees trio.Cancelled) once the run ended. On the memory backend in
virtual time; on SQLite (whose broker runs on the wall clock) through the CLI."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import pytest
import trio

import durable_trio as dt
from durable_trio._engine._records import RunRecord, RunStatus
from durable_trio.cli._main import main

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path


@attrs.define
class _Seen:
    started: trio.Event = attrs.Factory(trio.Event)
    cancelled: trio.Event = attrs.Factory(trio.Event)
    started_at: float = -1.0
    cancelled_at: float = -1.0
    compensated_at: list[float] = attrs.Factory(list)


def _app(seen: _Seen) -> dt.App:
    app = dt.App("shop")

    @app.step("pack")
    async def pack(x: int) -> int:
        seen.started_at = trio.current_time()
        seen.started.set()
        try:
            await trio.sleep(3600)
        except trio.Cancelled:
            seen.cancelled_at = trio.current_time()
            seen.cancelled.set()
            raise
        return x

    @app.step("unpack")
    async def unpack(x: int) -> None:
        seen.compensated_at.append(trio.current_time())

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, x: int) -> int:
        try:
            return int(await ctx.step("pack", x))
        except dt.RunCancelled:
            await ctx.step("unpack", x)  # compensation
            raise

    return app


@asynccontextmanager
async def _packing(
    seen: _Seen, **worker: Any
) -> AsyncIterator[tuple[dt.Engine, dt.Operations, str]]:
    """An engine, a worker and the operations on memory, and a run whose long step has been
    running for 15 s: the moment every memory test here cancels it."""
    app = _app(seen)
    async with (
        dt.open_backend("memory://") as backend,
        dt.open_worker(app, backend, **worker),
        dt.open_engine(app, backend) as engine,
        dt.open_operations(backend, namespace="shop") as ops,
    ):
        run_id = await engine.start("order", 1)
        await seen.started.wait()
        await trio.sleep(15)
        assert trio.current_time() == seen.started_at + 15 == 15
        yield engine, ops, run_id


async def test_ops_cancel_run_delivers_run_cancelled_then_cancels_the_running_step(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    seen = _Seen()
    errors: list[Exception] = []
    caplog.set_level(logging.INFO, logger="durable_trio")
    async with _packing(seen, on_error=errors.append) as (engine, ops, run_id):
        assert await ops.cancel_run(run_id, reason="operator says stop")
        assert not await ops.cancel_run(run_id)  # already ended: no second cancel
        with trio.fail_after(60):
            await seen.cancelled.wait()
        # The mark rings the store's wakes: the engine raises RunCancelled inside the workflow
        # at once, whose compensation runs at once; then it asks the workers to cancel the step
        # the run left running.
        assert seen.compensated_at == [15.0]
        assert seen.cancelled_at == 15.0
        record = await engine.get(run_id)
        assert record.status is dt.RunStatus.CANCELLED
        assert record.error == {
            "type": "RunCancelled",
            "message": "operator says stop",
            "cut": False,
        }
        assert (await ops.show_run(run_id)).run.status is dt.RunStatus.CANCELLED
    # The step stopped because its run was cancelled: asked for, so not an error.
    assert errors == []
    stopped = [r for r in caplog.records if "stopped: run" in r.getMessage()]
    assert [(r.levelno, "'pack'" in r.getMessage()) for r in stopped] == [(logging.INFO, True)]


async def test_ops_cancel_run_with_no_grace_settles_at_once_without_compensation(
    autojump_clock: object,
) -> None:
    seen = _Seen()
    async with _packing(seen) as (engine, ops, run_id):
        assert await ops.cancel_run(run_id, reason="now", grace=0)
        with trio.fail_after(60):
            await seen.cancelled.wait()
        # the memory broker wakes the worker's control loop at the push: the step is cancelled
        # at the very virtual instant of the operator's cancel
        assert seen.cancelled_at == 15.0
        await trio.sleep(30)
        assert seen.compensated_at == []
        record = await engine.get(run_id)
        assert record.error == {"type": "RunCancelled", "message": "now"}


async def test_ops_cancel_run_without_wait_returns_once_marked(
    autojump_clock: object,
) -> None:
    seen = _Seen()
    async with _packing(seen) as (engine, ops, run_id):
        assert await ops.cancel_run(run_id, wait=False)
        assert trio.current_time() == 15.0
        assert not await ops.cancel_run(run_id, wait=False)  # already under way
        with trio.fail_after(60):
            await seen.cancelled.wait()
        assert seen.compensated_at == [15.0]
        assert seen.cancelled_at == 15.0
        assert (await engine.get(run_id)).status is dt.RunStatus.CANCELLED


async def test_ops_cancel_run_of_a_run_whose_engine_is_gone_is_cut_after_grace_and_lease(
    autojump_clock: object,
) -> None:
    """The owner died with the run's lease held (no engine left to deliver the mark): the
    operator's cancel settles it itself once ``grace`` plus what was left of the lease are
    over, with ``"cut": true``."""
    async with (
        dt.open_backend("memory://") as backend,
        dt.open_operations(backend, namespace="shop") as ops,
    ):
        store = ops.store
        now = store.now()
        run = RunRecord("r1", "order", 1, RunStatus.PENDING, now, now)
        await store.create_run(run)
        claimed = await store.claim_runs("dead-engine", 30.0)
        assert [r.run_id for r in claimed] == ["r1"]
        started = trio.current_time()
        assert await ops.cancel_run("r1", grace=5)
        assert 35 <= trio.current_time() - started <= 35.5
        record = await store.get_run("r1")
        assert record is not None
        assert record.status is RunStatus.CANCELLED
        assert record.error == {
            "type": "RunCancelled",
            "message": "cancelled by an operator",
            "cut": True,
        }
        # its owner's lease had expired: a second run is settled at once
        await store.create_run(attrs.evolve(run, run_id="r2"))
        assert [r.run_id for r in await store.claim_runs("dead-engine", 30.0)] == ["r2"]
        await trio.sleep(31)
        started = trio.current_time()
        assert await ops.cancel_run("r2")
        assert trio.current_time() == started


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_cli_runs_cancel_delivers_run_cancelled(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """SQLite's and PostgreSQL's brokers run on the wall clock (see test_sqlite.py): real,
    bounded time, and the cancel goes through ``durable-trio runs cancel`` in a thread of its
    own (its own ``trio.run`` and its own connection to the store), as an operator's shell
    would. The engine's lease is 3 s, so it looks for marks every second."""
    seen = _Seen()
    app = _app(seen)
    url = f"sqlite:///{tmp_path / 'ops.db'}"
    if kind == "postgres":
        url = str(request.getfixturevalue("postgres_schema_url"))
    async with (
        dt.open_backend(url) as backend,
        dt.open_worker(app, backend, poll_interval=0.02, idle_backoff_max=1),
        dt.open_engine(app, backend, run_lease=3) as engine,
    ):
        run_id = await engine.start("order", 1)
        with trio.fail_after(10):
            await seen.started.wait()
        argv = ["runs", "cancel", run_id, "--backend", url, "--namespace", "shop"]
        with trio.fail_after(20):
            assert await trio.to_thread.run_sync(main, argv) == 0
        with trio.fail_after(10):
            await seen.cancelled.wait()
        assert len(seen.compensated_at) == 1
        record = await engine.get(run_id)
        assert record.status is dt.RunStatus.CANCELLED
        assert record.error == {
            "type": "RunCancelled",
            "message": "cancelled by an operator",
            "cut": False,
        }


async def test_console_cancel_returns_at_once_and_the_engine_compensates(
    autojump_clock: object,
) -> None:
    from durable_trio.console import create_app
    from test_console import ACTION, client

    seen = _Seen()
    app = _app(seen)
    async with (
        dt.open_backend("memory://") as backend,
        dt.open_worker(app, backend),
        dt.open_engine(app, backend) as engine,
        dt.open_operations(backend, namespace="shop") as ops,
        client(create_app(ops, allow_actions=True)) as http,
    ):
        run_id = await engine.start("order", 1)
        await seen.started.wait()
        reply = await http.post("/api/runs/cancel", json={"run_id": run_id}, headers=ACTION)
        assert reply.status_code == 200
        assert "cancel sent to the engine driving it" in reply.json()["message"]
        assert trio.current_time() == 0.0
        with pytest.raises(dt.RunCancelled):
            await engine.result(run_id)
        assert seen.compensated_at == [0.0]  # at once: the mark rang the store's wakes
        page = await http.get(f"/runs/{run_id}")
        assert "badge-cancelled" in page.text


async def test_ops_cancel_run_refuses_a_negative_or_non_finite_grace(
    autojump_clock: object,
) -> None:
    """``grace=-1`` or NaN once passed for ``0`` ("settle at once, without compensation", as
    ``grace > 0`` is false for both): now a clear error, and the run goes on untouched."""
    seen = _Seen()
    async with _packing(seen) as (engine, ops, run_id):
        for grace in (-1.0, float("nan"), float("-inf"), float("inf")):
            with pytest.raises(dt.ConfigError, match="grace must be a finite number"):
                await ops.cancel_run(run_id, grace=grace)
        with pytest.raises(TypeError, match="grace"):
            await ops.cancel_run(run_id, grace="5")  # type: ignore[arg-type]
        assert (await engine.get(run_id)).status is dt.RunStatus.RUNNING
        assert seen.compensated_at == []


@pytest.mark.parametrize("grace", ["-1", "nan", "inf"])
def test_cli_runs_cancel_refuses_a_negative_or_non_finite_grace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], grace: str
) -> None:
    url = f"sqlite:///{tmp_path / 'ops.db'}"

    async def create() -> None:
        async with dt.open_backend(url) as backend:
            async with dt.open_operations(backend, namespace="shop", existing=False) as ops:
                now = ops.store.now()
                run = RunRecord("r1", "order", 1, RunStatus.PENDING, now, now)
                await ops.store.create_run(run)

    async def status() -> RunStatus:
        async with dt.open_backend(url) as backend:
            async with dt.open_operations(backend, namespace="shop") as ops:
                record = await ops.store.get_run("r1")
                assert record is not None
                return record.status

    trio.run(create)
    argv = ["runs", "cancel", "r1", "--grace", grace, "--backend", url, "--namespace", "shop"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    wanted = "runs cancel: --grace must be a finite number of seconds >= 0"
    assert err == f"error: {wanted}, got {float(grace)!r}\n"
    assert trio.run(status) is RunStatus.PENDING  # not settled "without compensation"
