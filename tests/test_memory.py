"""What is specific to the memory broker (the contract itself runs in ``test_broker_contract.py``
and ``test_broker_model.py``): a closed broker refuses every call."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio.adapters import Job, Lease
from durable_trio.adapters.memory import MemoryBroker

Q = "t:tasks:memory"


async def test_every_call_on_a_closed_broker_raises_transport_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = MemoryBroker()
    await broker.push_on(Q, Job("1", b"{}"))
    claimed = await broker.pop_from(Q)
    assert claimed is not None
    lease = claimed.lease
    await broker.aclose()
    await broker.aclose()  # idempotent
    calls = [
        broker.push_on(Q, Job("2", b"{}")),
        broker.push_many(Q, [Job("3", b"{}")], [None]),
        broker.push_and_complete_many(Q, [Job("4", b"{}")], Q, [lease]),
        broker.pop_from(Q),
        broker.pop_many(Q, 2),
        broker.complete_job(lease, Q),
        broker.complete_many(Q, [lease]),
        broker.fail_job(lease, Q, "x"),
        broker.retry_job(lease, Q),
        broker.renew_jobs(Q, [Lease("1", "nope")]),
        broker.recover_stalled_jobs(Q, 1.0, 1),
        broker.size_of(Q),
        broker.failed_jobs(Q),
        broker.wait_for_work(Q),
    ]
    for call in calls:
        with pytest.raises(dt.TransportClosed):
            await call


async def test_a_close_wakes_a_waiter_which_then_raises(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = MemoryBroker()
    raised: list[BaseException] = []

    async def wait() -> None:
        try:
            await broker.wait_for_work(Q)
        except dt.TransportClosed as exc:
            raised.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        await broker.aclose()
    assert len(raised) == 1
    assert trio.current_time() == 0.0


async def test_a_closed_memory_backend_refuses_dispatch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with dt.open_backend("memory://") as backend:
        async with dt.open_queue_transport(backend) as transport:
            await transport.dispatch(dt.RemoteTask(run_id="r", step_id="s", attempt=1, name="job"))
    # The backend is closed: a transport opened on it cannot dispatch into the void.
    async with dt.open_queue_transport(backend) as late:
        with pytest.raises(dt.TransportClosed):
            await late.dispatch(dt.RemoteTask(run_id="r", step_id="s2", attempt=1, name="job"))
