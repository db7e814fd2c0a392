"""Dead-worker reclaim (issue 30, item 9; ``durable_trio/_dead_workers.py``): the claims of a
worker whose liveness is gone come back after ``dead_worker_threshold`` (40 s), not the
``stalled_threshold`` (120 s), while a live worker's long step keeps its claim.

On memory at exact virtual times (a "ghost" worker: it popped a job and beat once, its liveness
keys gone); then a real worker process killed with -9 on SQLite (wall clock, bounded, chaos):
its process is known dead at once, and its step comes back to the live worker long before the
threshold of 10 minutes.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio.brokers.memory import MemoryBroker
from durable_trio.keys.memory import MemoryKeyStore
from helpers import killable_worker

TESTS = Path(__file__).parent
TARGET = f"{TESTS / '_supervised_app.py'}:app"


def task(seconds: float = 0.0) -> dt.RemoteTask:
    return dt.RemoteTask(run_id="run", step_id="s1", attempt=1, name="step", input=seconds)


async def haunted(
    transport: dt.QueueTransport, broker: MemoryBroker, keys: MemoryKeyStore
) -> None:
    """A worker "ghost" popped the task and beat once; its liveness keys have expired since
    (only its last status, kept a day, remains)."""
    ghost = await broker.pop_from(transport.names.task_queue("step"), worker="ghost")
    assert ghost is not None
    last = orjson.dumps({"ts": time.time()})
    await keys.put_many([(transport.names.worker_last_status("ghost"), last, 86_400.0)])


async def test_a_dead_workers_claim_comes_back_after_the_dead_threshold(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker, keys = MemoryBroker(), MemoryKeyStore()
    backend = dt.Backend(url="test://", broker=broker, keys=keys)
    ran_at: list[float] = []
    async with dt.open_queue_transport(backend) as transport:  # the defaults: 120 s and 40 s
        await transport.dispatch(task())
        await haunted(transport, broker, keys)

        async def step(t: dt.RemoteTask) -> None:
            ran_at.append(trio.current_time())

        transport.handle("step", step)
        await trio.sleep(200)
    # The dead pass every 5 s: at 45 the ghost's claim is older than 40 s (before: at 150,
    # the first 30 s sweep past the 120 s threshold).
    assert ran_at == [45.0]


async def test_without_a_dead_worker_the_full_threshold_applies(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A claim whose holder's liveness is not known gone (no last status: a worker that
    never beat, or another version's) waits for the stalled threshold, as before."""
    broker, keys = MemoryBroker(), MemoryKeyStore()
    backend = dt.Backend(url="test://", broker=broker, keys=keys)
    ran_at: list[float] = []
    async with dt.open_queue_transport(backend) as transport:
        await transport.dispatch(task())
        assert await broker.pop_from(transport.names.task_queue("step"), worker="x") is not None

        async def step(t: dt.RemoteTask) -> None:
            ran_at.append(trio.current_time())

        transport.handle("step", step)
        await trio.sleep(200)
    assert ran_at == [150.0]


async def test_a_live_workers_long_step_keeps_its_claim_while_another_is_dead(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A step three times the dead threshold: its worker renews every third of it, so the dead
    pass (running: a ghost is dead) never takes it back."""
    broker, keys = MemoryBroker(), MemoryKeyStore()
    backend = dt.Backend(url="test://", broker=broker, keys=keys)
    runs: list[float] = []
    results: list[Any] = []
    async with dt.open_queue_transport(backend, concurrency=2) as transport:
        await transport.dispatch(task())
        await haunted(transport, broker, keys)

        async def step(t: dt.RemoteTask) -> str:
            runs.append(trio.current_time())
            await trio.sleep(100)  # the ghost's job: taken back at 45, then runs 100 s here
            return "done"

        async def on_result(r: dt.StepResult) -> None:
            results.append(r.output)

        transport.handle("step", step)
        transport.on_result(on_result)
        await trio.sleep(200)
    assert runs == [45.0]
    assert results == ["done"]


# -- a real worker process killed with -9 ------------------------------------------------------


@pytest.mark.chaos
async def test_a_worker_killed_with_9_has_its_step_reclaimed_long_before_the_threshold() -> None:
    folder = Path(tempfile.mkdtemp(prefix="dt-dead-", dir="/tmp"))
    url = f"sqlite:///{folder / 'dead.db'}"
    namespace = "dead"
    log = folder / "steps.log"
    survivor = dt.App("supervised")
    ran: list[str] = []

    @survivor.step("work")
    async def work(seconds: float) -> str:
        ran.append(dt.step_info().step_id)
        return "reclaimed"

    try:
        results: list[dt.StepResult] = []
        async with (
            killable_worker(TARGET, url, namespace, {"SUPERVISOR_TEST_LOG": str(log)}) as victim,
            dt.open_backend(url) as backend,
            dt.open_queue_transport(backend, namespace=namespace) as engine,
        ):

            async def on_result(result: dt.StepResult) -> None:
                results.append(result)

            engine.on_result(on_result)
            step = dt.RemoteTask(run_id="r", step_id="1", attempt=1, name="work", input=3600)
            await engine.dispatch(step)
            with trio.fail_after(30):
                while not log.exists() or "START 1" not in log.read_text():  # noqa: ASYNC110
                    await trio.sleep(0.05)
            async with dt.open_worker(
                survivor,
                backend,
                namespace=namespace,
                stalled_threshold=600,
                dead_worker_threshold=2,
                stalled_check_interval=1,
            ):
                # Alive, the victim renews its claim every 2/3 s: three dead thresholds pass
                # and the step stays with it.
                await trio.sleep(6)
                assert ran == []
                killed = await victim.kill9()
                with trio.fail_after(30):
                    while not results:  # noqa: ASYNC110
                        await trio.sleep(0.05)
                took = time.monotonic() - killed
        assert ran == ["1"]
        assert [r.output for r in results] == ["reclaimed"]
        # Its liveness keys live 35 s after its last beat, the threshold is 10 minutes: the
        # reclaim came from its process being known dead.
        assert took < 30
    finally:
        shutil.rmtree(folder, ignore_errors=True)
