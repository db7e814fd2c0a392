"""What is specific to the memory broker (the contract itself runs in ``test_broker_contract.py``
and ``test_broker_model.py``): a closed broker refuses every call."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio.brokers import Job, Lease
from durable_trio.brokers.memory import MemoryBroker

if TYPE_CHECKING:
    from pathlib import Path

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
    # The backend is closed: no transport opens on it to dispatch into the void.
    with pytest.raises(dt.BrokerUnavailable, match="the backend memory:// is closed"):
        async with dt.open_queue_transport(backend):
            pass  # pragma: no cover


@pytest.fixture(params=["memory", "sqlite"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def kind_clock(kind: str) -> trio.testing.MockClock:
    """Virtual; on SQLite jumping only after real idleness (its commits run in a thread)."""
    return trio.testing.MockClock(autojump_threshold=0 if kind == "memory" else 0.2)


async def test_a_closed_backend_refuses_an_engine_at_once_on_every_backend(
    kind_clock: trio.testing.MockClock, kind: str, tmp_path: Path
) -> None:
    """Issue 30, item 6: an engine opened on a closed ``memory://`` backend took ``start`` and
    then ``result`` never returned (nothing served the broker); SQLite refused at once. Now
    every backend refuses the same way: an engine, a worker or a run store on a closed backend
    raises ``BrokerUnavailable`` when it opens, at virtual time 0."""
    from durable_trio.testing._sample import sample_app

    app = sample_app("closed")
    url = "memory://" if kind == "memory" else f"sqlite:///{tmp_path / 'c.db'}"
    async with dt.open_backend(url) as backend:
        pass
    assert backend.closed
    with pytest.raises(dt.BrokerUnavailable, match="is closed"):
        async with dt.open_engine(app, backend) as engine:
            await engine.start("order", 1)  # pragma: no cover
    with pytest.raises(dt.BrokerUnavailable, match="is closed"):
        async with dt.open_worker(app, backend):
            pass  # pragma: no cover
    with pytest.raises(dt.BrokerUnavailable, match="is closed"):
        async with dt.open_run_store(backend, "closed"):
            pass  # pragma: no cover
    assert trio.current_time() == 0.0
