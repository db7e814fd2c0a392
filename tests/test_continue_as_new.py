"""Continue-as-new (issue 34, item 5): ``ctx.continue_as_new(input)`` ends a run's generation
and starts the next one under the same run id, on every run store at exact virtual times
(tests/_every_store.py): the histories chain without gap, each bounded; signals not consumed
carry over; an old generation's step ids are never reused (a late result finds nothing);
retention deletes the previous generations with the run."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from _every_store import open_store
from durable_trio._engine import App, WorkflowContext, open_engine, open_worker
from durable_trio._engine._generations import CONTINUE_STEP_ID, continuation_of
from durable_trio._engine._records import Applied, StepKind, StepState
from durable_trio._engine._stores._generations import generations_of
from durable_trio.cli import main

if TYPE_CHECKING:
    from pathlib import Path

_QUIET: dict[str, Any] = {
    "reconcile_interval": None, "watch_interval": None, "audit_interval": None,
}  # fmt: skip


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
            try:
                ctx.continue_as_new({"n": state["n"] + 1, "total": state["total"] + doubled})
            except Exception:  # never: a BaseException
                raise AssertionError("swallowed") from None
        return {"n": state["n"], "total": state["total"] + doubled, "generation": ctx.generation}

    @app.workflow("inbox")
    async def inbox(ctx: WorkflowContext, seen: list[Any]) -> list[Any]:
        seen = [*seen, await ctx.wait_signal("item")]
        if len(seen) < 3:
            ctx.continue_as_new(seen)
        return seen

    return app


async def test_a_loop_continues_in_bounded_histories_that_chain_without_gap(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = _app()
    async with open_store(every_store, app.name) as (backend, store):
        async with open_worker(app, backend), open_engine(
            app, backend, store=store, engine_id="e", **_QUIET
        ) as engine:  # fmt: skip
            start = trio.current_time()
            run_id = await engine.start("counter", {"n": 0, "total": 0}, run_id="loop")
            assert await engine.result(run_id) == {"n": 4, "total": 20, "generation": 4}
            assert trio.current_time() == start + 50  # five generations of 10 s each
            run = await store.get_run(run_id)
            assert run is not None
            assert run.status is dt.RunStatus.COMPLETED
            assert run.input == {"n": 4, "total": 12}  # the last generation's
            generations = generations_of(store)
            assert await generations.list_generations(run_id) == [0, 1, 2, 3]
            last_step = 0
            for g in range(5):
                steps = (
                    await generations.get_generation(run_id, g)
                    if g < 4
                    else await store.get_steps(run_id)
                )
                assert steps is not None
                mark = next(s for s in steps if s.step_id == CONTINUE_STEP_ID)
                start_of = continuation_of(mark)
                # Chained without gap: each generation numbers on from the one before it.
                assert (start_of.generation, start_of.last_step) == (g, last_step)
                assert start_of.input == {"n": g, "total": g * (g - 1)}
                numbered = [s for s in steps if s.step_id != CONTINUE_STEP_ID]
                assert [s.step_id for s in numbered] == [str(last_step + 1), str(last_step + 2)]
                assert [s.kind for s in numbered] == [StepKind.REMOTE, StepKind.TIMER]
                assert all(s.status is StepState.COMPLETED for s in numbered)
                last_step += 2
            assert await generations.get_generation(run_id, 4) is None
            # An old generation's step is not the run's any more: a late result finds nothing.
            old = (await generations.get_generation(run_id, 0) or [])[1]
            assert await store.get_step(run_id, old.step_id) is None
            assert await store.update_step(old, expect_attempt=1) in (
                Applied.MISSING,
                Applied.RUN_FINISHED,
            )


async def test_signals_not_consumed_carry_over_to_the_next_generation(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = _app()
    async with open_store(every_store, app.name) as (backend, store):
        async with open_engine(app, backend, store=store, engine_id="e", **_QUIET) as engine:
            run_id = await engine.start("inbox", [], run_id="inbox")
            for item in ("a", "b", "c", "d"):
                await engine.signal(run_id, "item", item)
            assert await engine.result(run_id) == ["a", "b", "c"]
            assert await generations_of(store).list_generations(run_id) == [0, 1]
            mark = await store.get_step(run_id, CONTINUE_STEP_ID)
            assert mark is not None
            assert continuation_of(mark).signals == {"item": 2}


async def test_retention_deletes_the_previous_generations_with_the_run(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = _app()
    async with open_store(every_store, app.name) as (backend, store):
        async with open_worker(app, backend), open_engine(
            app, backend, store=store, engine_id="e", retention=20, retention_interval=4,
            **_QUIET,
        ) as engine:  # fmt: skip
            run_id = await engine.start("counter", {"n": 2, "total": 0}, run_id="short")
            await engine.result(run_id)
            generations = generations_of(store)
            assert await generations.list_generations(run_id) == [0, 1]
            await trio.sleep(25)
            assert await store.get_run(run_id) is None
            assert await generations.list_generations(run_id) == []
            assert await generations.get_generation(run_id, 0) is None


@pytest.mark.parametrize("bad", [float("nan"), {1, 2}])
async def test_a_continued_input_must_be_json(
    autojump_clock: trio.testing.MockClock, bad: Any
) -> None:
    app = App("bad")

    @app.workflow("w")
    async def w(ctx: WorkflowContext, n: Any) -> Any:
        ctx.continue_as_new(bad)

    async with dt.open_backend("memory://") as backend, open_engine(app, backend) as engine:
        run_id = await engine.start("w", 1)
        with pytest.raises(dt.RunFailed, match="continue_as_new"):
            await engine.result(run_id)


async def test_ops_and_the_cli_show_a_previous_generation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], store_clock: trio.testing.MockClock
) -> None:
    app = _app()
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    async with open_store(url, app.name) as (backend, store):
        async with open_worker(app, backend), open_engine(
            app, backend, store=store, **_QUIET
        ) as engine:  # fmt: skip
            await engine.start("counter", {"n": 2, "total": 0}, run_id="loop")
            await engine.result("loop")
        async with dt.open_operations(backend, namespace=app.name) as ops:
            current = await ops.show_run("loop")
            assert (current.generation, current.previous) == (2, (0, 1))
            assert [s.step_id for s in current.steps] == ["5"]
            first = await ops.show_run("loop", generation=0)
            assert first.generation == 0
            assert first.run.input == {"n": 2, "total": 0}
            assert [s.step_id for s in first.steps] == ["1"]
            assert [t.step_id for t in first.timers] == ["2"]
            with pytest.raises(dt.ConfigError, match="no previous generation 7"):
                await ops.show_run("loop", generation=7)
    common = ["--backend", url, "--namespace", app.name]

    def cli(*argv: str) -> tuple[int, str]:
        status = main(list(argv))
        return status, capsys.readouterr().out

    status, out = await trio.to_thread.run_sync(lambda: cli("runs", "show", "loop", *common))
    assert status == 0
    assert "generation 2  previous 0 1" in out
    status, out = await trio.to_thread.run_sync(
        lambda: cli("runs", "show", "loop", "--generation", "1", "--json", *common)
    )
    assert status == 0
    shown = json.loads(out)
    assert (shown["generation"], shown["previousGenerations"]) == (1, [0, 1])
    assert shown["input"] == {"n": 3, "total": 4}
    status, out = await trio.to_thread.run_sync(
        lambda: cli("runs", "show", "loop", "--generation", "1", *common)
    )
    assert "generation 1 (an earlier one; the run's current is 2)  previous kept 0 1" in out
    assert [s["stepId"] for s in shown["steps"]] == ["3"]


async def test_a_remote_workflow_cannot_continue_as_new_yet(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = App("far")

    @app.workflow("far", remote=True)
    async def far(ctx: WorkflowContext, n: int) -> int:
        ctx.continue_as_new(n + 1)

    async with (
        dt.open_backend("memory://") as backend,
        open_worker(app, backend),
        open_engine(app, backend) as engine,
    ):
        run_id = await engine.start("far", 1)
        with pytest.raises(dt.RunFailed, match="a remote workflow cannot continue as new yet"):
            await engine.result(run_id)


async def test_a_cancelled_run_does_not_continue_as_new(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = App("stubborn")

    @app.workflow("stubborn")
    async def stubborn(ctx: WorkflowContext, n: int) -> int:
        try:
            await ctx.sleep(100)
        except dt.RunCancelled:
            ctx.continue_as_new(n + 1)  # refused: the run ends cancelled
        return n

    async with dt.open_backend("memory://") as backend, open_engine(app, backend) as engine:
        run_id = await engine.start("stubborn", 1)
        await trio.sleep(10)
        await engine.cancel(run_id)
        with pytest.raises(dt.RunCancelled):
            await engine.result(run_id)
        assert await generations_of(engine.store).list_generations(run_id) == []
