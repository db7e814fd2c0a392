"""Versioning (issue 18, item 5): ``ctx.patched`` / ``ctx.deprecate_patch``. An old history
(recorded by code without the patch) replays to completion on new code with ``patched`` False,
a new run takes the True branch, on memory (exact virtual time), a real SQLite file, a
private Redis and a private PostgreSQL; the same for remote workflows."""

from __future__ import annotations

from contextlib import AsyncExitStack
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from _every_store import open_store
from durable_trio._engine import App, StepKind, WorkflowContext, open_engine, open_worker

if TYPE_CHECKING:
    from pathlib import Path

PAUSE = 10.0
_pause = PAUSE  # the workflow's sleep in the current scenario


def steps(app: App) -> None:
    @app.step("double")
    async def double(x: int) -> int:
        return x * 2

    @app.step("triple")
    async def triple(x: int) -> int:
        return x * 3


def old_app(*, remote: bool = False) -> App:
    """The code before the change: double twice, then wait."""
    app = App("ver")
    steps(app)

    @app.workflow("calc", remote=remote)
    async def calc(ctx: WorkflowContext, x: int) -> list[Any]:
        a = await ctx.step("double", x)
        b = await ctx.step("double", a)
        await ctx.sleep(_pause)
        return [a, b]

    return app


def new_app(mode: str = "patched", *, remote: bool = False) -> App:
    """The changed code: the second step triples, behind ``patched("triple")`` (``mode``
    ``"patched"``), or for every run once old runs are gone (``"deprecated"``)."""
    app = App("ver")
    steps(app)

    @app.workflow("calc", remote=remote)
    async def calc(ctx: WorkflowContext, x: int) -> list[Any]:
        a = await ctx.step("double", x)
        if mode == "deprecated":
            ctx.deprecate_patch("triple")
            b = await ctx.step("triple", a)
            flag: Any = "deprecated"
        elif ctx.patched("triple"):
            b = await ctx.step("triple", a)
            flag = True
        else:
            b = await ctx.step("double", a)
            flag = False
        await ctx.sleep(_pause)
        return [a, b, flag]

    return app


def engine_side(remote: bool) -> App:
    """Remote workflows: the engine's app declares the workflow without its code."""
    app = App("ver")
    app.remote_workflow("calc")
    return app


async def _phase(
    backend: dt.Backend, app: App, *, remote: bool, action: Any, store: Any = None
) -> Any:
    """Open a worker serving ``app`` and an engine (for a remote workflow: the engine declares
    it, the worker runs it), run ``action(engine)``, close both."""
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(open_worker(app, backend))
        engine = await stack.enter_async_context(
            open_engine(engine_side(remote) if remote else app, backend, store=store)
        )
        return await action(engine)


async def scenario(
    url: str, *, remote: bool = False, virtual: bool = True, pause: float = PAUSE
) -> dict[str, Any]:
    """Old run recorded by old code up to its sleep; then new code finishes it and runs a new
    one; then deprecated code replays both kinds of history (``virtual``: the run store on
    trio's clock, tests/_every_store.py)."""
    found: dict[str, Any] = {}
    global _pause
    _pause = pause
    async with AsyncExitStack() as opened:
        if virtual:
            backend, store = await opened.enter_async_context(open_store(url, "ver"))
        else:
            backend = await opened.enter_async_context(dt.open_backend(url))
            store = None
        phase = partial(_phase, store=store)

        async def begin_old(engine: dt.Engine) -> None:
            await engine.start("calc", 1, run_id="old")
            await trio.sleep(pause / 2)  # both steps done, mid-sleep
            # (On a real clock a loaded machine may not be there yet, as below: seen in CI, a
            # local workflow on PostgreSQL; look until it is, well inside the sleep.)
            while not any(r.kind is StepKind.TIMER for r in await engine.history("old")):  # noqa: ASYNC110 (a store read: nothing to wait on)
                await trio.sleep(pause / 100)
            assert [r.step_id for r in await engine.history("old")] == ["1", "2", "3"]

        await phase(backend, old_app(remote=remote), remote=remote, action=begin_old)
        start = trio.current_time()

        async def finish(engine: dt.Engine) -> None:
            found["old"] = await engine.result("old")
            if virtual:
                found["old_at"] = trio.current_time() - start
            await engine.start("calc", 5, run_id="new")
            await trio.sleep(pause / 2)
            # On a real clock a loaded machine may not have reached the sleep yet (seen in CI:
            # a remote workflow on PostgreSQL, 4 test workers on 2 cores): look until it has.
            while not any(r.kind is StepKind.TIMER for r in await engine.history("new")):  # noqa: ASYNC110 (a store read: nothing to wait on)
                await trio.sleep(pause / 100)
            found["new_history"] = [
                (r.step_id, r.kind, r.name) for r in await engine.history("new")
            ]

        await phase(backend, new_app(remote=remote), remote=remote, action=finish)

        async def deprecated(engine: dt.Engine) -> None:
            found["new"] = await engine.result("new")
            await engine.start("calc", 7, run_id="later")
            found["later"] = await engine.result("later")

        await phase(backend, new_app("deprecated", remote=remote), remote=remote, action=deprecated)
    return found


def check(found: dict[str, Any]) -> None:
    assert found["old"] == [2, 4, False]  # old history: patched() False, double again
    # The marker sits outside the numbering: the steps keep ids 1, 2, 3.
    assert sorted(found["new_history"]) == [
        ("1", StepKind.REMOTE, "double"),
        ("2", StepKind.REMOTE, "triple"),
        ("3", StepKind.TIMER, "sleep"),
        ("patch:triple", StepKind.PATCH, "triple"),
    ]
    # The new run replays under deprecate_patch (its marker is ignored) and a run started
    # there records no marker.
    assert found["new"] == [10, 30, "deprecated"]
    assert found["later"] == [14, 42, "deprecated"]


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
async def test_patched_on_memory_at_exact_times(
    autojump_clock: trio.testing.MockClock, remote: bool
) -> None:
    found = await scenario("memory://", remote=remote)
    check(found)
    # The old run's sleep was checkpointed at 5 s before the restart: it wakes 5 s after it.
    assert found["old_at"] == PAUSE / 2


@pytest.fixture(params=["sqlite", "redis", pytest.param("postgres", marks=pytest.mark.postgres)])
def real_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return "sqlite:///" + str(tmp_path / "ver.db")
    if request.param == "postgres":
        return str(request.getfixturevalue("postgres_schema_url"))
    return str(request.getfixturevalue("redis_url"))


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
async def test_patched_at_exact_times_on_the_real_stores(
    real_url: str, remote: bool, store_clock: trio.testing.MockClock
) -> None:
    """The store on trio's clock (tests/_every_store.py): the same exact times as memory."""
    found = await scenario(real_url, remote=remote)
    check(found)
    assert found["old_at"] == PAUSE / 2


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
async def test_patched_on_the_real_stores(real_url: str, remote: bool) -> None:
    """Real time here (real I/O): the pause is short."""
    with trio.fail_after(30):
        check(await scenario(real_url, remote=remote, virtual=False, pause=0.4))
