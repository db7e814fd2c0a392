"""Cancellation with real processes (issue 18): the operator's cancel (`durable-trio runs
cancel`, from a process of its own) reaches the engine driving the run, whose workflow
compensates; the engine is SIGKILLed in the middle of the compensation, and the engine that
takes the run over settles it cancelled without running the compensation again (it runs at
most once). SQLite and Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from durable_trio._engine import App, RunStatus, WorkflowContext, open_run_store
from helpers import short_lease_engine, sqlite_url

if TYPE_CHECKING:
    from pathlib import Path

NAMESPACE = "cancel-crash"
RUN_ID = "saga-1"

app = App("cancel-crash")


def _note(line: str) -> None:
    with open(os.environ["CANCEL_CRASH_NOTES"], "a") as notes:
        notes.write(line + "\n")


@app.step("book")
async def book(_: Any) -> str:
    _note("book")
    return "booked"


@app.step("release")
async def release(_: Any) -> None:
    _note("release")
    await trio.sleep(3600)  # the engine is killed here


@app.workflow("saga")
async def saga(ctx: WorkflowContext, _: Any) -> str:
    await ctx.step("book", None)
    try:
        await ctx.sleep(3600)
    except dt.RunCancelled:
        await ctx.step("release", None)
        raise
    return "done"


async def engine_process(url: str, engine_id: str, start: bool) -> None:
    async with short_lease_engine(
        app, url, namespace=NAMESPACE, engine_id=engine_id, worker=True
    ) as engine:
        if start:
            await engine.start("saga", None, run_id=RUN_ID)
        try:
            await engine.result(RUN_ID)
        except dt.RunCancelled as exc:
            print(json.dumps({"cancelled": str(exc)}), flush=True)


def command(url: str, engine_id: str, start: bool, notes: Path) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "CANCEL_CRASH_NOTES": str(notes)}
    return [sys.executable, __file__, url, engine_id, "1" if start else "0"], env


def lines(notes: Path) -> list[str]:
    return notes.read_text().split() if notes.exists() else []


async def until_noted(notes: Path, line: str) -> None:
    while line not in lines(notes):  # noqa: ASYNC110 - another process writes the file
        await trio.sleep(0.05)


async def kill_mid_compensation(url: str, notes: Path) -> None:
    async with dt.open_backend(url) as backend, open_run_store(backend, NAMESPACE) as store:
        argv, env = command(url, "A", True, notes)
        first = await trio.lowlevel.open_process(argv, env=env, stdout=subprocess.DEVNULL)
        try:
            with trio.fail_after(30):
                await until_noted(notes, "book")
                while len(await store.get_steps(RUN_ID)) < 2:  # noqa: ASYNC110 - booked, slept
                    await trio.sleep(0.05)
                cancel = await trio.run_process(
                    [sys.executable, "-m", "durable_trio", "runs", "cancel", RUN_ID,
                     "--no-wait", "--reason", "customer left", "--namespace", NAMESPACE],
                    env={**os.environ, "DURABLE_TRIO_BACKEND": url},
                    capture_stdout=True,
                )  # fmt: skip
                assert b"cancel sent to the engine driving it" in cancel.stdout
                await until_noted(notes, "release")  # RunCancelled raised, compensating
        finally:
            first.kill()  # SIGKILL in the middle of the compensation
            await first.wait()
        run = await store.get_run(RUN_ID)
        assert run is not None
        assert run.status is RunStatus.RUNNING
        argv, env = command(url, "B", False, notes)
        second = await trio.lowlevel.open_process(argv, env=env, stdout=subprocess.PIPE)
        with trio.fail_after(60):
            await second.wait()
        assert second.stdout is not None
        out = (await second.stdout.receive_some()).decode().strip().splitlines()
        assert "customer left" in json.loads(out[-1])["cancelled"]
        run = await store.get_run(RUN_ID)
        assert run is not None
        assert run.status is RunStatus.CANCELLED
        assert run.error is not None
        assert run.error["message"] == "customer left"
        # B settled it from the mark in its history: the compensation ran once, in A only.
        assert lines(notes) == ["book", "release"]


@pytest.mark.chaos
async def test_engine_killed_mid_compensation_on_sqlite(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "runs.db")
    await kill_mid_compensation(url, tmp_path / "notes")


@pytest.mark.chaos
@pytest.mark.redis
async def test_engine_killed_mid_compensation_on_redis(redis_url: str, tmp_path: Path) -> None:
    await kill_mid_compensation(redis_url, tmp_path / "notes")


@pytest.mark.chaos
@pytest.mark.postgres
async def test_engine_killed_mid_compensation_on_postgres(
    postgres_schema_url: str, tmp_path: Path
) -> None:
    await kill_mid_compensation(postgres_schema_url, tmp_path / "notes")


if __name__ == "__main__":
    trio.run(engine_process, sys.argv[1], sys.argv[2], sys.argv[3] == "1")
