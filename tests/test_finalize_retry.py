"""A worker's finalize (complete, fail, hand back) that meets an unreachable broker (a
connection lost, a Redis failover under way) is tried again with a bounded backoff while the
claim is still ours, instead of leaving the job to the reclaim sweep and a second run (issue
17). Fault injection at the broker call, exact virtual times (memory)."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

import trio
import trio.testing

import durable_trio as dt
from durable_trio import App, WorkflowContext, open_engine, open_worker
from durable_trio._outages import PER_WINDOW, WINDOW
from durable_trio.backends import Backend
from durable_trio.brokers.memory import MemoryBroker
from durable_trio.keys.memory import MemoryKeyStore
from helpers import Errors

if TYPE_CHECKING:
    from collections.abc import Sequence

    import pytest

    from durable_trio.brokers import Job, Lease

NO_JITTER = dt.Retry(max_attempts=3, initial=1.0, multiplier=1.0, jitter=0.0)


class OutageBroker(MemoryBroker):
    """A memory broker whose finalizes of step tasks fail (``BrokerUnavailable``, nothing
    done) until ``down_until``: a master failing over, seen from the worker."""

    down_until = 0.0
    failures = 0
    finalized_at: float | None = None
    """When a step task's finalize last got through."""

    def _check(self, queue: str) -> None:
        if ":tasks:" not in queue:
            return
        if trio.current_time() < self.down_until:
            self.failures += 1
            raise dt.BrokerUnavailable("injected: the master is failing over")
        self.finalized_at = trio.current_time()

    async def complete_job(self, lease: Lease, queue: str) -> bool:
        self._check(queue)
        return await super().complete_job(lease, queue)

    async def complete_many(self, queue: str, leases: Sequence[Lease]) -> list[bool]:
        self._check(queue)
        return await super().complete_many(queue, leases)

    async def push_and_complete_many(
        self, push_queue: str, jobs: Sequence[Job], queue: str, leases: Sequence[Lease]
    ) -> list[bool]:
        self._check(queue)
        return await super().push_and_complete_many(push_queue, jobs, queue, leases)

    async def retry_job(
        self, lease: Lease, queue: str, *, delay: float = 0.0, count_attempt: bool = True
    ) -> bool:
        self._check(queue)
        return await super().retry_job(lease, queue, delay=delay, count_attempt=count_attempt)


def app_with(log: list[tuple[int, float]], fail_first: bool) -> App:
    app = App("shop")

    @app.step("work", retry=NO_JITTER)
    async def work(x: int) -> int:
        info = dt.step_info()
        log.append((info.attempt, trio.current_time()))
        await trio.sleep(1)
        if fail_first and info.attempt == 1:
            raise RuntimeError("first attempt fails")
        return x * 2

    @app.workflow("one")
    async def one(ctx: WorkflowContext, x: int) -> Any:
        return await ctx.step("work", x)

    return app


def backoff_end(start: float, until: float) -> float:
    """When a finalize first tried at ``start`` succeeds with the broker down until ``until``
    (pauses 0.05, 0.1, 0.2, ... up to 2 s)."""
    at, delay = start, 0.05
    while at < until:
        at += delay
        delay = min(delay * 2, 2.0)
    return at


async def test_a_completion_that_meets_a_failover_is_retried_and_the_step_runs_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log: list[tuple[int, float]] = []
    broker = OutageBroker()
    broker.down_until = 3.0
    errors = Errors()
    if True:
        backend = Backend(url="memory://", broker=broker, keys=MemoryKeyStore())
        async with open_engine(app_with(log, False), backend, on_error=Errors()) as engine:
            await engine.start("one", 21, run_id="r")
            async with open_worker(app_with(log, False), backend, on_error=errors):
                assert await engine.result("r") == 42  # its result went out at 1
                assert trio.current_time() == 1.0
                await trio.sleep(300)  # past the stalled threshold: nothing runs again
            stats = engine.statistics()
    assert log == [(1, 0.0)]  # ran once: no reclaim, no second run
    assert broker.finalized_at == backoff_end(1.0, 3.0)
    assert broker.failures == 6
    # the first PER_WINDOW tries of the window reported, the rest folded (said when it works)
    assert sum("trying again" in m for m in errors.messages()) == PER_WINDOW
    assert (stats.duplicate_results, stats.lost_dispatches) == (0, 0)


async def test_a_failed_attempt_s_handback_is_retried_too(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The handler raised: its failed result goes out, the job's completion meets the outage
    and is tried again; the step's retry runs after its 1 s backoff, and nothing else."""
    log: list[tuple[int, float]] = []
    broker = OutageBroker()
    broker.down_until = 3.0
    if True:
        backend = Backend(url="memory://", broker=broker, keys=MemoryKeyStore())
        async with open_engine(app_with(log, True), backend, on_error=Errors()) as engine:
            await engine.start("one", 21, run_id="r")
            async with open_worker(app_with(log, True), backend, on_error=Errors()):
                assert await engine.result("r") == 42
                await trio.sleep(300)
            stats = engine.statistics()
    assert log == [(1, 0.0), (2, 2.0)]
    assert (stats.retries, stats.duplicate_results, stats.stale_results) == (1, 0, 0)
    assert broker.failures == 6


async def test_an_outage_longer_than_the_stalled_threshold_is_left_to_the_sweep(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Down for longer than ``stalled_threshold``: the finalize gives up (reported once as
    failed), the claim is reclaimed and the step runs again, as before."""
    log: list[tuple[int, float]] = []
    broker = OutageBroker()
    broker.down_until = 30.0
    errors = Errors()
    options: dict[str, Any] = {"stalled_threshold": 5.0, "stalled_check_interval": 1.0}
    if True:
        backend = Backend(url="memory://", broker=broker, keys=MemoryKeyStore())
        async with open_engine(app_with(log, False), backend, on_error=Errors()) as engine:
            await engine.start("one", 21, run_id="r")
            async with open_worker(app_with(log, False), backend, on_error=errors, **options):
                assert await engine.result("r") == 42
                await trio.sleep(60)
    assert len(log) >= 2  # run again once reclaimed
    assert any("finalizing failed:" in m for m in errors.messages())


async def test_the_finalize_retries_of_many_jobs_through_an_outage_are_folded(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Every job in flight retried its finalize through the outage, each try reported: 40 jobs
    through 30 s were ~700 lines (a SQLite disk full for 10 s under 8 jobs: 73). Folded as the
    engine's: PER_WINDOW reports per window, the next one counting the rest, and one WARNING
    when finalizing works again; every job still ran once."""
    jobs, down = 40, 30.0
    app = App("shop")
    ran: list[int] = []

    @app.step("work", retry=NO_JITTER)
    async def work(x: int) -> int:
        ran.append(x)
        await trio.sleep(1)
        return x

    @app.workflow("one")
    async def one(ctx: WorkflowContext, x: int) -> Any:
        return await ctx.step("work", x)

    caplog.set_level(logging.WARNING, logger="durable_trio")
    broker = OutageBroker()
    broker.down_until = down
    errors = Errors()
    backend = Backend(url="memory://", broker=broker, keys=MemoryKeyStore())
    async with open_engine(app, backend, on_error=Errors()) as engine:
        ids = [await engine.start("one", n, run_id=f"r{n}") for n in range(jobs)]
        async with open_worker(app, backend, concurrency=jobs, on_error=errors):
            assert [await engine.result(run_id) for run_id in ids] == list(range(jobs))
            await trio.sleep(down + 5)  # the completions go through once the broker is back
    assert sorted(ran) == list(range(jobs))  # each ran once: no reclaim
    tries = [m for m in errors.messages() if m.startswith("finalizing failed (trying again")]
    assert len(tries) <= PER_WINDOW * (int(down // WINDOW) + 1)  # a handful reported ...
    back = [r.getMessage() for r in caplog.records if "works again" in r.getMessage()]
    assert len(back) == 1
    assert back[0].startswith("finalizing works again (")
    # ... and the rest counted: every job tried again and again
    counted = [re.search(r"\(and (\d+) more failure", m) for m in tries]
    last = re.search(r"again \((\d+) failure", back[0])
    assert last is not None
    folded = sum(int(c.group(1)) for c in counted if c) + int(last.group(1))
    assert len(tries) + folded > 10 * jobs
