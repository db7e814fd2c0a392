"""Blocked runs (issue 18, item 5): a changed workflow shape parks the run ``blocked`` with the
diff of expected vs found; code that replays it, deployed in a new engine, resumes it on its
own; ``runs retry`` retries it. Memory at exact virtual times, a real SQLite file and a private
Redis; local and remote workflows."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio._engine import App, RunStatus, WorkflowContext, open_engine, open_worker
from durable_trio._engine._versioning import BLOCKED_PROBE
from helpers import wait_status

if TYPE_CHECKING:
    from pathlib import Path


def make_app(version: str, pause: float, *, remote: bool = False) -> App:
    """``old``: double, sleep, double. ``broken``: triple first, with no ``patched`` (another
    shape). ``fixed``: the triple behind ``ctx.patched``, so old histories replay."""
    app = App("blk")

    @app.step("double")
    async def double(x: int) -> int:
        return x * 2

    @app.step("triple")
    async def triple(x: int) -> int:
        return x * 3

    if version == "old":

        @app.workflow("flow", remote=remote)
        async def old(ctx: WorkflowContext, x: int) -> list[int]:
            a = await ctx.step("double", x)
            await ctx.sleep(pause)
            return [a, await ctx.step("double", a)]

    elif version == "broken":

        @app.workflow("flow", remote=remote)
        async def broken(ctx: WorkflowContext, x: int) -> list[int]:
            a = await ctx.step("triple", x)
            await ctx.sleep(pause)
            return [a, await ctx.step("triple", a)]

    else:

        @app.workflow("flow", remote=remote)
        async def fixed(ctx: WorkflowContext, x: int) -> list[int]:
            new = ctx.patched("triple")
            a = await ctx.step("triple" if new else "double", x)
            await ctx.sleep(pause)
            return [a, await ctx.step("triple" if new else "double", a)]

    return app


def declared() -> App:
    app = App("blk")
    app.remote_workflow("flow")
    return app


async def open_side(
    stack: AsyncExitStack, backend: dt.Backend, app: App, *, remote: bool
) -> dt.Engine:
    await stack.enter_async_context(open_worker(app, backend))
    return await stack.enter_async_context(open_engine(declared() if remote else app, backend))


async def scenario(url: str, *, pause: float, remote: bool) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    async with dt.open_backend(url) as backend:
        async with AsyncExitStack() as stack:
            old = make_app("old", pause, remote=remote)
            engine = await open_side(stack, backend, old, remote=remote)
            await engine.start("flow", 1, run_id="r")
            await trio.sleep(pause / 2)  # step 1 done, mid-sleep
        async with AsyncExitStack() as stack:
            engine = await open_side(
                stack, backend, make_app("broken", pause, remote=remote), remote=remote
            )
            record = await wait_status(engine, "r", RunStatus.BLOCKED)
            seen["blocked_at"] = record.updated_at
            seen["error"] = record.error
            assert [r.status for r in await engine.list(status="blocked")] == [RunStatus.BLOCKED]
            assert (await engine.store.count_runs()).get(RunStatus.BLOCKED) == 1
            # runs retry with the same code: replayed, parked again (same diff).
            reopened = await engine.retry("r")
            assert reopened.status is RunStatus.PENDING
            again = await wait_status(engine, "r", RunStatus.BLOCKED)
            seen["again"] = again.error["expected"], again.error["found"]
            seen["stats"] = engine.statistics()
        async with AsyncExitStack() as stack:
            engine = await open_side(
                stack, backend, make_app("fixed", pause, remote=remote), remote=remote
            )
            seen["fixed_open"] = trio.current_time()
            seen["output"] = await engine.result("r")
            seen["done_at"] = (await engine.get("r")).updated_at
            seen["unblocked"] = engine.statistics().runs_unblocked
            await engine.start("flow", 1, run_id="n")
            seen["new"] = await engine.result("n")
    return seen


def check(seen: dict[str, Any]) -> None:
    error = seen["error"]
    assert error["type"] == "NonDeterminismError"
    assert (error["stepId"], error["expected"], error["found"]) == (
        "1",
        "ctx.step('double')",
        "ctx.step('triple')",
    )
    assert isinstance(error["fingerprint"], str)
    assert seen["again"] == ("ctx.step('double')", "ctx.step('triple')")
    assert seen["stats"].runs_blocked >= 1 or seen["stats"].nondeterminism_failures >= 1
    assert seen["output"] == [2, 4]  # the old history replayed on fixed code: patched False
    assert seen["new"] == [3, 9]  # a new run takes the new branch
    assert seen["unblocked"] == 1


async def test_blocked_then_fixed_code_resumes_it_local_memory(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen = await scenario("memory://", pause=10.0, remote=False)
    check(seen)
    assert seen["blocked_at"] == 5.0  # at once when the broken engine replays it
    assert seen["done_at"] == 10.0  # its timer (checkpointed at 0 for 10 s) wakes it


async def test_blocked_remote_run_is_probed_after_blocked_probe(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Remote workflows: the engine holds no code to fingerprint; a blocked remote run is
    probed with one turn once it has been blocked BLOCKED_PROBE seconds (at a reconcile)."""
    seen = await scenario("memory://", pause=10.0, remote=True)
    check(seen)
    assert seen["blocked_at"] == 5.0
    reconcile = 5.0  # the default reconcile_interval
    assert seen["blocked_at"] + BLOCKED_PROBE <= seen["done_at"]
    assert seen["done_at"] <= seen["blocked_at"] + BLOCKED_PROBE + reconcile


@pytest.fixture(params=["sqlite", "redis", pytest.param("postgres", marks=pytest.mark.postgres)])
def real_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return "sqlite:///" + str(tmp_path / "blk.db")
    if request.param == "postgres":
        return str(request.getfixturevalue("postgres_schema_url"))
    return str(request.getfixturevalue("redis_url"))


async def test_blocked_then_fixed_code_resumes_it_on_the_real_stores(real_url: str) -> None:
    """Real time here (real I/O): local workflows, whose fix is seen by fingerprint."""
    with trio.fail_after(30):
        check(await scenario(real_url, pause=0.4, remote=False))


def test_runs_show_and_list_show_a_blocked_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI: ``runs list --status blocked`` lists it, ``runs show`` prints the diff,
    ``runs retry`` reopens it."""
    from durable_trio.cli._main import main

    url = "sqlite:///" + str(tmp_path / "cli.db")

    async def park() -> None:
        async with dt.open_backend(url) as backend:
            async with AsyncExitStack() as stack:
                engine = await open_side(stack, backend, make_app("old", 60.0), remote=False)
                await engine.start("flow", 1, run_id="r")
                await trio.sleep(0.3)
            async with AsyncExitStack() as stack:
                broken = make_app("broken", 60.0)
                engine = await open_side(stack, backend, broken, remote=False)
                with trio.fail_after(20):
                    await wait_status(engine, "r", RunStatus.BLOCKED)

    trio.run(park)
    common = ["--backend", url, "--namespace", "blk"]
    assert main(["runs", "list", "--status", "blocked", *common]) == 0
    assert "blocked" in capsys.readouterr().out
    assert main(["runs", "show", "r", *common]) == 0
    out = capsys.readouterr().out
    assert "status blocked" in out
    assert (
        "blocked at step 1: history holds ctx.step('double'), the code called ctx.step('triple')"
        in out
    )
    assert main(["runs", "retry", "r", *common]) == 0
    assert "reopened (pending)" in capsys.readouterr().out
