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
from typing import TYPE_CHECKING, Any

import orjson
import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio._codec import encode_envelope
from durable_trio._wire import JobKind
from durable_trio.brokers import Job
from durable_trio.brokers.memory import MemoryBroker
from durable_trio.keys.memory import MemoryKeyStore
from helpers import killable_worker

if TYPE_CHECKING:
    from collections.abc import Sequence

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


class HintedBroker(MemoryBroker):
    """The memory broker with the sweep hint the SQL and Redis brokers have
    (``SupportsSweepHint``), answered from its own claims; the times it was asked."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[float] = []

    async def queues_with_claims(self, queues: Sequence[str]) -> list[str]:
        await trio.lowlevel.checkpoint()
        self.asked.append(trio.current_time())
        return [q for q in queues if (state := self._queues.get(q)) is not None and state.active]


async def test_an_idle_worker_asks_the_hint_once_per_dead_threshold(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With no claim on its queues, no claim can be older than the dead threshold before a
    threshold has passed: the dead pass asks again then (5, 40, 75 ...), not at every tick
    (5 s). The stalled sweep asks on its own, every 30 s."""
    broker, keys = HintedBroker(), MemoryKeyStore()
    backend = dt.Backend(url="test://", broker=broker, keys=keys)
    async with dt.open_queue_transport(backend) as transport:

        async def step(t: dt.RemoteTask) -> None:
            pass

        transport.handle("step", step)
        await trio.sleep(200)
    dead_pass = [5.0, 40.0, 75.0, 110.0, 145.0, 180.0]
    stalled_sweep = [30.0, 60.0, 90.0, 120.0, 150.0, 180.0]
    assert broker.asked == sorted(dead_pass + stalled_sweep)


@pytest.mark.parametrize("hinted", [False, True], ids=["no-hint", "hint"])
async def test_a_claim_taken_after_a_quiet_answer_comes_back_at_the_same_tick(
    autojump_clock: trio.testing.MockClock, hinted: bool
) -> None:
    """A ghost takes a job at 12 s, after the hint said the queue had no claim (at 5 s) and
    before the dead pass asks again (40 s): its claim is older than 40 s at 52, and it comes
    back at the tick after (55), as without the hint."""
    broker = HintedBroker() if hinted else MemoryBroker()
    keys = MemoryKeyStore()
    backend = dt.Backend(url="test://", broker=broker, keys=keys)
    ran_at: list[float] = []
    async with dt.open_queue_transport(backend) as transport:

        async def step(t: dt.RemoteTask) -> None:
            ran_at.append(trio.current_time())

        transport.handle("step", step)
        await trio.sleep(12)
        queue = transport.names.task_queue("step")
        data = encode_envelope("ghostly", JobKind.TASK, task(), None, 1 << 20)
        await broker.push_on(queue, Job("ghostly", data))
        ghost = await broker.pop_from(queue, worker="ghost")  # before this worker's loop runs
        assert ghost is not None
        assert ghost.id == "ghostly"
        last = orjson.dumps({"ts": time.time()})
        await keys.put_many([(transport.names.worker_last_status("ghost"), last, 86_400.0)])
        await trio.sleep(100)
    assert ran_at == [55.0]
    if hinted:
        assert isinstance(broker, HintedBroker)
        # (30: the stalled sweep's own question)
        assert [t for t in broker.asked if t <= 55] == [5.0, 30.0, 40.0, 45.0, 50.0, 55.0]


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
