"""Continue-as-new and a crash, with real processes (issue 34, item 5): an engine process is
SIGKILLed between the two halves of a continue-as-new (the old generation's history closed,
the new generation not started: its history is only its mark) and another engine takes the
run over: the new generation runs exactly once, the old one never again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

import durable_trio as dt
from durable_trio._engine import App, WorkflowContext, open_run_store
from durable_trio._engine._generations import CONTINUE_STEP_ID, continuation_of
from durable_trio._engine._stores._generations import generations_of
from helpers import short_lease_engine, sqlite_url

NAMESPACE = "can-chaos"
RUN_ID = "looper-1"
app = App("can-chaos")


def _log(line: str) -> str:
    with Path(os.environ["CAN_LOG"]).open("a") as log:
        log.write(line + "\n")
    return line


@app.workflow("looper")
async def looper(ctx: WorkflowContext, n: int) -> list[Any]:
    pause = os.environ.get("CAN_PAUSE")
    if pause and n == 1:  # the first engine stops here: the new generation not started
        await trio.Path(pause).write_text(str(ctx.generation))
        await trio.sleep_forever()
    await ctx.run("mark", lambda: _log(f"generation {n}"))
    if n < 2:
        ctx.continue_as_new(n + 1)
    return [n, ctx.generation]


async def engine_process(url: str, engine_id: str, start: bool) -> None:
    """The child: an engine with a short run lease, so a killed one's run lapses quickly."""
    async with short_lease_engine(app, url, namespace=NAMESPACE, engine_id=engine_id) as engine:
        if start:
            await engine.start("looper", 0, run_id=RUN_ID)
        output = await engine.result(RUN_ID)
    print(json.dumps({"output": output}))


def command(url: str, engine_id: str, start: bool) -> list[str]:
    return [sys.executable, __file__, url, engine_id, "1" if start else "0"]


async def kill_between_the_halves_and_resume(url: str, tmp_path: Path) -> None:
    log, pause = tmp_path / "log.txt", tmp_path / "paused"
    env = {**os.environ, "CAN_LOG": str(log)}
    async with dt.open_backend(url) as backend, open_run_store(backend, NAMESPACE) as store:
        first = await trio.lowlevel.open_process(
            command(url, "A", True), stdout=subprocess.DEVNULL, env={**env, "CAN_PAUSE": str(pause)}
        )
        try:
            deadline = time.monotonic() + 30
            while not pause.exists():
                assert time.monotonic() < deadline, "the first engine never reached generation 1"
                await trio.sleep(0.05)
            # Between the halves: the old history is a previous generation, the new one holds
            # only its mark.
            steps = await store.get_steps(RUN_ID)
            assert [s.step_id for s in steps] == [CONTINUE_STEP_ID]
            assert continuation_of(steps[0]).generation == 1
            first.kill()  # SIGKILL
        finally:
            with trio.CancelScope(shield=True):
                await first.wait()
        assert log.read_text().splitlines() == ["generation 0"]
        with trio.fail_after(60):
            done = await trio.run_process(command(url, "B", False), capture_stdout=True, env=env)
        report = json.loads(done.stdout.decode().strip().splitlines()[-1])
        assert report["output"] == [2, 2]
        # Each generation's step ran exactly once: generation 1 once, after the kill.
        assert log.read_text().splitlines() == ["generation 0", "generation 1", "generation 2"]
        generations = generations_of(store)
        assert await generations.list_generations(RUN_ID) == [0, 1]
        for g in (0, 1):
            steps = await generations.get_generation(RUN_ID, g) or []
            assert [s.name for s in steps] == ["continue", "mark"]


@pytest.mark.chaos
async def test_an_engine_killed_between_the_halves_continues_the_run_once_on_sqlite(
    tmp_path: Path,
) -> None:
    url = sqlite_url(tmp_path / "chaos.db")
    await kill_between_the_halves_and_resume(url, tmp_path)


@pytest.mark.chaos
@pytest.mark.redis
async def test_an_engine_killed_between_the_halves_continues_the_run_once_on_redis(
    redis_url: str, tmp_path: Path
) -> None:
    await kill_between_the_halves_and_resume(redis_url, tmp_path)


@pytest.mark.chaos
@pytest.mark.postgres
async def test_an_engine_killed_between_the_halves_continues_the_run_once_on_postgres(
    postgres_schema_url: str, tmp_path: Path
) -> None:
    await kill_between_the_halves_and_resume(postgres_schema_url, tmp_path)


if __name__ == "__main__":
    url, engine_id, start = sys.argv[1:4]
    trio.run(engine_process, url, engine_id, start == "1")
