"""Leases under failure (T7-T10, docs/spec.md) on the memory broker, with exact virtual times."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio
import trio.testing

import durable_trio as dt
from durable_trio.brokers.memory import MemoryBroker
from durable_trio.keys.memory import MemoryKeyStore
from helpers import Errors, PausedRenewalBroker

if TYPE_CHECKING:
    from durable_trio.brokers import Job


def backend_with(broker: Any) -> dt.Backend:
    return dt.Backend(url="test://", broker=broker, keys=MemoryKeyStore())


def task(n: int = 1, seconds: float = 0.0) -> dt.RemoteTask:
    return dt.RemoteTask(run_id="run", step_id=f"s{n}", attempt=1, name="step", input=seconds)


async def test_t7_a_step_ten_times_the_threshold_is_never_redelivered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = MemoryBroker()
    errors = Errors()
    runs: list[float] = []
    results: list[dt.StepResult] = []
    async with dt.open_queue_transport(
        backend_with(broker), stalled_threshold=10.0, stalled_check_interval=1.0, on_error=errors
    ) as transport:

        async def long_step(t: dt.RemoteTask) -> str:
            runs.append(trio.current_time())
            await trio.sleep(100.0)
            return "done"

        async def on_result(r: dt.StepResult) -> None:
            results.append(r)

        transport.handle("step", long_step)
        transport.on_result(on_result)
        await transport.dispatch(task())
        await trio.sleep(150)
    assert runs == [0.0]
    assert [r.output for r in results] == ["done"]
    assert errors.seen == []


async def test_t9_a_silent_workers_job_comes_back_within_threshold_plus_one_sweep(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = MemoryBroker()
    async with dt.open_queue_transport(
        backend_with(broker), stalled_threshold=10.0, stalled_check_interval=5.0
    ) as transport:
        await transport.dispatch(task())
        # a worker claims it and dies: nobody renews its claim
        dead = await broker.pop_from(transport.names.task_queue("step"), worker="dead-worker")
        assert dead is not None
        ran_at: list[float] = []

        async def step(t: dt.RemoteTask) -> None:
            ran_at.append(trio.current_time())

        transport.handle("step", step)
        await trio.sleep(60)
    # sweeps at 5, 10, 15: at 15 the claim is 15 s old (> 10): redelivered then
    assert ran_at == [15.0]
    assert ran_at[0] <= 10.0 + 5.0


async def test_t9_the_fourth_stall_fails_the_job_and_publishes_a_retryable_failure(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shared = MemoryBroker()
    broker = PausedRenewalBroker(shared)
    broker.paused = True  # this worker's renewal never reaches the broker
    errors = Errors()
    starts: list[float] = []
    results: list[dt.StepResult] = []
    async with dt.open_queue_transport(
        backend_with(broker),
        concurrency=10,
        stalled_threshold=10.0,
        stalled_check_interval=5.0,
        # One process plays every worker the job stalls on, its hung handlers still running:
        # a suspect would wait for them to run alone (tests/test_suspects.py), not beside them.
        isolate_suspects=False,
        on_error=errors,
        instance_id="worker-1",
    ) as transport:

        async def hangs(t: dt.RemoteTask) -> None:
            starts.append(trio.current_time())
            await trio.sleep_forever()

        async def on_result(r: dt.StepResult) -> None:
            results.append(r)

        transport.handle("step", hangs)
        transport.on_result(on_result)
        await transport.dispatch(task())
        await trio.sleep(100)
        queue = transport.names.task_queue("step")
        (failed,) = await shared.failed_jobs(queue)
    assert starts == [0.0, 15.0, 30.0, 45.0]
    (result,) = results
    assert result.status is dt.StepStatus.FAILED
    assert result.error is not None
    assert result.error.code == "stalled"
    assert result.error.retryable is True
    assert result.error.message == "stalled more than 3 times"
    assert result.error.details["stalledCount"] == 4
    assert [s["worker"] for s in result.error.details["stalls"]] == ["worker-1"] * 4
    assert [s["at"] for s in result.error.details["stalls"]] == [15.0, 30.0, 45.0, 60.0]
    assert failed.error == "stalled more than 3 times"
    assert failed.stalled_count == 4
    assert any("poison job failed" in m for m in errors.messages())
    # poison evidence: the last liveness snapshot of the worker that held it
    last = result.error.details["workers"]["worker-1"]
    assert last["status"]["inFlight"] == 4
    assert last["status"]["limit"] == 10
    assert "rssBytes" in last["status"]


class _ResultPushFails(PausedRenewalBroker):
    """Fault injection: the next ``failures`` pushes onto a results queue fail."""

    failures = 1

    async def push_on(
        self, queue: str, job: Job, *, priority: int | None = None, delay: float = 0.0
    ) -> None:
        if queue.endswith(":results") and self.failures:
            self.failures -= 1
            raise dt.BrokerError("injected: the results push failed")
        await super().push_on(queue, job, priority=priority, delay=delay)


async def test_t9_a_poison_task_whose_failure_result_cannot_be_published_is_tried_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The job is failed FIRST and its failure result published only then (the reference's
    order): when the publish fails, the job stays failed and the result is published again at
    the next sweep, so the run still gets its answer."""
    shared = MemoryBroker()
    broker = _ResultPushFails(shared)
    broker.paused = True
    errors = Errors()
    results: list[tuple[float, dt.StepResult]] = []
    async with dt.open_queue_transport(
        backend_with(broker),
        concurrency=10,
        stalled_threshold=10.0,
        stalled_check_interval=5.0,
        # One process plays every worker the job stalls on, its hung handlers still running:
        # a suspect would wait for them to run alone (tests/test_suspects.py), not beside them.
        isolate_suspects=False,
        on_error=errors,
    ) as transport:

        async def hangs(t: dt.RemoteTask) -> None:
            await trio.sleep_forever()

        async def on_result(r: dt.StepResult) -> None:
            results.append((trio.current_time(), r))

        transport.handle("step", hangs)
        transport.on_result(on_result)
        await transport.dispatch(task())
        await trio.sleep(62)
        assert results == []  # the 4th stall (at 60) failed the job; its result did not go out
        (failed,) = await shared.failed_jobs(transport.names.task_queue("step"))
        await trio.sleep(30)
    ((at, result),) = results
    assert at == 65.0  # the next sweep published it
    assert (result.status, result.error and result.error.code) == (dt.StepStatus.FAILED, "stalled")
    assert failed.stalled_count == 4
    assert any("was not published, tried again at the next sweep" in m for m in errors.messages())


class _FailJobFails(PausedRenewalBroker):
    """Fault injection: the next ``failures`` fail_job calls raise."""

    failures = 1

    async def fail_job(self, lease: Any, queue: str, error: str) -> bool:
        if self.failures:
            self.failures -= 1
            raise dt.BrokerError("injected: fail_job failed")
        return await super().fail_job(lease, queue, error)


async def test_t9_the_poison_bridge_publishes_nothing_until_the_job_is_failed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Failing the poison job fails at 60: no StepResult goes out. The job stays claimed by the
    sweep (re-leased at 60), so the sweep at 75 finds it again, fails it, and only then
    publishes the failed result."""
    shared = MemoryBroker()
    broker = _FailJobFails(shared)
    broker.paused = True
    results: list[tuple[float, dt.StepResult]] = []
    async with dt.open_queue_transport(
        backend_with(broker),
        concurrency=10,
        stalled_threshold=10.0,
        stalled_check_interval=5.0,
        # One process plays every worker the job stalls on, its hung handlers still running:
        # a suspect would wait for them to run alone (tests/test_suspects.py), not beside them.
        isolate_suspects=False,
        on_error=Errors(),
    ) as transport:

        async def hangs(t: dt.RemoteTask) -> None:
            await trio.sleep_forever()

        async def on_result(r: dt.StepResult) -> None:
            results.append((trio.current_time(), r))

        transport.handle("step", hangs)
        transport.on_result(on_result)
        await transport.dispatch(task())
        await trio.sleep(70)
        assert results == []
        assert await shared.failed_jobs(transport.names.task_queue("step")) == []
        await trio.sleep(30)
        (failed,) = await shared.failed_jobs(transport.names.task_queue("step"))
    ((at, result),) = results
    assert at == 75.0
    assert result.error is not None
    assert result.error.code == "stalled"
    # the sweep's own lease (60 to 75) was no delivery: no stall added for it
    assert failed.stalled_count == 4
    assert len(failed.stalls) == 4
    assert failed.failed_at == 75.0


async def test_t10_a_result_push_that_fails_is_retried_the_step_never_runs_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A step that ran keeps its result: a failing result push is retried with a backoff
    (0.05, 0.1, 0.2 ... s) while the claim is held, never turned into a handback that runs the
    step again (and, after max_job_attempts, failed it with no answer for its run; found by
    the simulation harness under a storm of dropped calls)."""
    shared = MemoryBroker()
    broker = _ResultPushFails(shared)
    broker.failures = 7  # more than max_job_attempts (5)
    errors = Errors()
    runs: list[float] = []
    results: list[tuple[float, dt.StepResult]] = []
    async with dt.open_queue_transport(backend_with(broker), on_error=errors) as transport:

        async def step(t: dt.RemoteTask) -> str:
            runs.append(trio.current_time())
            return "done"

        async def on_result(r: dt.StepResult) -> None:
            results.append((trio.current_time(), r))

        transport.handle("step", step)
        transport.on_result(on_result)
        await transport.dispatch(task())
        await trio.sleep(60)
    assert runs == [0.0]
    ((at, result),) = results
    assert at == 0.05 + 0.1 + 0.2 + 0.4 + 0.8 + 1.6 + 3.2
    assert result.output == "done"
    assert sum("publishing the result of step" in m for m in errors.messages()) == 7


async def test_t10_a_handler_that_meets_a_broker_error_is_never_failed_for_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A result handler whose run store is down raises a broker error: that is the store's
    fault, not the handler's, so it does not count toward max_job_attempts (5) — the result
    comes back every second until it is applied, and is never failed (which lost its run)."""
    broker = MemoryBroker()
    calls: list[float] = []
    async with dt.open_queue_transport(backend_with(broker), on_error=Errors()) as transport:

        async def on_result(r: dt.StepResult) -> None:
            calls.append(trio.current_time())
            if len(calls) <= 7:
                raise dt.BrokerUnavailable("the run store is down")

        transport.on_result(on_result)
        await transport.publish_result(dt.StepResult("r", "s", 1, dt.StepStatus.COMPLETED))
        await trio.sleep(20)
        assert await broker.failed_jobs(transport.names.results) == []
    assert calls == [float(n) for n in range(8)]


async def test_t9_a_stalled_result_is_set_aside_past_the_limit_and_its_step_answered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A result (like every engine or pod input) whose handler keeps stalling is redelivered
    after each of its first max_stalled_count (3) stalls and set aside at the next: failed,
    inspectable in the broker's failed set, never redelivered again (it used to loop
    forever). Its step is not left waiting: the sweep answers it with a retryable failed
    result for the same attempt (code ``result_set_aside``), so the engine tries it again."""
    shared = MemoryBroker()
    broker = PausedRenewalBroker(shared)
    broker.paused = True
    errors = Errors()
    starts: list[float] = []
    answers: list[tuple[float, dt.StepResult]] = []
    async with dt.open_queue_transport(
        backend_with(broker),
        result_concurrency=10,
        stalled_threshold=10.0,
        stalled_check_interval=5.0,
        on_error=errors,
    ) as transport:

        async def hangs(r: dt.StepResult) -> None:
            if r.status is dt.StepStatus.FAILED:
                answers.append((trio.current_time(), r))
                return
            starts.append(trio.current_time())
            await trio.sleep_forever()

        transport.on_result(hangs)
        await transport.publish_result(dt.StepResult("r", "s", 1, dt.StepStatus.COMPLETED))
        await trio.sleep(100)
        (failed,) = await shared.failed_jobs(transport.names.results)
        assert await shared.size_of(transport.names.results) == 0
    # claimed at 0, stale after 10, swept on the 5 s grid: back at 15, 30, 45; set aside at 60
    assert starts == [0.0, 15.0, 30.0, 45.0]
    assert failed.error == "stalled more than 3 times"
    assert (failed.stalled_count, failed.failed_at) == (4, 60.0)
    assert [s.counted for s in failed.stalls] == [True] * 4
    assert any("poison job failed" in m for m in errors.messages())
    ((at, answer),) = answers
    assert at == 60.0
    assert (answer.run_id, answer.step_id, answer.attempt) == ("r", "s", 1)
    assert answer.error is not None
    assert (answer.error.code, answer.error.retryable) == ("result_set_aside", True)
    assert answer.error.details["stalledCount"] == 4


async def test_t9_the_sweep_is_off_at_interval_zero(autojump_clock: trio.testing.MockClock) -> None:
    broker = MemoryBroker()
    async with dt.open_queue_transport(
        backend_with(broker), stalled_threshold=10.0, stalled_check_interval=0
    ) as transport:
        await transport.dispatch(task())
        await broker.pop_from(transport.names.task_queue("step"), worker="dead")

        async def step(t: dt.RemoteTask) -> None:
            raise AssertionError("never redelivered without a sweep")

        transport.handle("step", step)
        await trio.sleep(600)


async def test_t8_a_lost_lease_cancels_the_handler_and_its_result_never_lands(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shared = MemoryBroker()
    slow_broker = PausedRenewalBroker(shared)
    errors_a = Errors()
    results: list[dt.StepResult] = []
    a_cancelled_at: list[float] = []
    async with (
        dt.open_queue_transport(
            backend_with(slow_broker),
            stalled_threshold=10.0,
            stalled_check_interval=5.0,
            on_error=errors_a,
            instance_id="a",
        ) as worker_a,
        dt.open_queue_transport(
            backend_with(shared),
            stalled_threshold=10.0,
            stalled_check_interval=5.0,
            instance_id="b",
        ) as worker_b,
    ):

        async def step_a(t: dt.RemoteTask) -> str:
            try:
                await trio.sleep(1000)
            except trio.Cancelled:
                a_cancelled_at.append(trio.current_time())
                raise
            return "a"

        async def step_b(t: dt.RemoteTask) -> str:
            await trio.sleep(1)
            return "b"

        async def on_result(r: dt.StepResult) -> None:
            results.append(r)

        worker_a.handle("step", step_a)
        worker_b.on_result(on_result)
        await worker_a.dispatch(task())
        await trio.sleep(1)
        slow_broker.paused = True  # a's event loop "blocks": its claim stops being renewed
        worker_b.handle("step", step_b)
        await trio.sleep(15)  # t=16: the sweep at 15 gave the job to b
        slow_broker.paused = False
        await trio.sleep(30)
        assert worker_a.statistics().duplicates == 1
    # a's next renewal (t=20) finds the claim gone: exactly that handler is cancelled
    assert a_cancelled_at == [20.0]
    assert [r.output for r in results] == ["b"]
    lost = [e for e in errors_a.seen if isinstance(e, dt.LeaseLost)]
    assert len(lost) == 1
    assert "may run twice" in str(lost[0])


async def test_t8_a_lost_lease_may_be_left_to_finish_but_never_finalizes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shared = MemoryBroker()
    slow_broker = PausedRenewalBroker(shared)
    finished_a: list[float] = []
    async with (
        dt.open_queue_transport(
            backend_with(slow_broker),
            stalled_threshold=10.0,
            stalled_check_interval=5.0,
            cancel_on_lost_lease=False,
            on_error=Errors(),
        ) as worker_a,
        dt.open_queue_transport(
            backend_with(shared), stalled_threshold=10.0, stalled_check_interval=5.0
        ) as worker_b,
    ):

        async def step_a(t: dt.RemoteTask) -> str:
            await trio.sleep(30)
            finished_a.append(trio.current_time())
            return "a"

        async def step_b(t: dt.RemoteTask) -> str:
            await trio.sleep(100)  # b still holds the new claim when a finishes
            return "b"

        worker_a.handle("step", step_a)
        await worker_a.dispatch(task())
        await trio.sleep(1)
        slow_broker.paused = True
        worker_b.handle("step", step_b)
        await trio.sleep(15)
        slow_broker.paused = False
        await trio.sleep(20)  # t=36: a finished at 30; its outcome was discarded
        queue = worker_a.names.task_queue("step")
        assert finished_a == [30.0]
        # b's claim is intact: a's finish did not complete it
        assert await shared.size_of(queue) == 0
        assert worker_b.statistics().open_claims == 1


async def test_t10_handback_on_close_counts_neither_a_stall_nor_an_attempt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = MemoryBroker()
    async with dt.open_queue_transport(backend_with(broker), close_timeout=1.0) as transport:
        started = trio.Event()

        async def step(t: dt.RemoteTask) -> None:
            started.set()
            await trio.sleep_forever()

        transport.handle("step", step)
        await transport.dispatch(task())
        await started.wait()
    again = await broker.pop_from(transport.names.task_queue("step"))
    assert again is not None
    assert (again.attempts, again.stalled_count, again.stalls) == (0, 0, ())
