"""The engine closes as a tree (``_engine/_tree.py``): ``aclose`` asks for the close and waits
for it, from wherever it is called; a driver that asks does not wait for itself."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio._engine import App, Engine, RunStatus, WorkflowContext, open_engine


def napping_app() -> App:
    app = App("tree")

    @app.workflow("nap")
    async def nap(ctx: WorkflowContext, _: Any) -> None:
        await ctx.sleep(1000)

    return app


async def test_every_aclose_returns_once_the_close_is_over(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two tasks closing the engine at once both wait for the whole close: neither returns
    while the run is still owned here."""
    seen: list[tuple[str, RunStatus, str | None]] = []
    async with dt.open_backend("memory://") as backend:
        async with open_engine(napping_app(), backend, engine_id="e") as engine:
            await engine.start("nap", run_id="n")
            await trio.sleep(1)

            async def close(name: str) -> None:
                await engine.aclose()
                record = await engine.get("n")
                seen.append((name, record.status, record.owner))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(close, "first")
                nursery.start_soon(close, "second")
    assert sorted(seen) == [
        ("first", RunStatus.PENDING, None),
        ("second", RunStatus.PENDING, None),
    ]


async def test_aclose_from_a_workflow_asks_and_does_not_wait_for_itself(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A driver that closes its own engine does not wait for the close (which waits for it):
    the close cancels it and releases its run at once, not after ``cleanup_timeout``."""
    app = App("tree")
    engines: list[Engine] = []

    @app.workflow("closer")
    async def closer(ctx: WorkflowContext, _: Any) -> None:
        await ctx.sleep(5)
        await engines[0].aclose()
        await ctx.sleep(1000)

    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend, engine_id="e", cleanup_timeout=3.0) as engine:
            engines.append(engine)
            await engine.start("closer", run_id="c")
            with pytest.raises(dt.EngineClosed, match="closed before run"):
                await engine.result("c")
            assert trio.current_time() == 5.0
        record = await engine.get("c")
    assert (record.status, record.owner) == (RunStatus.PENDING, None)
