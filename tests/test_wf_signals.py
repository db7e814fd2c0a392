"""Signals and events (issue 18 items 1 and 2) on memory, SQLite and a private Redis."""

from __future__ import annotations

import json
import math
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio._engine import App, WorkflowContext, open_engine
from durable_trio._engine._signals import (
    EventTimeout,
    RunNotSignalable,
    SignalDataError,
    SignalTimeout,
)

if TYPE_CHECKING:
    from pathlib import Path

KINDS = ["memory", "sqlite", "redis", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(params=KINDS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    kind = request.param
    if kind == "memory":
        return "memory://"
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'runs.db'}".replace("///", "////", 1)
    if kind == "postgres":
        return str(request.getfixturevalue("postgres_schema_url"))
    return str(request.getfixturevalue("redis_url"))


def approvals() -> App:
    app = App("approvals")

    @app.workflow("approve")
    async def approve(ctx: WorkflowContext, _: Any) -> list[Any]:
        got = [await ctx.wait_signal("ok")]
        await ctx.set_event("progress", 1)
        got.append(await ctx.wait_signal("ok"))
        got.append(await ctx.wait_signal("other"))
        await ctx.set_event("progress", 2)
        return got

    @app.workflow("impatient")
    async def impatient(ctx: WorkflowContext, _: Any) -> list[Any]:
        try:
            await ctx.wait_signal("ok", timeout=5)
        except SignalTimeout:
            timed_out = trio.current_time()
        return [timed_out, await ctx.wait_signal("ok")]

    return app


async def test_wait_then_signal_buffered_order_and_two_names(url: str) -> None:
    app = approvals()
    async with dt.open_backend(url) as backend, open_engine(app, backend) as engine:
        run_id = await engine.start("approve", None)
        await engine.signal(run_id, "other", {"o": 1})  # buffered: before its wait
        assert await engine.signal(run_id, "ok", "first") == 1
        assert await engine.get_event(run_id, "progress", timeout=5) == 1
        state = await engine.status(run_id, events=True)
        assert state == dt.RunState(run_id, dt.RunStatus.RUNNING, {"progress": 1})
        await engine.signal(run_id, "ok", "second")
        assert await engine.result(run_id) == ["first", "second", {"o": 1}]
        assert await engine.events(run_id) == {"progress": 2}
        assert await engine.status(run_id) is dt.RunStatus.COMPLETED
        assert (await engine.status(run_id, events=True)).events == {"progress": 2}
        with pytest.raises(RunNotSignalable):
            await engine.signal(run_id, "ok", 3)
        with pytest.raises(dt.RunNotFound):
            await engine.signal("nope", "ok", 3)


async def test_exact_virtual_times_on_memory(autojump_clock: trio.testing.MockClock) -> None:
    app = approvals()
    async with dt.open_backend("memory://") as backend, open_engine(app, backend) as engine:
        run_id = await engine.start("approve", None)
        await trio.sleep(3)
        await engine.signal(run_id, "ok", 1)
        await trio.sleep(4)
        await engine.signal(run_id, "ok", 2)
        await engine.signal(run_id, "other", 3)
        assert await engine.result(run_id) == [1, 2, 3]
        assert trio.current_time() == 7
        assert [s.updated_at for s in await engine.history(run_id)] == [3, 3, 7, 7, 7]


async def test_timeout_is_caught_and_consumes_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = approvals()
    async with dt.open_backend("memory://") as backend, open_engine(app, backend) as engine:
        run_id = await engine.start("impatient", None)
        await trio.sleep(8)
        await engine.signal(run_id, "ok", "late")
        assert await engine.result(run_id) == [5, "late"]


async def test_replay_after_restart_returns_the_same_payloads(url: str) -> None:
    app = approvals()
    async with dt.open_backend(url) as backend:
        async with open_engine(app, backend) as engine:
            run_id = await engine.start("approve", None)
            await engine.signal(run_id, "ok", "a")
            await engine.signal(run_id, "ok", "b")
            await engine.get_event(run_id, "progress", timeout=5)
            await trio.testing.wait_all_tasks_blocked()
        async with open_engine(app, backend) as engine:
            await engine.signal(run_id, "other", "c")
            assert await engine.result(run_id) == ["a", "b", "c"]
            kinds = [s.kind.value for s in await engine.history(run_id)]
            assert kinds == ["signal", "event", "signal", "signal", "event"]


async def test_bad_payload_and_damaged_signal(autojump_clock: trio.testing.MockClock) -> None:
    app = approvals()
    async with dt.open_backend("memory://") as backend, open_engine(app, backend) as engine:
        run_id = await engine.start("approve", None)
        with pytest.raises(dt.PayloadError):
            await engine.signal(run_id, "ok", {1, 2})
        await engine.store.append_signal(run_id, "ok", "{not json")
        with pytest.raises(dt.RunFailed) as failed:
            await engine.result(run_id)
        assert "damaged" in str(failed.value)
        run = await engine.get(run_id)
        assert run.status is dt.RunStatus.FAILED
        assert run.error["type"] == SignalDataError.__name__
        with pytest.raises(EventTimeout):
            await engine.get_event(run_id, "missing", timeout=2)


async def test_a_get_event_timeout_that_is_no_duration_is_refused_not_waited(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``engine.get_event(..., timeout=nan)`` waited forever (every comparison with NaN is
    false, so the deadline never came) and a negative one was an ``EventTimeout`` "within
    -5 s": both are a ConfigError at once, as ``engine.update``'s timeout is; ``inf`` still
    waits (until the event is set)."""
    app = approvals()
    async with dt.open_backend("memory://") as backend, open_engine(app, backend) as engine:
        run_id = await engine.start("approve", None)
        start = trio.current_time()
        for bad in (math.nan, -5, "10"):
            with pytest.raises(dt.ConfigError, match=r"engine\.get_event: timeout must be"):
                await engine.get_event(run_id, "progress", timeout=bad)  # type: ignore[arg-type]
        assert trio.current_time() == start
        async with trio.open_nursery() as nursery:
            waited = partial(engine.get_event, run_id, "progress", timeout=math.inf)
            nursery.start_soon(waited)
            await trio.sleep(100)
            await engine.signal(run_id, "ok", 1)  # (it sets the event "progress")
        assert await engine.get_event(run_id, "progress", timeout=math.inf) == 1


async def test_a_tenant_pod_signals_its_runs(autojump_clock: trio.testing.MockClock) -> None:
    app = approvals()
    async with dt.open_backend("memory://") as backend:
        pod_backend = dt.Backend(url="memory://pod", broker=backend.broker, keys=None)
        async with (
            open_engine(app, backend, serve_tenants=True) as engine,
            dt.open_tenant_client(pod_backend, "acme", namespace=app.name) as pod,
        ):
            await trio.sleep(1)
            await pod.start("approve", None, run_id="a-1")
            assert await pod.signal("a-1", "ok", "x") == 1
            assert await pod.signal("a-1", "ok", "y") == 2
            await pod.signal("a-1", "other", "z")
            assert await pod.result("a-1") == ["x", "y", "z"]
            assert await pod.events("a-1") == {"progress": 2}
            with pytest.raises(dt.RunNotFound):
                await pod.signal("nope", "ok")
            with pytest.raises(dt.EngineError, match="RunNotSignalable"):
                await pod.signal("a-1", "ok")
            assert await engine.events("acme/a-1") == {"progress": 2}


def remote_apps() -> tuple[App, App]:
    """The workflow worker's app (the code, ``remote=True``) and the engine's (declares it)."""
    worker = App("approvals")

    @worker.workflow("approve", remote=True)
    async def approve(ctx: WorkflowContext, _: Any) -> list[Any]:
        got = [await ctx.wait_signal("ok")]
        await ctx.set_event("progress", 1)
        try:
            await ctx.wait_signal("ok", timeout=2)
            got.append("not timed out")
        except SignalTimeout:
            got.append("timed out")
        got.append(await ctx.wait_signal("ok"))
        await ctx.set_event("progress", 2)
        return got

    engine_app = App("approvals")
    engine_app.remote_workflow("approve")
    return worker, engine_app


async def remote_round(url: str) -> None:
    worker, engine_app = remote_apps()
    async with (
        dt.open_backend(url) as backend,
        dt.open_worker(worker, backend),
        open_engine(engine_app, backend) as engine,
    ):
        run_id = await engine.start("approve", None)
        await engine.signal(run_id, "ok", "first")  # buffered, or wakes the wait
        assert await engine.get_event(run_id, "progress", timeout=30) == 1
        await trio.sleep(3)  # the second wait times out
        await engine.signal(run_id, "ok", "second")
        with trio.fail_after(30):
            assert await engine.result(run_id) == ["first", "timed out", "second"]
        assert await engine.events(run_id) == {"progress": 2}
        kinds = [(s.kind.value, s.status.value) for s in await engine.history(run_id)]
        assert kinds == [
            ("signal", "completed"),
            ("event", "completed"),
            ("signal", "failed"),
            ("signal", "completed"),
            ("event", "completed"),
        ]


async def test_remote_workflow_exact_times_on_memory(
    autojump_clock: trio.testing.MockClock,
) -> None:
    await remote_round("memory://")


async def test_remote_workflow(url: str) -> None:
    if url != "memory://":
        await remote_round(url)


async def test_timeout_damaged_data_and_bad_payload_on_every_store(url: str) -> None:
    """Wall-clock stores too (SQLite file, private Redis): a short timeout is caught and
    consumes nothing; damaged stored data fails the run, inspectable; a bad payload is refused."""
    app = App("approvals")

    @app.workflow("short")
    async def short(ctx: WorkflowContext, _: Any) -> list[Any]:
        try:
            await ctx.wait_signal("ok", timeout=0.2)
            first = "signalled"
        except SignalTimeout:
            first = "timed out"
        return [first, await ctx.wait_signal("ok")]

    @app.workflow("fragile")
    async def fragile(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.wait_signal("ok")

    async with dt.open_backend(url) as backend, open_engine(app, backend) as engine:
        run_id = await engine.start("short", None)
        with trio.fail_after(10):
            while True:  # the first wait's deadline passed, checkpointed
                if [s for s in await engine.history(run_id) if s.status.value == "failed"]:
                    break
                await trio.sleep(0.05)
        assert await engine.signal(run_id, "ok", "after") == 1
        with trio.fail_after(10):
            assert await engine.result(run_id) == ["timed out", "after"]
        broken = await engine.start("fragile", None)
        with pytest.raises(dt.PayloadError):
            await engine.signal(broken, "ok", float("nan"))
        await engine.store.append_signal(broken, "ok", "{damaged")
        with trio.fail_after(10), pytest.raises(dt.RunFailed, match="damaged"):
            await engine.result(broken)
        steps = await engine.history(broken)
        assert [(s.kind.value, s.status.value) for s in steps] == [("signal", "failed")]


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_the_cli_signals_and_shows_events(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from durable_trio.cli._main import main

    url = f"sqlite:///{tmp_path / 'cli.db'}".replace("///", "////", 1)
    if kind == "postgres":
        url = str(request.getfixturevalue("postgres_schema_url"))
    app = approvals()

    def cli(*args: str) -> tuple[int, str]:
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(["runs", *args, "--backend", url, "--namespace", app.name])
        return code, out.getvalue()

    async with dt.open_backend(url) as backend, open_engine(app, backend) as engine:
        run_id = await engine.start("approve", None)
        code, said = await trio.to_thread.run_sync(cli, "signal", run_id, "ok", "{bad")
        assert (code, "PAYLOAD-JSON is not JSON" in said) == (2, True)
        code, said = await trio.to_thread.run_sync(cli, "signal", run_id, "ok", '{"by": "cli"}')
        assert (code, said) == (0, f"signal 'ok' #1 sent to run {run_id}\n")
        assert await engine.get_event(run_id, "progress", timeout=10) == 1
        code, said = await trio.to_thread.run_sync(cli, "show", run_id)
        assert code == 0
        assert "progress" in said
        code, said = await trio.to_thread.run_sync(cli, "show", run_id, "--json")
        assert (code, json.loads(said)["events"]) == (0, {"progress": 1})
        code, said = await trio.to_thread.run_sync(cli, "signal", "nope", "ok")
        assert code != 0
        await engine.cancel(run_id)
        code, said = await trio.to_thread.run_sync(cli, "signal", run_id, "ok", "1")
        assert code != 0
        assert "takes no more signals" in said
