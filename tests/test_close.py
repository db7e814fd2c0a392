"""T24 (docs/spec.md): the bounded, deterministic close, phase by phase, with exact virtual
times."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import hypothesis.strategies as st
import pytest
import trio
import trio.testing
from hypothesis import given

import durable_trio as dt
from durable_trio._transport._claims import ClaimState
from durable_trio.keys.memory import MemoryKeyStore
from helpers import CountingBroker, Errors, HangingBroker

if TYPE_CHECKING:
    from pathlib import Path


def backend_with(broker: Any) -> dt.Backend:
    return dt.Backend(url="test://", broker=broker, keys=MemoryKeyStore())


def task(name: str, n: int, seconds: float) -> dt.RemoteTask:
    return dt.RemoteTask(run_id="r", step_id=f"s{n}", attempt=1, name=name, input=seconds)


class Sleeper:
    """A step that sleeps ``task.input`` seconds; ``started`` tells a test its job was taken."""

    def __init__(self) -> None:
        self.started = trio.Event()
        self.runs = 0

    async def __call__(self, t: dt.RemoteTask) -> Any:
        self.runs += 1
        self.started.set()
        await trio.sleep(t.input)
        return t.input


async def test_t24_close_waits_for_a_handler_that_finishes_in_budget(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A handler finishing 3 s into a 5 s budget lets close end at exactly 3 s, completed."""
    broker = CountingBroker()
    async with dt.open_queue_transport(backend_with(broker), close_timeout=5.0) as transport:
        sleeper = Sleeper()
        transport.handle("job", sleeper)
        await transport.dispatch(task("job", 1, 3.0))
        await sleeper.started.wait()  # the loop took it at t=0
        start = trio.current_time()
        await transport.aclose()
        assert trio.current_time() - start == 3.0
    assert broker.handbacks == []
    assert await broker.size_of(transport.names.task_queue("job")) == 0
    assert await broker.size_of(transport.names.results) == 1


async def test_t24_a_handler_that_closes_its_own_transport_does_not_wait_for_itself(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``aclose()`` from inside a handler starts the close and returns: the close waits for the
    handlers, so a handler waiting for the close would never end. It then finishes like any."""
    broker = CountingBroker()
    async with dt.open_queue_transport(backend_with(broker), close_timeout=5.0) as transport:
        returned_at: list[float] = []

        async def closes_then_works(t: dt.RemoteTask) -> None:
            await transport.aclose()
            returned_at.append(trio.current_time())
            await trio.sleep(1.0)

        transport.handle("job", closes_then_works)
        await transport.dispatch(task("job", 1, 0.0))
        with trio.fail_after(60):
            await transport._closed.wait()
    assert returned_at == [0.0]
    assert trio.current_time() == 1.0  # the close waited for the handler's last second
    assert broker.handbacks == []
    assert await broker.size_of(transport.names.results) == 1


async def test_t24_a_long_handler_is_cancelled_at_the_deadline_and_handed_back_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A 60 s handler is cancelled at exactly 5 s; its claim goes back once, attempt unchanged."""
    broker = CountingBroker()
    cancelled_at: list[float] = []

    started = trio.Event()

    async def long_step(t: dt.RemoteTask) -> None:
        started.set()
        try:
            await trio.sleep(60)
        except trio.Cancelled:
            cancelled_at.append(trio.current_time())
            raise

    async with dt.open_queue_transport(backend_with(broker), close_timeout=5.0) as transport:
        transport.handle("job", long_step)
        await transport.dispatch(task("job", 1, 60))
        await started.wait()
        start = trio.current_time()
    assert trio.current_time() - start == 5.0
    assert cancelled_at == [start + 5.0]
    assert len(broker.handbacks) == 1
    (_, counted) = broker.handbacks[0]
    assert counted is False  # attempt-neutral
    again = await broker.inner.pop_from(transport.names.task_queue("job"))
    assert again is not None
    assert (again.attempts, again.stalled_count) == (0, 0)
    assert await broker.size_of(transport.names.results) == 0


async def test_t24_a_second_worker_finishes_what_the_first_handed_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with dt.open_backend("memory://") as backend:
        finished_by: list[str] = []

        async def step(t: dt.RemoteTask, me: str) -> None:
            await trio.sleep(t.input)
            finished_by.append(me)

        async with dt.open_queue_transport(backend, close_timeout=1.0, concurrency=4) as first:
            first.handle("job", lambda t: step(t, "first"))
            for n, seconds in enumerate([0.5, 30, 30]):
                await first.dispatch(task("job", n, seconds))
            await trio.sleep(0.1)
        closed_at = trio.current_time()
        async with dt.open_queue_transport(backend, concurrency=4) as second:
            second.handle("job", lambda t: step(t, "second"))
            await trio.sleep(31)
    assert finished_by == ["first", "second", "second"]
    assert closed_at == 1.1


async def test_t24_close_is_idempotent_and_hands_back_when_the_caller_is_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = CountingBroker()
    with trio.CancelScope() as outer:
        async with dt.open_queue_transport(backend_with(broker), close_timeout=2.0) as transport:
            sleeper = Sleeper()
            transport.handle("job", sleeper)
            await transport.dispatch(task("job", 1, 60))
            await sleeper.started.wait()
            start = trio.current_time()
            outer.cancel()  # the caller is cancelled: everything inside stops now ...
            await trio.sleep(1)
    assert outer.cancelled_caught
    assert trio.current_time() - start == 0.0
    assert len(broker.handbacks) == 1  # ... and the claim is still handed back, not lost
    again = await broker.inner.pop_from(transport.names.task_queue("job"))
    assert again is not None
    assert again.attempts == 0
    await transport.aclose()  # again: nothing happens
    assert len(broker.handbacks) == 1


async def test_t24_consumers_stop_first_no_new_job_is_taken(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = CountingBroker()
    async with dt.open_queue_transport(
        backend_with(broker), close_timeout=5.0, concurrency=1
    ) as transport:
        sleeper = Sleeper()
        transport.handle("job", sleeper)
        await transport.dispatch(task("job", 1, 2.0))
        await transport.dispatch(task("job", 2, 2.0))
        await sleeper.started.wait()
        start = trio.current_time()
    # the first finished at 2 s; the second never ran (the consumers stopped at once; if it
    # was claimed ahead, it was handed back, attempt-neutral)
    assert trio.current_time() - start == 2.0
    assert sleeper.runs == 1
    assert all(counted is False for _, counted in broker.handbacks)
    assert await broker.size_of(transport.names.task_queue("job")) == 1


async def test_t24_a_dead_broker_cannot_make_close_overrun_its_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Every cleanup phase is bounded: close_timeout plus the cleanup bounds, then done."""
    broker = HangingBroker()
    errors = Errors()
    async with dt.open_queue_transport(
        backend_with(broker), close_timeout=5.0, cleanup_timeout=2.0, on_error=errors
    ) as transport:
        sleeper = Sleeper()
        transport.handle("job", sleeper)
        await transport.dispatch(task("job", 1, 60))
        await sleeper.started.wait()
        broker.hang = True
        start = trio.current_time()
    elapsed = trio.current_time() - start
    # 5 s waiting for the handler, then the handback hangs for its 2 s bound
    assert elapsed == 7.0
    assert any("timed out" in m for m in errors.messages())


async def test_t24_a_handler_finishing_during_close_on_a_dead_broker_is_bounded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = HangingBroker()
    errors = Errors()
    async with dt.open_queue_transport(
        backend_with(broker), close_timeout=5.0, cleanup_timeout=2.0, on_error=errors
    ) as transport:
        sleeper = Sleeper()
        transport.handle("job", sleeper)
        await transport.dispatch(task("job", 1, 1.0))
        await sleeper.started.wait()
        broker.hang = True  # the result push will hang: the handler never finishes in budget
        start = trio.current_time()
    assert trio.current_time() - start <= 5.0 + 2.0 + 2.0


async def test_t24_renewal_keeps_claims_alive_through_the_close_drain(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Phase 3 runs with renewal on: a claim older than the threshold is not swept mid-drain."""
    async with dt.open_backend("memory://") as backend:
        errors = Errors()
        async with dt.open_queue_transport(
            backend,
            close_timeout=30.0,
            stalled_threshold=4.0,
            stalled_check_interval=1.0,
            on_error=errors,
        ) as transport:
            sleeper = Sleeper()
            transport.handle("job", sleeper)
            await transport.dispatch(task("job", 1, 20.0))
            await sleeper.started.wait()
            start = trio.current_time()
        assert trio.current_time() - start == 20.0
        assert errors.seen == []
        assert await backend.broker.size_of(transport.names.task_queue("job")) == 0  # type: ignore[attr-defined]


@given(
    durations=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0, 7.0, 60.0]), min_size=1, max_size=12),
    concurrency=st.integers(1, 6),
    close_timeout=st.sampled_from([0.0, 1.0, 2.5, 5.0]),
    close_after=st.sampled_from([0.0, 0.25, 1.25, 1.75]),
)
def test_t24_property_close_ends_at_min_of_done_and_deadline_and_loses_nothing(
    durations: list[float], concurrency: int, close_timeout: float, close_after: float
) -> None:
    """For any job durations, concurrency and close_timeout: close ends at min(all running
    done, deadline); no job is lost; every unfinished claim is handed back exactly once.
    (Durations are multiples of 0.5 s and closes start at quarter seconds: no ties.)"""

    async def main() -> None:
        broker = CountingBroker()
        started: dict[int, float] = {}
        finished: dict[int, float] = {}

        async def step(t: dt.RemoteTask) -> None:
            n = int(t.step_id[1:])
            started[n] = trio.current_time()
            await trio.sleep(t.input)
            finished[n] = trio.current_time()

        async with dt.open_queue_transport(
            backend_with(broker), close_timeout=close_timeout, concurrency=concurrency
        ) as transport:
            transport.handle("job", step)
            for n, seconds in enumerate(durations):
                await transport.dispatch(task("job", n, seconds))
            await trio.sleep(close_after)
            close_start = trio.current_time()
        elapsed = trio.current_time() - close_start
        in_flight = [
            n
            for n, at in started.items()
            if at <= close_start and finished.get(n, 1e9) > close_start
        ]
        deadline = close_start + close_timeout
        ends = [started[n] + durations[n] for n in in_flight]
        expected_end = min(max(ends, default=close_start), deadline)
        assert elapsed == expected_end - close_start
        assert len(started) == len(in_flight) + sum(
            1 for at in finished.values() if at <= close_start
        )
        # nothing lost: every job finished, or is back in the queue ready to run
        left = await broker.size_of(transport.names.task_queue("job"))
        assert len(finished) + left == len(durations)
        handed_back = [job_id for job_id, _ in broker.handbacks]
        assert len(handed_back) == len(set(handed_back))  # each at most once
        unfinished = [n for n in in_flight if n not in finished]
        # every unfinished claim came back: the running ones, and any claimed ahead (prefetch)
        # that never started; nothing is lost
        assert len(handed_back) >= len(unfinished)
        assert left == len(durations) - len(finished)
        assert all(counted is False for _, counted in broker.handbacks)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.parametrize(
    "kind", ["sqlite", "redis", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_a_cancel_around_the_backend_too_still_hands_back_while_it_is_open(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Real backends, wall clock (no sweep, so a ready job afterwards is the handback's).
    if kind == "redis":
        url = str(request.getfixturevalue("redis_url"))
    elif kind == "postgres":
        url = str(request.getfixturevalue("postgres_schema_url"))
    else:
        url = "sqlite:///" + str(tmp_path / "close.db")
    namespace = f"outer{random.randrange(1 << 30)}"
    sleeper = Sleeper()
    errors = Errors()
    with trio.move_on_after(10) as outer:
        async with dt.open_backend(url) as backend:
            async with dt.open_queue_transport(
                backend, namespace=namespace, stalled_check_interval=0, on_error=errors
            ) as transport:
                transport.handle("job", sleeper)
                await transport.dispatch(task("job", 1, 60))
                await sleeper.started.wait()
                outer.cancel()  # the backend's own tasks are inside this scope too
                await trio.sleep_forever()
    assert outer.cancelled_caught
    assert errors.messages() == []
    async with dt.open_backend(url) as backend:
        again = await backend.broker.pop_from(transport.names.task_queue("job"))
    assert again is not None
    assert (again.attempts, again.stalled_count) == (0, 0)


async def test_claim_states_are_enum_members_through_the_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A running claim and a prefetched one carry ClaimState members (compared by identity);
    close abandons both at its deadline and hands each back once."""
    broker = CountingBroker()
    async with dt.open_queue_transport(
        backend_with(broker), close_timeout=5.0, prefetch=1
    ) as transport:
        transport.handle("job", Sleeper())
        await transport.dispatch_many([task("job", 1, 60.0), task("job", 2, 60.0)])
        await trio.testing.wait_all_tasks_blocked()
        states = sorted(claim.state.value for claim in transport._runner.claims.values())
        assert states == ["buffered", "running"]
        assert all(type(claim.state) is ClaimState for claim in transport._runner.claims.values())
        claims = list(transport._runner.claims.values())
        await transport.aclose()
    assert trio.current_time() == 5.0
    assert [claim.state for claim in claims] == [ClaimState.ABANDONED] * 2
    assert sorted(broker.handbacks) == sorted((c.job.id, False) for c in claims)
