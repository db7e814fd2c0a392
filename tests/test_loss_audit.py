"""The engine's loss audit (issue 17): a step task or result the broker acknowledged and then
lost (a Redis failover without ``min_replicas``) is detected, reported and dispatched again;
a task that merely waits, or runs, is left alone. Exact virtual times on memory; the real
clock on a SQLite file and a private redis-server (the fault: the job taken off its queue
with no result, as a failover that lost the push leaves it)."""

from __future__ import annotations

import logging
import random
import typing
import uuid
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio import App, WorkflowContext, open_engine, open_worker
from durable_trio.backends import Backend
from durable_trio.brokers import Job, JobState, SupportsJobStates
from durable_trio.testing import BrokerFaults, Injector, wrap_broker
from helpers import Errors

if TYPE_CHECKING:
    from pathlib import Path

#: audit every 5 s; a job counts as lost once gone for 4 + 2 * 3 + 5 = 15 s (the reclaim bound
#: of a result claimed and never finalized, plus one round).
AUDIT: dict[str, Any] = {"audit_interval": 5, "stalled_threshold": 4, "stalled_check_interval": 3}


def audit_app(log: list[tuple[str, int, float]], seconds: float = 1.0) -> App:
    app = App("shop")

    @app.step("work")
    async def work(x: int) -> int:
        info = dt.step_info()
        log.append(("start", info.attempt, trio.current_time()))
        await trio.sleep(seconds)
        return x * 2

    @app.workflow("one")
    async def one(ctx: WorkflowContext, x: int) -> Any:
        return await ctx.step("work", x)

    return app


async def lose_task(backend: Backend, queue: str) -> None:
    """The fault: the task vanishes from its queue with no result (taken and finished by
    nobody's worker, as a failover that lost the engine's push leaves the queue)."""
    ghost = None
    with trio.fail_after(10):
        while ghost is None:  # (once the engine's driver dispatched it)
            await trio.testing.wait_all_tasks_blocked()
            ghost = await backend.broker.pop_from(queue, worker="ghost")
            if ghost is None:
                await trio.sleep(0.01)
    assert await backend.broker.complete_job(ghost.lease, queue)


async def test_job_states(broker: Any) -> None:
    """Every broker answers SupportsJobStates: one call for many jobs of one queue."""
    assert isinstance(broker, SupportsJobStates)
    broker = typing.cast("Any", broker)
    await broker.push_on("q", Job("a", b"{}"))
    await broker.push_on("q", Job("b", b"{}"))
    await broker.push_on("q", Job("c", b"{}"), delay=60)
    claimed = await broker.pop_from("q", worker="w1")
    assert claimed is not None
    assert await broker.job_states("q", ["c", "zz", "a", "b"]) == [
        JobState(claimed=False),
        None,
        JobState(claimed=True, worker="w1"),
        JobState(claimed=False),
    ]
    assert await broker.job_states("q", []) == []
    assert await broker.job_states("other", ["a"]) == [None]
    assert await broker.complete_job(claimed.lease, "q")
    assert await broker.job_states("q", ["a", "b"]) == [None, JobState(claimed=False)]


async def test_a_lost_task_is_detected_reported_and_dispatched_again(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Dispatched at 0 and lost at once: round 5 finds its job gone, round 20 (gone for the
    reclaim bound plus a round, 15 s) finds it still gone and unanswered: reported, dispatched
    again."""
    log: list[tuple[str, int, float]] = []
    app = audit_app(log)
    errors = Errors()
    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend, on_error=errors, **AUDIT) as engine:
            queue = engine.transport.names.task_queue("work")
            await engine.start("one", 21, run_id="r")
            await lose_task(backend, queue)
            async with open_worker(app, backend, on_error=Errors()):
                assert await engine.result("r") == 42
                assert trio.current_time() == 21.0
            stats = engine.statistics()
    assert log == [("start", 1, 20.0)]  # the same attempt, dispatched again at 20
    assert (stats.lost_dispatches, stats.steps_dispatched, stats.retries) == (1, 2, 0)
    assert stats.duplicate_completions == 0
    lost = [e for e in errors.seen if isinstance(e, dt.StepLost)]
    assert len(lost) == 1
    assert (lost[0].run_id, lost[0].step_id, lost[0].attempt, lost[0].queue) == (
        "r",
        "1",
        1,
        queue,
    )
    records = [r for r in caplog.records if getattr(r, "event", None) == "step.lost"]
    assert len(records) == 1
    assert records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert "run r" in message
    assert "step work" in message
    assert queue in message


async def test_a_lost_result_is_detected_and_the_step_runs_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The worker ran the step (0-1) and finished its job, but its result push was
    acknowledged and lost: round 5 finds the job gone, round 20 re-dispatches; it runs again."""
    log: list[tuple[str, int, float]] = []
    app = audit_app(log)
    async with dt.open_backend("memory://") as backend:
        injector = Injector("w", random.Random(1))
        injector.faults = BrokerFaults(lost_write_probability=1.0)
        lossy = Backend(url="memory://", broker=wrap_broker(backend.broker, injector))
        async with open_engine(app, backend, on_error=Errors(), **AUDIT) as engine:
            await engine.start("one", 21, run_id="r")
            async with open_worker(app, lossy, on_error=Errors(), instance_id="w"):
                await trio.sleep(2)
                assert injector.injected == 1  # the first result, lost
                injector.quiet_down()
                assert await engine.result("r") == 42
                assert trio.current_time() == 21.0
            stats = engine.statistics()
    assert log == [("start", 1, 0.0), ("start", 1, 20.0)]
    assert (stats.lost_dispatches, stats.results_applied) == (1, 1)


async def test_a_waiting_or_running_task_is_never_taken_for_lost(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A task no worker takes for 100 s (a backlog), then one that runs 100 s: the audit asks
    the broker every round and leaves both alone."""
    log: list[tuple[str, int, float]] = []
    app = audit_app(log, seconds=100.0)
    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend, on_error=Errors(), **AUDIT) as engine:
            await engine.start("one", 21, run_id="r")
            await trio.sleep(100)
            async with open_worker(app, backend, on_error=Errors()):
                assert await engine.result("r") == 42
            stats = engine.statistics()
    assert log == [("start", 1, 100.0)]
    assert (stats.lost_dispatches, stats.steps_dispatched) == (0, 1)


@pytest.mark.parametrize(("arrives", "lost"), [(19.5, 0), (20.5, 1)])
async def test_a_late_result_is_never_applied_twice(
    autojump_clock: trio.testing.MockClock, arrives: float, lost: int
) -> None:
    """The job finished at 0 and its result is held back (as a results queue stuck in a
    failover would) until ``arrives``. Just before round 20, the round that would call it
    lost, finds the step settled and leaves it alone. Just after, it was dispatched again: the
    late original result is applied, the second execution's result is a duplicate."""
    log: list[tuple[str, int, float]] = []
    app = audit_app(log, seconds=0.0)
    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend, on_error=Errors(), **AUDIT) as engine:
            queue = engine.transport.names.task_queue("work")
            await engine.start("one", 21, run_id="r")
            await trio.testing.wait_all_tasks_blocked()
            job = await backend.broker.pop_from(queue, worker="w")
            assert job is not None
            assert await backend.broker.complete_job(job.lease, queue)
            await trio.sleep(arrives)
            result = dt.StepResult("r", "1", 1, dt.StepStatus.COMPLETED, output=42)
            await engine.transport.publish_result(result)
            assert await engine.result("r") == 42
            async with open_worker(app, backend, on_error=Errors()):
                await trio.sleep(30)
            stats = engine.statistics()
    assert (stats.lost_dispatches, stats.steps_dispatched) == (lost, 1 + lost)
    assert stats.duplicate_completions == lost
    assert stats.results_applied == 1
    assert len(log) == lost


async def test_the_audit_can_be_turned_off(autojump_clock: trio.testing.MockClock) -> None:
    log: list[tuple[str, int, float]] = []
    app = audit_app(log)
    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend, on_error=Errors(), audit_interval=None) as engine:
            queue = engine.transport.names.task_queue("work")
            await engine.start("one", 21, run_id="r")
            await lose_task(backend, queue)
            async with open_worker(app, backend, on_error=Errors()):
                await trio.sleep(300)
            assert await engine.status("r") is dt.RunStatus.RUNNING
            assert engine.statistics().lost_dispatches == 0


@pytest.mark.parametrize(
    "kind", ["sqlite", "redis", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_a_lost_task_on_a_real_broker(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The same fault on a real SQLite file, a private redis-server and a private PostgreSQL
    (real clock: audit every 0.2 s, lost once gone for 0.5 + 2 * 0.1 + 0.2 s): the run
    completes, counted once."""
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'audit.db'}".replace("///", "////", 1)
    elif kind == "postgres":
        url = request.getfixturevalue("postgres_schema_url")
    else:
        url = request.getfixturevalue("redis_url")
    log: list[tuple[str, int, float]] = []
    app = audit_app(log, seconds=0.0)
    options: dict[str, Any] = {
        "audit_interval": 0.2,
        "stalled_threshold": 0.5,
        "stalled_check_interval": 0.1,
        "namespace": f"audit-{uuid.uuid4().hex[:8]}",
    }
    errors = Errors()
    async with dt.open_backend(url) as backend:
        async with open_engine(app, backend, on_error=errors, **options) as engine:
            queue = engine.transport.names.task_queue("work")
            await engine.start("one", 21, run_id="r")
            await lose_task(backend, queue)
            async with open_worker(app, backend, on_error=Errors(), namespace=options["namespace"]):
                with trio.fail_after(30):
                    assert await engine.result("r") == 42
            stats = engine.statistics()
    assert stats.lost_dispatches == 1
    assert len(log) == 1
    lost = [e for e in errors.seen if isinstance(e, dt.StepLost)]
    assert [(e.run_id, e.queue) for e in lost] == [("r", queue)]
