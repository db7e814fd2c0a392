"""Streaming with real processes: the engine is SIGKILLed after its run emitted, while it waits
on a signal; a new engine replays the run (appending nothing again) and ends it, and a reader
in this process reads the whole stream, each value once (SQLite, Redis, PostgreSQL)."""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from durable_trio._engine import App, WorkflowContext, open_run_store
from durable_trio._engine._stream import STREAM_LOG, read_stream
from helpers import has_steps, poll_until, short_lease_engine, sqlite_url

if TYPE_CHECKING:
    from pathlib import Path

NAMESPACE = "stream-crash"
RUN_ID = "report-1"

app = App("stream-crash")


@app.workflow("report")
async def report(ctx: WorkflowContext, _: Any) -> str:
    await ctx.emit("before the crash")
    await ctx.wait_signal("go")
    await ctx.emit("after the crash")
    return "done"


async def engine_process(url: str, engine_id: str, start: bool) -> None:
    async with short_lease_engine(app, url, namespace=NAMESPACE, engine_id=engine_id) as engine:
        if start:
            await engine.start("report", None, run_id=RUN_ID)
        await engine.result(RUN_ID)


def command(url: str, engine_id: str, start: bool) -> list[str]:
    return [sys.executable, __file__, url, engine_id, "1" if start else "0"]


async def crash_after_emitting(url: str) -> None:
    async with dt.open_backend(url) as backend, open_run_store(backend, NAMESPACE) as store:
        first = await trio.lowlevel.open_process(command(url, "A", True), stdout=subprocess.DEVNULL)
        with trio.fail_after(30):  # the other process's checkpoints: emitted, waits on a signal
            await poll_until(lambda: has_steps(store, RUN_ID, 2))
        first.kill()  # SIGKILL
        await first.wait()
        assert await store.read_signal(RUN_ID, STREAM_LOG, 1) is not None  # kept
        second = await trio.lowlevel.open_process(command(url, "B", False))
        assert await store.append_signal(RUN_ID, "go", "true") == 1
        with trio.fail_after(60):
            got = [(e.seq, e.value) async for e in read_stream(store, RUN_ID)]
            await second.wait()
        assert second.returncode == 0
    # The replay did not append the first value again: the second is the log's second entry.
    assert got == [(1, "before the crash"), (2, "after the crash")]


@pytest.mark.chaos
async def test_engine_killed_after_an_emit_on_sqlite(tmp_path: Path) -> None:
    await crash_after_emitting(sqlite_url(tmp_path / "runs.db"))


@pytest.mark.chaos
@pytest.mark.redis
async def test_engine_killed_after_an_emit_on_redis(redis_url: str) -> None:
    await crash_after_emitting(redis_url)


@pytest.mark.chaos
@pytest.mark.postgres
async def test_engine_killed_after_an_emit_on_postgres(postgres_schema_url: str) -> None:
    await crash_after_emitting(postgres_schema_url)


if __name__ == "__main__":
    trio.run(engine_process, sys.argv[1], sys.argv[2], sys.argv[3] == "1")
