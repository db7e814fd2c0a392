"""An engine closing just after it claimed a run releases that run too (the lease handback).

A detached start rings the engine's reconcile, which claims the run (a write the store makes:
owner, a 30 s lease) and then starts its driver. The close released the runs its drivers held;
one it had claimed and not yet driven stayed owned until its lease lapsed, so the next engine
took it over 30 s late (seen on SQLite in 9 closes of 12). Now the claim is shielded, the runs
it claimed are listed until each is driven or settled, and the close releases them too.

SQLite on a real file, at exact virtual times (``store_clock``, tests/_every_store.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio
import trio.testing

from _every_store import open_store
from durable_trio._engine import App, RunStatus, WorkflowContext, open_engine, open_worker

if TYPE_CHECKING:
    from pathlib import Path


_QUIET: dict[str, Any] = {
    "reconcile_interval": None, "watch_interval": None, "audit_interval": None,
}  # fmt: skip


def _app() -> App:
    app = App("claims")

    @app.workflow("listener")
    async def listener(ctx: WorkflowContext, n: int) -> Any:
        return [n, await ctx.wait_signal("go")]

    return app


async def test_a_run_claimed_just_before_the_close_is_released(
    tmp_path: Path, store_clock: trio.testing.MockClock
) -> None:
    app = _app()
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    async with open_store(url, app.name) as (backend, store):
        for n in range(12):
            async with open_worker(app, backend), open_engine(
                app, backend, store=store, **_QUIET
            ) as engine:  # fmt: skip
                await engine.start("listener", n, run_id=f"r{n}", detach=True)
                # (one more write, during which the reconcile claims the run, and the close
                # comes before its driver starts: the window, most times)
                await engine.signal(f"r{n}", "early", n)
            run = await store.get_run(f"r{n}")
            assert run is not None
            assert (run.status, run.owner) == (RunStatus.PENDING, None), (n, run)
        # The next engine takes them all at once, not once their leases lapse.
        async with open_worker(app, backend), open_engine(
            app, backend, store=store, reconcile_interval=None
        ) as engine:  # fmt: skip
            start = trio.current_time()
            for n in range(12):
                await engine.signal(f"r{n}", "go", n)
            with trio.fail_after(60):
                assert [await engine.result(f"r{n}") for n in range(12)] == [
                    [n, n] for n in range(12)
                ]
            assert trio.current_time() - start < 5
