"""The claim policy and stall attribution (T4, T9 of docs/spec.md; docs/concepts.md, "Claims
and stalls") on the memory broker, with exact virtual times: by default a loop claims only
what it can start; with ``prefetch`` the claims it holds ahead are stored as not started, so a
worker that dies holding them never makes them suspects."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio.brokers.memory import MemoryBroker
from durable_trio.keys.memory import MemoryKeyStore
from durable_trio.testing.faults import Injector, wrap_broker
from helpers import Errors, PausedRenewalBroker

if TYPE_CHECKING:
    from durable_trio.brokers import ClaimedJob


def backend_with(broker: Any, keys: MemoryKeyStore | None = None) -> dt.Backend:
    return dt.Backend(url="test://", broker=broker, keys=keys or MemoryKeyStore())


def task(n: int, seconds: float = 0.0) -> dt.RemoteTask:
    return dt.RemoteTask(run_id="run", step_id=f"s{n}", attempt=1, name="step", input=seconds)


class _PopRecorder(MemoryBroker):
    """Records every pop as (jobs asked, handlers running then)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[int, int]] = []
        self.running = 0

    async def pop_from(self, queue: str, *, worker: str = "") -> ClaimedJob | None:
        if queue.endswith(":step"):
            self.asked.append((1, self.running))
        return await super().pop_from(queue, worker=worker)

    async def pop_many(self, queue: str, count: int, *, worker: str = "") -> list[ClaimedJob]:
        if queue.endswith(":step"):
            self.asked.append((count, self.running))
        return await super().pop_many(queue, count, worker=worker)

    async def pop_ahead(
        self, queue: str, count: int, ahead: int, *, worker: str = ""
    ) -> list[ClaimedJob]:
        raise AssertionError("the default never claims ahead")


async def test_default_pops_never_claim_more_than_the_free_slots(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = _PopRecorder()
    done: list[float] = []
    async with dt.open_queue_transport(backend_with(broker), concurrency=4) as transport:

        async def step(t: dt.RemoteTask) -> None:
            broker.running += 1
            try:
                await trio.sleep(t.input)
            finally:
                broker.running -= 1
            done.append(trio.current_time())

        transport.handle("step", step)
        await transport.dispatch_many([task(n, 1.0 + n % 3) for n in range(20)])
        await trio.sleep(30)
        assert await broker.size_of(transport.names.task_queue("step")) == 0
    assert len(done) == 20
    assert broker.asked  # (the loop did pop)
    for asked, running in broker.asked:
        assert asked + running <= 4, broker.asked
    assert transport.options.prefetch == 0


async def test_prefetched_claims_of_a_killed_worker_come_back_uncounted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Worker A (concurrency 1, prefetch 2) runs s1, holds s2 and s3 ahead, and is killed
    (every call fails, nothing handed back): the sweep takes all three back at 15 s; s1's stall
    counts (its handler ran), s2's and s3's do not, and their evidence says so."""
    shared = MemoryBroker()
    killed = Injector("A", random.Random(0))
    started: list[str] = []
    queue = ""
    async with dt.open_queue_transport(
        backend_with(wrap_broker(shared, killed)),
        concurrency=1,
        prefetch=2,
        stalled_threshold=10.0,
        stalled_check_interval=0,
        instance_id="A",
        on_error=Errors(),
    ) as a:
        queue = a.names.task_queue("step")

        async def hangs(t: dt.RemoteTask) -> None:
            started.append(t.step_id)
            await trio.sleep_forever()

        a.handle("step", hangs)
        await a.dispatch_many([task(1), task(2), task(3)])
        await trio.testing.wait_all_tasks_blocked()
        states = sorted(c.state.value for c in a._runner.claims.values())
        assert states == ["buffered", "buffered", "running"]
        killed.kill()
        await trio.sleep(15)
        recovery = await shared.recover_stalled_jobs(queue, 10.0, 3)
        assert (recovery.recovered, recovery.exceeded) == (3, ())
        back = {job.lease.job_id: job for job in await shared.pop_many(queue, 10)}
    assert started == ["s1"]
    by_step = {_step_of(job): job for job in back.values()}
    assert by_step["s1"].stalled_count == 1
    assert [(s.worker, s.counted) for s in by_step["s1"].stalls] == [("A", True)]
    for step in ("s2", "s3"):
        assert by_step[step].stalled_count == 0
        assert [(s.at, s.worker, s.counted) for s in by_step[step].stalls] == [(15.0, "A", False)]


async def test_a_prefetched_claim_counts_once_its_handler_started(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """s1 finishes at 1 s, so s2 (held ahead) starts then: marked started before its handler
    runs, its stall counts when the worker dies; s3, still ahead, does not."""
    shared = MemoryBroker()
    killed = Injector("A", random.Random(0))
    async with dt.open_queue_transport(
        backend_with(wrap_broker(shared, killed)),
        concurrency=1,
        prefetch=2,
        stalled_threshold=10.0,
        stalled_check_interval=0,
        instance_id="A",
        on_error=Errors(),
    ) as a:
        queue = a.names.task_queue("step")

        async def step(t: dt.RemoteTask) -> None:
            if t.step_id != "s1":
                await trio.sleep_forever()
            await trio.sleep(1.0)

        a.handle("step", step)
        await a.dispatch_many([task(1), task(2), task(3)])
        await trio.sleep(2)
        killed.kill()
        await trio.sleep(13)
        recovery = await shared.recover_stalled_jobs(queue, 10.0, 3)
        back = {_step_of(job): job for job in await shared.pop_many(queue, 10)}
    assert recovery.recovered == 2
    assert set(back) == {"s2", "s3"}  # s1 completed
    assert back["s2"].stalled_count == 1
    assert [s.counted for s in back["s2"].stalls] == [True]
    assert back["s3"].stalled_count == 0
    assert [s.counted for s in back["s3"].stalls] == [False]


async def test_with_prefetch_a_crash_loop_fails_only_the_poison_step(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A poison step kills whichever worker runs it (every call of that worker fails from then
    on, its claims are never handed back); a fresh worker replaces each dead one. Every worker
    prefetches. The poison step is failed after its fourth stall while running (more than
    max_stalled_count = 3), with evidence of four counted stalls; every innocent step, however
    often it was held ahead by a dying worker, completes, none fails."""
    shared = _StallRecorder()
    keys = MemoryKeyStore()
    errors = Errors()
    results: dict[str, dt.StepResult] = {}
    poison_starts: list[float] = []
    innocent = [task(n, 0.5) for n in range(2, 30)]

    async def on_result(r: dt.StepResult) -> None:
        results.setdefault(r.step_id, r)

    async with dt.open_queue_transport(
        backend_with(shared, keys), instance_id="engine", stalled_threshold=10.0,
        stalled_check_interval=5.0, on_error=errors,
    ) as engine:
        engine.on_result(on_result)
        await engine.dispatch_many([task(1), *innocent])
        generation = 0
        while len(results) < 1 + len(innocent) and generation < 10:
            generation += 1
            injector = Injector(f"w{generation}", random.Random(generation))
            async with dt.open_queue_transport(
                backend_with(wrap_broker(shared, injector), keys),
                concurrency=1,
                prefetch=4,
                stalled_threshold=10.0,
                stalled_check_interval=5.0,
                instance_id=f"w{generation}",
                on_error=errors,
            ) as worker:

                async def step(t: dt.RemoteTask, injector: Injector = injector) -> str:
                    if t.step_id == "s1":
                        poison_starts.append(trio.current_time())
                        injector.kill()  # kill -9: this worker is gone from here on
                        await trio.sleep_forever()
                    await trio.sleep(t.input)
                    return "ok"

                worker.handle("step", step)
                with trio.move_on_after(30):
                    while not injector.dead:  # noqa: ASYNC110
                        await trio.sleep(0.1)
    poison = results["s1"]
    assert poison.status is dt.StepStatus.FAILED
    assert poison.error is not None
    assert poison.error.code == "stalled"
    assert poison.error.details["stalledCount"] == 4
    assert [s["counted"] for s in poison.error.details["stalls"]] == [True] * 4
    assert len(poison_starts) == 4
    innocent_ids = {t.step_id for t in innocent}
    assert innocent_ids <= set(results)
    assert all(results[i].status is dt.StepStatus.COMPLETED for i in innocent_ids)
    (failed,) = await shared.failed_jobs(engine.names.task_queue("step"))
    assert failed.stalled_count == 4
    # innocents were held ahead by dying workers (stalls recorded, uncounted), never counted
    held = {step for step, stalls in shared.seen if step != "s1" and stalls}
    assert held
    assert all(
        not s.counted for step, stalls in shared.seen if step != "s1" for s in stalls
    )


class _StallRecorder(MemoryBroker):
    """Records (step, stall history) of every task claim popped."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple[Any, ...]]] = []

    async def pop_many(self, queue: str, count: int, *, worker: str = "") -> list[ClaimedJob]:
        jobs = await super().pop_many(queue, count, worker=worker)
        self.seen.extend((_step_of(j), j.stalls) for j in jobs if queue.endswith(":step"))
        return jobs

    async def pop_ahead(
        self, queue: str, count: int, ahead: int, *, worker: str = ""
    ) -> list[ClaimedJob]:
        jobs = await super().pop_ahead(queue, count, ahead, worker=worker)
        self.seen.extend((_step_of(j), j.stalls) for j in jobs if queue.endswith(":step"))
        return jobs


def _step_of(job: ClaimedJob) -> str:
    from durable_trio._codec import decode_envelope

    payload = decode_envelope(job.data).payload
    return str(payload.step_id)


_DECISION = dt.WorkflowDecision("t1", "run", dt.DecisionStatus.COMPLETED)


@pytest.mark.parametrize("which", ["decision", "control", "inbox"])
async def test_a_poison_job_on_any_queue_is_set_aside_past_the_limit(
    which: str, autojump_clock: trio.testing.MockClock
) -> None:
    """A decision, a control message, a job on this instance's own inbox: whose handler keeps
    stalling (this worker's renewals never land) is redelivered after each of its first 3
    stalls and set aside at the 4th, failed and inspectable, never redelivered again. The
    inbox is swept too."""
    shared = MemoryBroker()
    broker = PausedRenewalBroker(shared)
    broker.paused = True
    starts: list[float] = []
    async with dt.open_queue_transport(
        backend_with(broker),
        stalled_threshold=10.0,
        stalled_check_interval=5.0,
        instance_id="me",
        on_error=Errors(),
    ) as transport:

        async def hangs(payload: Any) -> None:
            starts.append(trio.current_time())
            await trio.sleep_forever()

        names = transport.names
        kind, queue, payload, inbox = {
            "decision": (dt.JobKind.DECISION, names.decisions, _DECISION, False),
            "control": (dt.JobKind.CONTROL, names.control, dt.ControlMessage("x"), False),
            "inbox": (dt.JobKind.CONTROL, names.inbox("me"), dt.ControlMessage("x"), True),
        }[which]
        # (10 slots: each hung handler keeps one, as a blocked event loop would)
        transport.consume(kind, queue, hangs, concurrency=10, inbox=inbox)
        await transport.publish(kind, queue, payload)
        await trio.sleep(100)
        (failed,) = await shared.failed_jobs(queue)
        assert await shared.size_of(queue) == 0
    assert starts == [0.0, 15.0, 30.0, 45.0]
    assert failed.error == "stalled more than 3 times"
    assert (failed.stalled_count, failed.failed_at) == (4, 60.0)
