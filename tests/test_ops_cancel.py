"""Operations.cancel_run reaches the workers: a long step running on a real worker is
cancelled (its handler sees trio.Cancelled) after an operator's cancel: on the memory backend
in virtual time, on SQLite (whose broker runs on the wall clock) through the CLI."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import trio

import durable_trio as dt
from durable_trio._cli import main

if TYPE_CHECKING:
    from pathlib import Path


@attrs.define
class _Seen:
    started: trio.Event = attrs.Factory(trio.Event)
    cancelled: trio.Event = attrs.Factory(trio.Event)
    started_at: float = -1.0
    cancelled_at: float = -1.0


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

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, x: int) -> int:
        return int(await ctx.step("pack", x))

    return app


async def test_ops_cancel_run_cancels_the_running_step_on_the_worker(
    autojump_clock: object,
) -> None:
    seen = _Seen()
    app = _app(seen)
    async with (
        dt.open_backend("memory://") as backend,
        dt.open_worker(app, backend),
        dt.open_engine(app, backend) as engine,
        dt.open_operations(backend, namespace="shop") as ops,
    ):
        run_id = await engine.start("order", 1)
        await seen.started.wait()
        await trio.sleep(10)
        cancelled_at = trio.current_time()
        assert cancelled_at == seen.started_at + 10
        assert await ops.cancel_run(run_id, reason="operator says stop")
        assert not await ops.cancel_run(run_id)  # already ended: no second cancel
        with trio.fail_after(60):
            await seen.cancelled.wait()
        # the memory broker wakes the worker's control loop at the push: the step is cancelled
        # at the very virtual instant of the operator's cancel
        assert seen.cancelled_at == cancelled_at
        record = await engine.get(run_id)
        assert record.status is dt.RunStatus.CANCELLED
        assert record.error == {"type": "RunCancelled", "message": "operator says stop"}
        assert (await ops.show_run(run_id)).run.status is dt.RunStatus.CANCELLED


async def test_cli_runs_cancel_cancels_the_running_step_on_sqlite(tmp_path: Path) -> None:
    """SQLite's broker runs on the wall clock (see test_sqlite.py): real, bounded time, and the
    cancel goes through ``durable-trio runs cancel`` in a thread of its own (its own
    ``trio.run`` and its own connection to the file), as an operator's shell would."""
    seen = _Seen()
    app = _app(seen)
    url = f"sqlite:///{tmp_path / 'ops.db'}"
    async with (
        dt.open_backend(url) as backend,
        dt.open_worker(app, backend, poll_interval=0.02, idle_backoff_max=1),
        dt.open_engine(app, backend) as engine,
    ):
        run_id = await engine.start("order", 1)
        with trio.fail_after(10):
            await seen.started.wait()
        argv = ["runs", "cancel", run_id, "--backend", url, "--namespace", "shop"]
        assert await trio.to_thread.run_sync(main, argv) == 0
        with trio.fail_after(10):
            await seen.cancelled.wait()
        record = await engine.get(run_id)
        assert record.status is dt.RunStatus.CANCELLED
        assert record.error == {"type": "RunCancelled", "message": "cancelled by an operator"}
