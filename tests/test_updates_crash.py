"""Updates with real processes: the engine is SIGKILLed between an update's two halves, (a)
after its handler ran but before its outcome was recorded, (b) after its outcome was recorded
but before the run went on. A new engine takes the run over; the caller (this process, waiting
across the crash) gets the outcome once, a retried caller (same ``update_id``) the same one, and
the handler's effect is in the run's state once (SQLite, Redis, PostgreSQL)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

import durable_trio as dt
from durable_trio._engine import App, RunStore, WorkflowContext, open_run_store
from durable_trio._engine._context import UPDATE_DONE, UPDATE_LOG
from durable_trio._engine._updates import UpdateServant, send_update
from helpers import has_steps, poll_until, short_lease_engine, sqlite_url

NAMESPACE = "update-crash"
RUN_ID = "tally-1"

app = App("update-crash")


@app.workflow("tally")
async def tally(ctx: WorkflowContext, _: Any) -> int:
    total = {"n": 0}

    def add(k: int) -> int:
        total["n"] += k
        return total["n"]

    ctx.on_update("add", add)
    await ctx.wait_signal("go")
    return total["n"]


def hang_before_recording(marker: str) -> None:
    """In the first engine: once a handler ran, say so and block (the SIGKILL comes)."""
    apply = UpdateServant._apply

    def applied(self: UpdateServant, request: dict[str, Any]) -> dict[str, Any]:
        outcome = apply(self, request)
        Path(marker).write_text("applied")
        time.sleep(3600)  # the whole process stops here, its outcome not appended
        return outcome

    UpdateServant._apply = applied  # type: ignore[method-assign]


async def engine_process(url: str, engine_id: str, start: bool, marker: str) -> None:
    if marker:
        hang_before_recording(marker)
    async with short_lease_engine(app, url, namespace=NAMESPACE, engine_id=engine_id) as engine:
        if start:
            await engine.start("tally", None, run_id=RUN_ID)
        await engine.result(RUN_ID)


def command(url: str, engine_id: str, start: bool, marker: str = "") -> list[str]:
    return [sys.executable, __file__, url, engine_id, "1" if start else "0", marker]


async def outcome_recorded(store: RunStore) -> bool:
    return await store.read_signal(RUN_ID, UPDATE_DONE, 1) is not None


async def crash_between_halves(url: str, tmp_path: Path, *, recorded: bool) -> None:
    marker = tmp_path / "applied"
    got: list[Any] = []
    async with dt.open_backend(url) as backend, open_run_store(backend, NAMESPACE) as store:
        first = await trio.lowlevel.open_process(
            command(url, "A", True, "" if recorded else str(marker)), stdout=subprocess.DEVNULL
        )
        async with trio.open_nursery() as nursery:
            with trio.fail_after(30):  # started: it waits on its signal
                await poll_until(lambda: has_steps(store, RUN_ID, 1))

            answered = trio.Event()

            async def caller() -> None:
                got.append(await send_update(store, RUN_ID, "add", 5, update_id="u"))
                answered.set()

            nursery.start_soon(caller)
            with trio.fail_after(30):
                if recorded:  # the outcome is in the store: kill before the run goes on
                    await poll_until(lambda: outcome_recorded(store), interval=0.01)
                else:  # the handler ran; its outcome is not recorded
                    while not marker.exists():  # noqa: ASYNC110 (another process writes it)
                        await trio.sleep(0.01)
                    assert await store.read_signal(RUN_ID, UPDATE_DONE, 1) is None
            first.kill()  # SIGKILL
            await first.wait()
            second = await trio.lowlevel.open_process(command(url, "B", False))
            with trio.fail_after(60):
                await answered.wait()
                # A retried caller (the same update id) gets the same outcome, applied once.
                assert await send_update(store, RUN_ID, "add", 5, update_id="u") == 5
                assert await store.append_signal(RUN_ID, "go", "true") == 1
                await second.wait()
        assert second.returncode == 0
        run = await store.get_run(RUN_ID)
        assert run is not None
        assert run.status is dt.RunStatus.COMPLETED
        assert run.output == 5  # the handler's effect once, replayed or applied once
        assert got == [5]
        assert await store.read_signal(RUN_ID, UPDATE_DONE, 2) is None  # one outcome
        assert await store.read_signal(RUN_ID, UPDATE_LOG, 1) is not None


@pytest.mark.chaos
@pytest.mark.parametrize("recorded", [False, True], ids=["before-recording", "after-recording"])
async def test_engine_killed_mid_update_on_sqlite(tmp_path: Path, recorded: bool) -> None:
    await crash_between_halves(sqlite_url(tmp_path / "runs.db"), tmp_path, recorded=recorded)


@pytest.mark.chaos
@pytest.mark.redis
@pytest.mark.parametrize("recorded", [False, True], ids=["before-recording", "after-recording"])
async def test_engine_killed_mid_update_on_redis(
    redis_url: str, tmp_path: Path, recorded: bool
) -> None:
    await crash_between_halves(redis_url, tmp_path, recorded=recorded)


@pytest.mark.chaos
@pytest.mark.postgres
@pytest.mark.parametrize("recorded", [False, True], ids=["before-recording", "after-recording"])
async def test_engine_killed_mid_update_on_postgres(
    postgres_schema_url: str, tmp_path: Path, recorded: bool
) -> None:
    await crash_between_halves(postgres_schema_url, tmp_path, recorded=recorded)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    trio.run(engine_process, sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4])
