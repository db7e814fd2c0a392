"""Signals with real processes: the engine is SIGKILLed while its run waits on a signal; a new
engine, and a signal sent by the CLI from another process, complete it (SQLite and Redis)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from durable_trio._engine import App, StepKind, WorkflowContext, open_run_store
from helpers import has_steps, poll_until, short_lease_engine, sqlite_url

if TYPE_CHECKING:
    from pathlib import Path


NAMESPACE = "signals-crash"
RUN_ID = "approval-1"

app = App("signals-crash")


@app.workflow("approval")
async def approval(ctx: WorkflowContext, _: Any) -> list[Any]:
    first = await ctx.wait_signal("approve")
    await ctx.set_event("stage", "first approved")
    second = await ctx.wait_signal("approve")
    return [first, second]


async def engine_process(url: str, engine_id: str, start: bool) -> None:
    async with short_lease_engine(app, url, namespace=NAMESPACE, engine_id=engine_id) as engine:
        if start:
            await engine.start("approval", None, run_id=RUN_ID)
        print(json.dumps({"output": await engine.result(RUN_ID)}), flush=True)


def command(url: str, engine_id: str, start: bool) -> list[str]:
    return [sys.executable, __file__, url, engine_id, "1" if start else "0"]


async def cli_signal(url: str, payload: Any) -> str:
    done = await trio.run_process(
        [sys.executable, "-m", "durable_trio", "runs", "signal", RUN_ID, "approve",
         json.dumps(payload), "--namespace", NAMESPACE],
        env={**os.environ, "DURABLE_TRIO_BACKEND": url},
        capture_stdout=True,
    )  # fmt: skip
    return done.stdout.decode()


async def crash_while_waiting(url: str) -> None:
    async with dt.open_backend(url) as backend, open_run_store(backend, NAMESPACE) as store:
        first = await trio.lowlevel.open_process(command(url, "A", True), stdout=subprocess.DEVNULL)
        with trio.fail_after(30):
            # The run waits on its first signal.
            await poll_until(lambda: has_steps(store, RUN_ID, 1))
            assert "#1" in await cli_signal(url, "yes")
            # Consumed, event set, waits again.
            await poll_until(lambda: has_steps(store, RUN_ID, 3))
        first.kill()  # SIGKILL while the run waits on its second signal
        await first.wait()
        second = await trio.lowlevel.open_process(command(url, "B", False), stdout=subprocess.PIPE)
        assert "#2" in await cli_signal(url, {"by": "bob"})
        with trio.fail_after(60):
            await second.wait()
        assert second.stdout is not None
        out = await second.stdout.receive_some()
        assert json.loads(out.decode().strip().splitlines()[-1]) == {
            "output": ["yes", {"by": "bob"}]
        }
        steps = await store.get_steps(RUN_ID)
        assert [(s.kind, s.output) for s in steps if s.kind is StepKind.SIGNAL] == [
            (StepKind.SIGNAL, "yes"),
            (StepKind.SIGNAL, {"by": "bob"}),
        ]


@pytest.mark.chaos
async def test_engine_killed_mid_wait_on_sqlite(tmp_path: Path) -> None:
    await crash_while_waiting(sqlite_url(tmp_path / "runs.db"))


@pytest.mark.chaos
@pytest.mark.redis
async def test_engine_killed_mid_wait_on_redis(redis_url: str) -> None:
    await crash_while_waiting(redis_url)


@pytest.mark.chaos
@pytest.mark.postgres
async def test_engine_killed_mid_wait_on_postgres(postgres_schema_url: str) -> None:
    await crash_while_waiting(postgres_schema_url)


if __name__ == "__main__":
    trio.run(engine_process, sys.argv[1], sys.argv[2], sys.argv[3] == "1")
