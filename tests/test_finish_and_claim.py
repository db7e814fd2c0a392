"""A worker's finalize that claims its next jobs in the same round trip
(``SupportsFinishAndClaim``, brokers/_contract.py; docs/decisions.md, "A finishing worker
claims its next job").

The broker half runs on every broker (parametrized in conftest.py). The transport half runs at
exact virtual times on a memory broker that batches its finalizes as Redis and SQLite do, with
a pause injected into one call where a test needs a close to land in flight, and then on a
real SQLite file and a private redis-server.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

import trio
import trio.testing

import durable_trio as dt
from _claim_log import observe_claims
from durable_trio.backends import Backend
from durable_trio.brokers import ClaimedJob, Job, SupportsFinishAndClaim
from durable_trio.brokers.memory import MemoryBroker
from durable_trio.keys.memory import MemoryKeyStore
from helpers import Errors

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    from durable_trio.brokers import Lease

Q = "t:tasks:fused"
R = "t:results:fused"


def job(n: int | str) -> Job:
    return Job(f"job-{n}", f'{{"n":"{n}"}}'.encode())


# --------------------------------------------------------------------------- every broker


async def test_every_broker_can_finish_and_claim(broker: Any, contract_clock: object) -> None:
    assert isinstance(broker, SupportsFinishAndClaim)


async def test_it_pushes_completes_and_then_claims_in_pop_order(
    broker: Any, contract_clock: object
) -> None:
    for n in range(5):
        await broker.push_on(Q, job(n))
    first, second = await broker.pop_many(Q, 2, worker="w")
    await broker.complete_job(second.lease, Q)  # its lease is gone: answered False
    answers, claimed = await broker.finish_and_claim(
        R, [job("r0"), job("r1")], Q, [first.lease, second.lease], 2, worker="w"
    )
    assert answers == [True, False]
    assert [c.id for c in claimed] == ["job-2", "job-3"]
    assert all(c.started for c in claimed)
    assert [c.id for c in await broker.pop_many(R, 5)] == ["job-r0", "job-r1"]
    # fewer than asked: the queue drained
    answers, claimed = await broker.finish_and_claim(R, [], Q, [c.lease for c in claimed], 3)
    assert answers == [True, True]
    assert [c.id for c in claimed] == ["job-4"]
    # nothing asked: nothing claimed
    await broker.push_on(Q, job(5))
    assert await broker.finish_and_claim(R, [], Q, [claimed[0].lease], 0) == ([True], [])
    assert [c.id for c in await broker.pop_many(Q, 5)] == ["job-5"]


# --------------------------------------------------------------------------- the transport


class FusingBroker(MemoryBroker):
    """A memory broker that batches its finalizes (as Redis and SQLite do), counting how jobs
    were claimed; ``pause_next`` makes the next finalize wait that long before it does
    anything (a request in flight)."""

    coalesce_finalize = True

    def __init__(self) -> None:
        super().__init__()
        self.popped = 0
        self.claimed_by_finalize: list[str] = []
        self.pause_next = 0.0

    async def pop_many(self, queue: str, count: int, *, worker: str = "") -> list[ClaimedJob]:
        jobs = await super().pop_many(queue, count, worker=worker)
        if ":tasks:" in queue:
            self.popped += len(jobs)
        return jobs

    async def finish_and_claim(
        self,
        push_queue: str,
        jobs: Sequence[Job],
        queue: str,
        leases: Sequence[Lease],
        count: int,
        *,
        worker: str = "",
    ) -> tuple[list[bool], list[ClaimedJob]]:
        pause, self.pause_next = self.pause_next, 0.0
        if pause:
            await trio.sleep(pause)
        done = await super().push_and_complete_many(push_queue, jobs, queue, leases)
        claimed = await MemoryBroker.pop_many(self, queue, count, worker=worker)
        self.claimed_by_finalize += [c.id for c in claimed]
        return done, claimed


def task(n: int) -> dt.RemoteTask:
    return dt.RemoteTask(run_id="fused", step_id=str(n), attempt=1, name="work")


async def test_a_backlog_is_claimed_by_the_finalizes_at_exact_times(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """30 one-second steps, concurrency 3: the first pop claims three; from then on each
    finishing job's finalize claims the next, so the queue drains in exactly 10 s with ONE pop
    (and one empty pop at the end), every step once."""
    broker = FusingBroker()
    backend = Backend(url="memory://", broker=broker, keys=MemoryKeyStore())
    ran: collections.Counter[str] = collections.Counter()
    ended = trio.Event()

    async def work(t: dt.RemoteTask) -> None:
        await trio.sleep(1)
        ran[t.step_id] += 1
        if len(ran) == 30:
            ended.set()

    async with dt.open_queue_transport(backend, namespace="fz") as engine:
        await engine.dispatch_many([task(n) for n in range(30)])
    start = trio.current_time()
    async with dt.open_queue_transport(backend, namespace="fz", concurrency=3) as worker:
        worker.handle("work", work)
        await ended.wait()
        assert trio.current_time() - start == 10.0
    assert ran == {str(n): 1 for n in range(30)}
    assert broker.popped == 3
    assert len(broker.claimed_by_finalize) == 27


async def test_a_result_consumer_claims_its_next_result_in_each_finalize(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A finalize with no result to push (an engine consuming step results) claims too: 30
    results waiting, a one-second handler, result_concurrency 3: ONE pop, then 27 claims made by
    the finalizes, and the queue drains in exactly 10 s, every result once."""
    broker = FusingBroker()
    backend = Backend(url="memory://", broker=broker, keys=MemoryKeyStore())
    seen: collections.Counter[str] = collections.Counter()
    ended = trio.Event()
    pops: list[int] = []

    def popped(queue: str, jobs: list[ClaimedJob], by_finalize: bool) -> None:
        if queue.endswith(":results") and not by_finalize:
            pops.append(len(jobs))

    observe_claims(broker, popped)
    async with dt.open_queue_transport(backend, namespace="fz") as worker_side:
        for n in range(30):
            await worker_side.publish_result(
                dt.StepResult(
                    run_id="fused", step_id=str(n), attempt=1,
                    status=dt.StepStatus.COMPLETED, output=n,
                )
            )

    async def on_result(result: dt.StepResult) -> None:
        await trio.sleep(1)
        seen[result.step_id] += 1
        if len(seen) == 30:
            ended.set()

    start = trio.current_time()
    async with dt.open_queue_transport(backend, namespace="fz", result_concurrency=3) as engine:
        engine.on_result(on_result)
        await ended.wait()
        assert trio.current_time() - start == 10.0
    assert seen == {str(n): 1 for n in range(30)}
    assert [p for p in pops if p] == [3]  # one pop claimed (the others found none)
    assert len(broker.claimed_by_finalize) == 27


async def test_a_queue_without_a_backlog_is_not_claimed_from_by_finalizes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Jobs trickling in one at a time: the pop that found the queue drained says there is no
    backlog, so the finalizes claim nothing (no empty claim on every job)."""
    broker = FusingBroker()
    backend = Backend(url="memory://", broker=broker, keys=MemoryKeyStore())
    served = []

    async def work(t: dt.RemoteTask) -> None:
        served.append((t.step_id, trio.current_time()))

    async with (
        dt.open_queue_transport(backend, namespace="fz") as engine,
        dt.open_queue_transport(backend, namespace="fz", concurrency=3) as worker,
    ):
        worker.handle("work", work)
        for n in range(5):
            await engine.dispatch_many([task(n)])
            await trio.sleep(1)
    assert [s for s, _ in served] == [str(n) for n in range(5)]
    assert broker.claimed_by_finalize == []
    assert broker.popped == 5


async def test_claims_landing_as_the_worker_closes_go_back_unstarted_and_uncounted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Three jobs finish together at 1 s; the first finalize hangs (a broker not answering),
    the other two queue behind it, asking for their next jobs. The worker closes at 1.5 s:
    the hung call is cut at close's bound, the queued batch goes out (its leader is
    shielded) and claims two jobs for workers that are closing. Neither runs: both go back to
    the queue at once, attempt-neutral, with no stall recorded; nothing ran twice."""
    broker = FusingBroker()
    backend = Backend(url="memory://", broker=broker, keys=MemoryKeyStore())
    ran: collections.Counter[str] = collections.Counter()

    async def work(t: dt.RemoteTask) -> None:
        await trio.sleep(1)
        ran[t.step_id] += 1
        broker.pause_next = 60.0  # the first finalize of the three hangs

    async with dt.open_queue_transport(backend, namespace="fz") as engine:
        await engine.dispatch_many([task(n) for n in range(10)])
    errors = Errors()
    async with dt.open_queue_transport(
        backend, namespace="fz", concurrency=3, cleanup_timeout=0.5, on_error=errors
    ) as worker:
        worker.handle("work", work)
        await trio.sleep(1.5)
    assert ran == {"0": 1, "1": 1, "2": 1}
    assert len(broker.claimed_by_finalize) == 2
    queue = next(q for q in broker._queues if ":tasks:" in q)
    back = await MemoryBroker.pop_many(broker, queue, 20)
    set_aside = set(broker.claimed_by_finalize)
    assert set_aside <= {b.id for b in back}
    for claim in back:
        assert (claim.attempts, claim.stalled_count, claim.stalls) == (0, 0, ())
    assert len(back) == 7  # the job of the hung finalize is still claimed (the sweep's)
    assert any("finalizing timed out" in m for m in errors.messages())


async def drain_counting(url: str) -> tuple[collections.Counter[str], int, int, int]:
    """200 no-op steps drained at concurrency 8 by a worker on ``url``: (runs per step, jobs
    claimed by finalizes, jobs claimed by pops, the most ``finish_and_claim`` calls in flight
    at once)."""
    ran: collections.Counter[str] = collections.Counter()
    ended = trio.Event()
    fused = popped = flying = most_flying = 0
    async with dt.open_backend(url) as backend:
        broker: Any = backend.broker
        finish_and_claim = broker.finish_and_claim

        async def watched(*args: Any, **kwargs: Any) -> Any:
            nonlocal flying, most_flying
            flying += 1
            most_flying = max(most_flying, flying)
            try:
                return await finish_and_claim(*args, **kwargs)
            finally:
                flying -= 1

        broker.finish_and_claim = watched

        def count(queue: str, jobs: list[ClaimedJob], by_finalize: bool) -> None:
            nonlocal fused, popped
            if ":tasks:" not in queue:
                return
            if by_finalize:
                fused += len(jobs)
            else:
                popped += len(jobs)

        observe_claims(backend.broker, count)

        async def work(t: dt.RemoteTask) -> None:
            ran[t.step_id] += 1
            if len(ran) == 200:
                ended.set()

        async with dt.open_queue_transport(backend, namespace="fz") as engine:
            await engine.dispatch_many([task(n) for n in range(200)])
        async with dt.open_queue_transport(backend, namespace="fz", concurrency=8) as worker:
            worker.handle("work", work)
            with trio.fail_after(30):
                await ended.wait()
    return ran, fused, popped, most_flying


async def test_a_worker_on_a_sqlite_file_claims_in_its_finalizes(tmp_path: Path) -> None:
    ran, fused, popped, flying = await drain_counting(f"sqlite:///{tmp_path}/fused.db")
    print(f"claimed by finalizes {fused}, by pops {popped}")
    assert ran == {str(n): 1 for n in range(200)}
    assert fused + popped == 200
    assert fused > popped
    # One transaction after another: its finalizes are not sent in two halves.
    assert flying == 1


async def test_a_worker_on_redis_claims_in_its_finalizes(redis_url: str) -> None:
    ran, fused, popped, flying = await drain_counting(redis_url)
    print(f"claimed by finalizes {fused}, by pops {popped}, at most {flying} calls flying")
    assert ran == {str(n): 1 for n in range(200)}
    assert fused + popped == 200
    assert fused > popped
    assert flying <= 2  # two halves (two calls in flight when the batches are full)
