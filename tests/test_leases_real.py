"""Leases under failure (T7-T10, docs/spec.md) on the brokers with a real clock (SQLite,
Redis): the same four rules as tests/test_leases.py, on short real thresholds (bounds, not
exact times: a server's clock does not follow trio's MockClock)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from durable_trio.brokers import Lease, RenewOutcome
from helpers import Errors

if TYPE_CHECKING:
    from pathlib import Path

THRESHOLD = 0.3
CHECK = 0.1
SLACK = 0.25  # a poll, a wake-up, a loaded CI machine


@pytest.fixture(params=["sqlite", "redis", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return "sqlite:///" + str(tmp_path / "leases.db")
    if request.param == "postgres":
        return str(request.getfixturevalue("postgres_schema_url"))
    return str(request.getfixturevalue("redis_url"))


class PausedRenewal:
    """Delegates to a real broker; while ``paused``, renewal answers "all renewed" without
    renewing anything (a worker whose event loop is blocked, seen from the broker)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.paused = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def renew_jobs(self, queue: str, leases: list[Lease]) -> RenewOutcome:
        if self.paused:
            await trio.lowlevel.checkpoint()
            return RenewOutcome(renewed=len(leases))
        result: RenewOutcome = await self._inner.renew_jobs(queue, leases)
        return result


def options(**extra: Any) -> dict[str, Any]:
    return {
        "namespace": "leases",
        "stalled_threshold": THRESHOLD,
        "stalled_check_interval": CHECK,
        "poll_interval": 0.05,
        **extra,
    }


def task(n: int = 1) -> dt.RemoteTask:
    return dt.RemoteTask(run_id="run", step_id=f"s{n}", attempt=1, name="step")


async def test_t7_a_step_ten_times_the_threshold_is_never_redelivered(url: str) -> None:
    runs: list[float] = []
    results: list[dt.StepResult] = []
    errors = Errors()
    async with dt.open_backend(url) as backend:
        async with dt.open_queue_transport(backend, **options(on_error=errors)) as transport:

            async def long_step(t: dt.RemoteTask) -> str:
                runs.append(trio.current_time())
                await trio.sleep(10 * THRESHOLD)
                return "done"

            async def on_result(r: dt.StepResult) -> None:
                results.append(r)
                got.set()

            got = trio.Event()
            transport.handle("step", long_step)
            transport.on_result(on_result)
            await transport.dispatch(task())
            with trio.fail_after(10 * THRESHOLD + 5):
                await got.wait()
            await trio.sleep(2 * THRESHOLD)  # and no second run comes
    assert len(runs) == 1
    assert [r.output for r in results] == ["done"]
    assert errors.seen == []


async def test_t9_a_silent_workers_job_comes_back_within_threshold_plus_a_sweep(url: str) -> None:
    async with dt.open_backend(url) as backend:
        async with dt.open_queue_transport(backend, **options()) as transport:
            await transport.dispatch(task())
            dead = await backend.broker.pop_from(transport.names.task_queue("step"), worker="dead")
            assert dead is not None
            claimed_at = trio.current_time()
            ran = trio.Event()
            ran_at: list[float] = []

            async def step(t: dt.RemoteTask) -> None:
                ran_at.append(trio.current_time())
                ran.set()

            transport.handle("step", step)
            with trio.fail_after(5):
                await ran.wait()
    assert ran_at[0] - claimed_at <= THRESHOLD + CHECK + SLACK


async def test_t9_the_fourth_stall_fails_the_job_and_publishes_a_retryable_failure(
    url: str,
) -> None:
    errors = Errors()
    results: list[dt.StepResult] = []
    async with dt.open_backend(url) as real:
        paused = PausedRenewal(real.broker)
        paused.paused = True
        backend = dt.Backend(url=url, broker=paused, keys=real.keys)
        async with dt.open_queue_transport(
            backend,
            # one process plays every worker the job stalls on, its hung handlers still
            # running: a suspect would wait for them to run alone (tests/test_suspects.py)
            **options(concurrency=10, on_error=errors, instance_id="w-1", isolate_suspects=False),
        ) as transport:

            async def hangs(t: dt.RemoteTask) -> None:
                await trio.sleep_forever()

            async def on_result(r: dt.StepResult) -> None:
                results.append(r)
                got.set()

            got = trio.Event()
            transport.handle("step", hangs)
            transport.on_result(on_result)
            await transport.dispatch(task())
            with trio.fail_after(10):
                await got.wait()
            (failed,) = await real.broker.failed_jobs(transport.names.task_queue("step"))  # type: ignore[attr-defined]
    (result,) = results
    assert result.error is not None
    assert (result.error.code, result.error.retryable) == ("stalled", True)
    assert result.error.details["stalledCount"] == 4
    assert failed.stalled_count == 4


async def test_t8_a_lost_lease_cancels_the_handler_and_its_result_never_lands(
    url: str,
) -> None:
    errors_a = Errors()
    results: list[dt.StepResult] = []
    cancelled = trio.Event()
    async with dt.open_backend(url) as real:
        paused = PausedRenewal(real.broker)
        slow = dt.Backend(url=url, broker=paused, keys=real.keys)
        async with (
            dt.open_queue_transport(slow, **options(on_error=errors_a, instance_id="a")) as a,
            dt.open_queue_transport(real, **options(instance_id="b")) as b,
        ):
            started_a = trio.Event()

            async def step_a(t: dt.RemoteTask) -> str:
                started_a.set()
                try:
                    await trio.sleep(60)
                except trio.Cancelled:
                    cancelled.set()
                    raise
                return "a"

            async def step_b(t: dt.RemoteTask) -> str:
                return "b"

            async def on_result(r: dt.StepResult) -> None:
                results.append(r)
                got.set()

            got = trio.Event()
            a.handle("step", step_a)
            b.on_result(on_result)
            await a.dispatch(task())
            await started_a.wait()
            paused.paused = True  # a's event loop "blocks": its claim stops being renewed
            b.handle("step", step_b)
            with trio.fail_after(5):
                await got.wait()
            paused.paused = False
            with trio.fail_after(5):
                await cancelled.wait()  # a's next renewal finds the claim gone
            assert a.statistics().duplicates == 1
    assert [r.output for r in results] == ["b"]
    assert any(isinstance(e, dt.LeaseLost) for e in errors_a.seen)
