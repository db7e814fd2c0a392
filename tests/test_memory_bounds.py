"""What a long-running worker and engine keep in memory stays bounded, whatever the number of
steps and runs they served: the concurrency controller's figures, the memory broker's claim
index, the transport's claim table and coalescers, the engine's per-run maps (a remote run's
decision lock among them), the memory key store.

Each test counts entries in the structures (never RSS or timing): N settles or N runs later,
the largest container an object holds is no longer than a fixed bound, or empty.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio._engine import (
    App,
    RunRecord,
    RunStatus,
    WorkflowContext,
    open_engine,
    open_worker,
)
from durable_trio._engine._remote_run import RemoteRunDriver, apply_decision
from durable_trio._transport._adaptive import ConcurrencyController
from durable_trio.brokers import Job
from durable_trio.brokers.memory import MemoryBroker
from durable_trio.keys.memory import MemoryKeyStore

#: The p95 sample ring is the largest structure the controller keeps by design.
_CONTROLLER_BOUND = 512


def largest_container(obj: object) -> int:
    """The length of the longest list, deque, dict or set among ``obj``'s attributes."""
    return max(
        (len(v) for v in vars(obj).values() if isinstance(v, list | deque | dict | set)),
        default=0,
    )


def settle_many(controller: ConcurrencyController, count: int, *, tick_every: int = 0) -> None:
    """``count`` steps of 5 ms, one every 10 ms of (trio) clock, with a tick every
    ``tick_every`` settles (0: none, as with a fixed limit)."""
    for n in range(count):
        controller.on_start()
        controller.on_settle(n * 0.01, n * 0.01 + 0.005)
        if tick_every and n % tick_every == tick_every - 1:
            controller.adjust(1.0)


def test_a_fixed_limit_keeps_no_growing_state() -> None:
    """A fixed limit never ticks, so nothing empties a per-tick list: it must keep none."""
    controller = ConcurrencyController(8, read_rss=lambda: 0, read_cpu_time=lambda: 0.0)
    settle_many(controller, 100_000)
    assert largest_container(controller) <= _CONTROLLER_BOUND
    assert controller.in_flight == 0


def test_the_adaptive_controller_keeps_a_bounded_window() -> None:
    policy = dt.Adaptive(min=1, max=64, long_window=50)
    controller = ConcurrencyController(policy, read_rss=lambda: 0, read_cpu_time=lambda: 0.0)
    settle_many(controller, 100_000, tick_every=100)  # a thousand ticks
    assert largest_container(controller) <= _CONTROLLER_BOUND
    assert len(controller._baseline) == 50


async def test_throughput_counts_the_steps_of_the_last_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Counted per second: what fell out of the window no longer counts."""
    controller = ConcurrencyController(4, read_rss=lambda: 0, read_cpu_time=lambda: 0.0)
    for _ in range(20):  # 20 steps in the first second
        controller.on_start()
        controller.on_settle(0.0, trio.current_time())
    await trio.sleep(5)
    for _ in range(30):  # 30 more at 5 s
        controller.on_start()
        controller.on_settle(trio.current_time(), trio.current_time())
    assert controller.throughput() == 5.0  # 50 steps over the last 10 s
    await trio.sleep(6)  # at 11 s: the first second's steps left the window
    assert controller.throughput() == 3.0
    assert controller.throughput(window=20.0) == 2.5
    await trio.sleep(100)
    assert controller.throughput() == 0.0
    assert len(controller._settled) <= 2  # two seconds saw steps: a counter each


async def test_the_memory_broker_drops_finalized_claims_from_its_age_index(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The stalled sweep finds old claims through an age heap; a finished claim must leave it
    without waiting for a sweep to pop it."""
    broker = MemoryBroker()
    for n in range(10_000):
        await broker.push_on("q", Job(id=str(n), data=b"{}"))
        (claim,) = await broker.pop_many("q", 1)
        assert await broker.complete_job(claim.lease, "q")
    queue = broker._queues["q"]
    assert not queue.active
    assert len(queue.by_age) <= 64


async def test_a_transport_keeps_no_per_job_state_after_many_round_trips(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = MemoryBroker()
    backend = dt.Backend(url="test://", broker=broker, keys=MemoryKeyStore())
    jobs = 5_000
    received = 0
    all_in = trio.Event()

    async def noop(task: dt.RemoteTask) -> None:
        return None

    async def on_result(result: dt.StepResult) -> None:
        nonlocal received
        received += 1
        if received == jobs:
            all_in.set()

    async with dt.open_queue_transport(backend, namespace="soak", concurrency=16) as transport:
        transport.handle("noop", noop)
        transport.on_result(on_result)
        for n in range(jobs):
            await transport.dispatch(
                dt.RemoteTask(run_id=f"run-{n}", step_id="s", attempt=1, name="noop")
            )
        await all_in.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert transport._runner.claims == {}
        assert largest_container(transport._controller) <= _CONTROLLER_BOUND
        for queue in broker._queues.values():
            assert not queue.active
            assert len(queue.by_age) <= 64
        # one coalescer per queue served, whatever the number of jobs
        assert len(transport._producers._finishers) + len(transport._producers._completers) <= 4


app = App("memory-bounds")


@app.step("echo")
async def echo(value: Any) -> Any:
    return value


@app.workflow("one-step")
async def one_step(ctx: WorkflowContext, value: int) -> int:
    result: int = await ctx.step("echo", value)
    return result


@app.workflow("one-step-remote", remote=True)
async def one_step_remote(ctx: WorkflowContext, value: int) -> int:
    result: int = await ctx.step("echo", value)
    return result


@pytest.mark.parametrize("workflow", ["one-step", "one-step-remote"])
async def test_the_engine_keeps_no_per_run_state_once_runs_finish(
    workflow: str, autojump_clock: trio.testing.MockClock
) -> None:
    """A remote run's decisions take a per-run lock that its driver waits on too: the last
    to let go of it must drop it, or every remote run leaves one behind."""
    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend, namespace="bounds", concurrency=16) as worker:
            async with open_engine(app, backend, namespace="bounds") as engine:

                async def one(n: int) -> None:
                    assert await engine.result(await engine.start(workflow, n)) == n

                for batch in range(6):
                    async with trio.open_nursery() as nursery:
                        for n in range(batch * 100, batch * 100 + 100):
                            nursery.start_soon(one, n)
                await trio.testing.wait_all_tasks_blocked()
                assert engine._services.drivers == {}
                assert len(engine._services.waiters) == 0
                assert len(engine._services.applying) == 0
                assert len(engine._services.decision_locks) == 0
                assert largest_container(engine.transport._controller) <= _CONTROLLER_BOUND
                assert largest_container(worker.transport._controller) <= _CONTROLLER_BOUND
            assert worker._scopes == {}


class CoalescingMemoryBroker(MemoryBroker):
    """The memory broker with its pushes coalesced, as the transport does for SQLite and
    Redis (where a pusher per destination queue exists)."""

    coalesce_finalize = True


async def test_the_control_plane_forgets_the_inbox_of_a_pod_that_went_away(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A pod's inbox gets a pusher on the control plane; once the janitor drained the inbox of
    a pod that went away, the pusher goes too (pods come and go: one each would add up)."""
    broker, keys = CoalescingMemoryBroker(), MemoryKeyStore()
    async with dt.open_queue_transport(
        dt.Backend(url="test://", broker=broker, keys=keys),
        instance_id="control",
        inbox_sweep_interval=30,
        tenant_subscribers_cache=0,
    ) as control:
        async with dt.open_queue_transport(
            dt.Backend(url="test://", broker=broker, keys=None), instance_id="pod", inbox_ttl=15
        ) as pod:
            pod.remote.on_tenant_event("acme", lambda event: None)
            await trio.sleep(1)
            pod.remote._registry.active = False  # the pod "crashes": it stops announcing
            for loop in pod._consumers.loops:  # ... and its inbox loops stop consuming
                if loop.inbox and loop.pop_scope is not None:
                    loop.pop_scope.cancel()
            await trio.lowlevel.checkpoint()
            await control.remote.publish_tenant_event(dt.TenantEvent("acme", "k", "r"))
            inbox = control.names.tenant_events("pod")
            assert inbox in control._producers._pushers
            await trio.sleep(40)  # the registration expired at 16; the sweep at 30 drained it
            assert await broker.size_of(inbox) == 0
            assert inbox not in control._producers._pushers
            assert control.remote._registry._pushed == {}


class GatedRunStore:
    """A run store whose ``get_run`` waits for ``gate`` (fault injection at one point: a
    decision being applied holds its run's lock until the test lets it go)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.gate = trio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def get_run(self, run_id: str) -> Any:
        await self.gate.wait()
        return await self.inner.get_run(run_id)


async def test_a_decision_lock_handed_to_the_runs_driver_is_dropped_by_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A decision holds its run's lock; the driver waits for it; the release hands the lock
    to the driver, so the decision finds it still locked: the driver must drop it."""
    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend, namespace="locks") as engine:
            gated = GatedRunStore(engine.store)
            engine._services.store = gated  # what the drivers and decisions read
            decision = dt.WorkflowDecision(
                task_id="t", run_id="r", status=dt.DecisionStatus.COMPLETED
            )
            run = RunRecord(
                run_id="r",
                workflow="one-step-remote",
                input=None,
                status=RunStatus.RUNNING,
                created_at=0.0,
                updated_at=0.0,
            )
            driver = RemoteRunDriver(engine._services, run, [])
            async with trio.open_nursery() as nursery:
                nursery.start_soon(apply_decision, engine._services, decision)
                await trio.testing.wait_all_tasks_blocked()
                lock = engine._services.decision_locks.get("r")
                assert lock is not None
                assert lock.locked()
                nursery.start_soon(driver._settled_decisions)
                await trio.testing.wait_all_tasks_blocked()
                gated.gate.set()
            assert len(engine._services.decision_locks) == 0


async def test_the_memory_key_store_drops_expired_keys_without_a_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Transports come and go in one process: each leaves keys that expire (its last status
    lives a day). A store nobody reads must still let them go."""
    keys = MemoryKeyStore()
    for n in range(1_000):
        await keys.put(f"instance-{n}", b"{}", ttl=10)
        await keys.put_many([(f"beat-{n}", b"{}", 10), (f"status-{n}", b"{}", 10)])
        await trio.sleep(1)
    assert len(keys._keys) <= 2 * 64
