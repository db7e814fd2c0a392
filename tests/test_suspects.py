"""A suspect runs alone (docs/concepts.md, "A suspect runs alone"): a step task that stalled
before while its handler ran waits for the handlers beside it, no new one starts meanwhile,
and what happens to it while it waits (a bound, close, a lost lease) never counts a stall.
Memory broker, exact virtual times."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio
import trio.testing

import durable_trio as dt
from durable_trio._codec import decode_envelope
from durable_trio.brokers.memory import MemoryBroker
from durable_trio.keys.memory import MemoryKeyStore
from helpers import CountingBroker, Errors

if TYPE_CHECKING:
    from collections.abc import Sequence

    from durable_trio.brokers import Lease, RenewOutcome

THRESHOLD = 10.0


def backend_with(broker: Any) -> dt.Backend:
    return dt.Backend(url="test://", broker=broker, keys=MemoryKeyStore())


def task(name: str, seconds: float) -> dt.RemoteTask:
    return dt.RemoteTask(run_id="run", step_id=name, attempt=1, name="step", input=seconds)


async def make_suspect(broker: Any, transport: dt.QueueTransport, name: str) -> str:
    """Dispatch ``name`` (onto an empty queue) and have a worker that dies take it: back on
    its queue with one counted stall. Returns its job id."""
    queue = transport.names.task_queue("step")
    await transport.dispatch(task(name, 1.0))
    dead = await broker.pop_from(queue, worker="dead-worker")
    assert dead is not None
    assert dead.started
    await trio.sleep(THRESHOLD + 1)
    assert (await broker.recover_stalled_jobs(queue, THRESHOLD, 3)).recovered == 1
    return str(dead.id)


class Timeline:
    def __init__(self) -> None:
        self.spans: dict[str, tuple[float, float]] = {}
        self.results: dict[str, list[dt.StepResult]] = {}

    async def step(self, t: dt.RemoteTask) -> str:
        began = trio.current_time()
        await trio.sleep(t.input)
        self.spans[t.step_id] = (began, trio.current_time())
        return t.step_id

    async def on_result(self, r: dt.StepResult) -> None:
        self.results.setdefault(r.step_id, []).append(r)


async def test_a_suspect_waits_for_the_handlers_beside_it_and_then_runs_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = MemoryBroker()
    errors = Errors()
    seen = Timeline()
    async with dt.open_queue_transport(
        backend_with(broker),
        concurrency=4,
        stalled_threshold=THRESHOLD,
        suspect_wait=30.0,
        on_error=errors,
    ) as transport:
        await make_suspect(broker, transport, "suspect")
        began = trio.current_time()
        for name, seconds in (("a", 10.0), ("b", 10.0), ("c", 1.0), ("d", 1.0)):
            await transport.dispatch(task(name, seconds))
        transport.on_result(seen.on_result)
        transport.handle("step", seen.step)  # pops suspect, a, b, c (four free slots)
        await trio.sleep(30)
    at = {name: (start - began, end - began) for name, (start, end) in seen.spans.items()}
    assert at == {
        "a": (0.0, 10.0),
        "b": (0.0, 10.0),
        "c": (0.0, 1.0),
        # waited for a, b and c; took no slot meanwhile (d waited too)
        "suspect": (10.0, 11.0),
        "d": (11.0, 12.0),
    }
    (result,) = seen.results["suspect"]
    assert result.status is dt.StepStatus.COMPLETED
    assert result.delivery["stalledCount"] == 1
    assert errors.seen == []


async def test_a_suspect_that_waited_in_vain_is_handed_back_uncounted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Beside a 100 s step, a suspect waits ``suspect_wait`` (10 s), is handed back for as
    long, attempt-neutral; popped again, it waits again; it runs when the long step ends. Its
    history keeps its one counted stall and nothing else."""
    broker = CountingBroker()
    errors = Errors()
    seen = Timeline()
    async with dt.open_queue_transport(
        backend_with(broker), concurrency=2, stalled_threshold=THRESHOLD, on_error=errors
    ) as transport:
        await make_suspect(broker.inner, transport, "suspect")
        await transport.dispatch(task("long", 100.0))
        transport.on_result(seen.on_result)
        began = trio.current_time()
        transport.handle("step", seen.step)
        await trio.sleep(130)
    at = {name: (start - began, end - began) for name, (start, end) in seen.spans.items()}
    assert at == {"long": (0.0, 100.0), "suspect": (100.0, 101.0)}
    # handed back at 10, 30, 50, 70, 90 (each after a 10 s wait, back for 10 s), never counted
    assert [counted for _, counted in broker.handbacks] == [False] * 5
    assert len({job_id for job_id, _ in broker.handbacks}) == 1
    (result,) = seen.results["suspect"]
    assert result.delivery["stalledCount"] == 1
    assert [s["worker"] for s in result.delivery["stalls"]] == ["dead-worker"]
    assert errors.seen == []


async def test_close_hands_a_waiting_suspect_back_without_waiting_for_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = CountingBroker()
    seen = Timeline()
    async with dt.open_queue_transport(
        backend_with(broker),
        concurrency=2,
        stalled_threshold=THRESHOLD,
        suspect_wait=1000.0,
        close_timeout=5.0,
        on_error=Errors(),
    ) as transport:
        await make_suspect(broker.inner, transport, "suspect")
        await transport.dispatch(task("long", 100.0))
        transport.handle("step", seen.step)
        await trio.sleep(20)
        closing = trio.current_time()
    # close waited close_timeout for "long" (then cancelled it), never for the suspect
    assert trio.current_time() - closing == 5.0
    assert seen.spans == {}
    assert [counted for _, counted in broker.handbacks] == [False, False]  # long, suspect
    queue = transport.names.task_queue("step")
    back = {
        decode_envelope(job.data).payload.step_id: job
        for job in await broker.inner.pop_many(queue, 5)
    }
    assert back["suspect"].stalled_count == 1
    assert [(s.worker, s.counted) for s in back["suspect"].stalls] == [("dead-worker", True)]
    assert back["suspect"].attempts == 0


class _HidesFromRenewal(CountingBroker):
    """Fault injection: while ``hidden`` names a job, renewals leave its claim out (its worker
    silent for it alone), so the sweep takes it back; then renewal reports it lost."""

    hidden: str | None = None

    async def renew_jobs(self, queue: str, leases: Sequence[Lease]) -> RenewOutcome:
        kept = [lease for lease in leases if lease.job_id != self.hidden]
        outcome = await self.inner.renew_jobs(queue, kept)
        return outcome


async def test_a_suspect_whose_claim_is_taken_back_while_it_waits_is_dropped_unrun(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = _HidesFromRenewal()
    seen = Timeline()
    errors = Errors()
    async with dt.open_queue_transport(
        backend_with(broker),
        concurrency=2,
        stalled_threshold=THRESHOLD,
        stalled_check_interval=1.0,
        suspect_wait=1000.0,
        on_error=errors,
    ) as transport:
        transport.on_result(seen.on_result)
        suspect = await make_suspect(broker.inner, transport, "suspect")
        await transport.dispatch(task("long", 100.0))
        began = trio.current_time()
        broker.hidden = suspect
        transport.handle("step", seen.step)
        # its claim ages out (not renewed): the sweep takes it back, uncounted (not started)
        await trio.sleep(THRESHOLD + 2)
        broker.hidden = None  # the next renewal learns it was lost: dropped, never ran
        await trio.sleep(120)
    at = {name: (start - began, end - began) for name, (start, end) in seen.spans.items()}
    assert at["long"] == (0.0, 100.0)
    assert at["suspect"][0] == 100.0  # ran once, alone, after "long"
    (result,) = seen.results["suspect"]
    assert result.delivery["stalledCount"] == 1
    stalls = [(s["worker"], s["counted"]) for s in result.delivery["stalls"]]
    assert stalls == [("dead-worker", True), (transport.instance_id, False)]
    assert [r.step_id for rs in seen.results.values() for r in rs].count("suspect") == 1
    # a claim dropped before it started is no duplicate execution and no lost lease report
    assert transport.health.worker_status().duplicates == 0
    assert errors.seen == []


async def test_without_isolation_a_suspect_runs_beside_the_others(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = MemoryBroker()
    seen = Timeline()
    async with dt.open_queue_transport(
        backend_with(broker),
        concurrency=4,
        stalled_threshold=THRESHOLD,
        isolate_suspects=False,
        on_error=Errors(),
    ) as transport:
        await make_suspect(broker, transport, "suspect")
        began = trio.current_time()
        await transport.dispatch(task("a", 10.0))
        transport.handle("step", seen.step)
        await trio.sleep(30)
    assert seen.spans["suspect"][0] - began == 0.0


async def test_a_suspect_on_a_single_slot_runs_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = MemoryBroker()
    seen = Timeline()
    async with dt.open_queue_transport(
        backend_with(broker), concurrency=1, stalled_threshold=THRESHOLD, on_error=Errors()
    ) as transport:
        await make_suspect(broker, transport, "suspect")
        began = trio.current_time()
        transport.handle("step", seen.step)
        await trio.sleep(5)
    assert seen.spans["suspect"] == (began, began + 1.0)
