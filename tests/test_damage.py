"""Damaged broker data, the transport's side: a claim the broker flags as damaged is set aside
unread, an entry it quarantined is reported, and no broker call that raises ends a loop.

The brokers' own validating decodes (Redis, SQLite) are tested against real stores in
test_redis_damage.py and test_sqlite_damage.py; here a memory broker wrapped by a double flags
chosen claims, at exact virtual times.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio.brokers import ClaimedJob, Lease, Recovery
from helpers import CountingBroker, Errors


class DamagingBroker(CountingBroker):
    """A memory broker whose next pops (or sweep) hand over claims flagged as damaged, or
    raise, as a real broker's validating decode would after reading damaged stored fields."""

    def __init__(self) -> None:
        super().__init__()
        self.damage_next: dict[str, int] = {}
        self.quarantine_next: dict[str, int] = {}
        self.raise_next: dict[str, int] = {}
        self.steal_next: dict[str, int] = {}
        self.stolen: dict[str, list[ClaimedJob]] = {}

    async def pop_many(self, queue: str, count: int, *, worker: str = "") -> list[ClaimedJob]:
        if self.raise_next.get(queue):
            self.raise_next[queue] -= 1
            await trio.lowlevel.checkpoint()
            raise ValueError("could not convert string to float: b''")
        jobs = await super().pop_many(queue, count, worker=worker)
        out: list[ClaimedJob] = []
        for job in jobs:
            if self.steal_next.get(queue):
                # Claimed by a worker that dies at once: only the sweep sees it again.
                self.steal_next[queue] -= 1
                self.stolen.setdefault(queue, []).append(job)
                continue
            if self.damage_next.get(queue):
                self.damage_next[queue] -= 1
                job = attrs.evolve(job, damage="meta unreadable: b'garbage'")
            out.append(job)
        if self.quarantine_next.get(queue):
            self.quarantine_next[queue] -= 1
            out.insert(
                0,
                ClaimedJob(
                    id="",
                    data=b"",
                    lease=Lease("", ""),
                    damage="ready member 'x' has no meta: moved to the quarantine",
                ),
            )
        return out

    async def recover_stalled_jobs(
        self, queue: str, threshold: float, max_stalled: int
    ) -> Recovery:
        recovery = await super().recover_stalled_jobs(queue, threshold, max_stalled)
        stolen = self.stolen.pop(queue, [])
        # Claims a dead worker held, whose stall history the sweep found damaged.
        damaged = [attrs.evolve(j, damage="stall history unreadable: b'[[oops'") for j in stolen]
        return attrs.evolve(recovery, exceeded=(*recovery.exceeded, *damaged))


def task(name: str, n: int) -> dt.RemoteTask:
    return dt.RemoteTask(run_id=f"run-{n}", step_id=f"step-{n}", attempt=1, name=name, input=n)


class World:
    def __init__(self, transport: dt.QueueTransport, broker: DamagingBroker) -> None:
        self.transport = transport
        self.broker = broker
        self.errors: Errors
        self.ran: list[int] = []
        self.ran_at: list[float] = []
        self.results: list[dt.StepResult] = []

    @property
    def queue(self) -> str:
        return self.transport.names.task_queue("job")

    def damaged(self) -> list[dt.DamagedJob]:
        return [e for e in self.errors.seen if isinstance(e, dt.DamagedJob)]


@pytest.fixture
async def world(autojump_clock: trio.testing.MockClock) -> Any:
    broker = DamagingBroker()
    errors = Errors()
    backend = dt.Backend(url="test://", broker=broker)
    async with dt.open_queue_transport(
        backend, concurrency=1, on_error=errors, stalled_threshold=10, stalled_check_interval=5
    ) as transport:
        w = World(transport, broker)
        w.errors = errors

        async def job(t: dt.RemoteTask) -> Any:
            w.ran.append(t.input)
            w.ran_at.append(trio.current_time())
            return t.input

        async def on_result(result: dt.StepResult) -> None:
            w.results.append(result)

        transport.handle("job", job)
        transport.on_result(on_result)
        yield w


async def test_a_damaged_claim_is_set_aside_unread_and_its_step_told_to_retry(
    world: World, autojump_clock: trio.testing.MockClock
) -> None:
    world.broker.damage_next[world.queue] = 1
    await world.transport.dispatch(task("job", 1))
    await world.transport.dispatch(task("job", 2))
    await trio.sleep(1)
    assert world.ran == [2]  # the damaged one never reached its handler
    (error,) = world.damaged()
    assert error.queue == world.queue
    assert "meta unreadable" in str(error)
    (failed,) = await world.broker.failed_jobs(world.queue)
    assert failed.error == "damaged: meta unreadable: b'garbage'"
    assert b'"runId":"run-1"' in failed.data  # the raw bytes stay inspectable
    by_step = {r.step_id: r for r in world.results}
    assert by_step["step-2"].status is dt.StepStatus.COMPLETED
    told = by_step["step-1"]
    assert told.status is dt.StepStatus.FAILED
    assert told.error is not None
    assert (told.error.code, told.error.retryable) == ("damaged", True)


async def test_a_damaged_result_is_set_aside_and_the_results_loop_goes_on(
    world: World, autojump_clock: trio.testing.MockClock
) -> None:
    results_queue = world.transport.names.results
    world.broker.damage_next[results_queue] = 1
    await world.transport.dispatch(task("job", 1))
    await trio.sleep(1)
    await world.transport.dispatch(task("job", 2))
    await trio.sleep(1)
    assert world.ran == [1, 2]
    assert [r.step_id for r in world.results] == ["step-2"]
    (failed,) = await world.broker.failed_jobs(results_queue)
    assert failed.error.startswith("damaged: ")
    (error,) = world.damaged()
    assert error.queue == results_queue


async def test_a_quarantined_entry_is_reported_and_frees_its_slot(
    world: World, autojump_clock: trio.testing.MockClock
) -> None:
    # concurrency=1: had the report-only entry kept the one slot, nothing would run after it.
    world.broker.quarantine_next[world.queue] = 1
    await world.transport.dispatch(task("job", 1))
    await world.transport.dispatch(task("job", 2))
    await trio.sleep(1)
    assert world.ran == [1, 2]
    (error,) = world.damaged()
    assert "moved to the quarantine" in str(error)
    assert await world.broker.failed_jobs(world.queue) == []


async def test_a_pop_that_raises_is_reported_and_retried_not_fatal(
    world: World, autojump_clock: trio.testing.MockClock
) -> None:
    world.broker.raise_next[world.queue] = 3
    start = trio.current_time()
    await world.transport.dispatch(task("job", 1))
    await trio.sleep(5)
    assert world.ran == [1]
    raised = [e for e in world.errors.seen if isinstance(e, dt.BrokerError)]
    assert len(raised) == 3
    assert all(isinstance(e.__cause__, ValueError) for e in raised)
    assert "claiming from 'durable:tasks:job' raised ValueError" in str(raised[0])
    # backed off as on an outage (poll_interval * 2, * 4, * 8), then served
    poll = dt.TransportOptions().poll_interval
    assert world.ran_at[0] - start == pytest.approx(poll * (2 + 4 + 8))


async def test_a_damaged_stalled_claim_is_set_aside_by_the_sweep(
    world: World, autojump_clock: trio.testing.MockClock
) -> None:
    world.broker.steal_next[world.queue] = 1
    await world.transport.dispatch(task("job", 7))
    await trio.sleep(6)  # the first sweep (stalled_check_interval=5) finds it
    (error,) = world.damaged()
    assert "stall history unreadable" in str(error)
    (failed,) = await world.broker.failed_jobs(world.queue)
    assert failed.error == "damaged: stall history unreadable: b'[[oops'"
    (told,) = world.results
    assert (told.step_id, told.error and told.error.code) == ("step-7", "damaged")
    assert world.ran == []
