"""Step heartbeats (issue #15, item 3) under a virtual clock, memory backend: a handler's
``step_info().heartbeat(details)``, coalesced on the worker, recorded on the step by the
engine, and the ``heartbeat_timeout=`` failover (retried at ``heartbeat_timeout`` plus one
check, never waiting for the stalled threshold; the old attempt's late result is stale)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio._engine import (
    App,
    Retry,
    StepState,
    WorkflowContext,
    open_engine,
    open_worker,
    step_info,
)
from helpers import Errors

ONCE_MORE = Retry(max_attempts=3, initial=30.0, jitter=0.0)
"""A backoff far longer than the failover's: a retry at once shows it was not applied."""


async def test_beats_reach_the_engine_and_the_step_records_the_last(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = App("shop")

    @app.step("long")
    async def long(_: Any) -> str:
        step_info().heartbeat({"done": 1})
        await trio.sleep(1.5)
        step_info().heartbeat({"done": 2})
        await trio.sleep(1.0)
        return "ok"

    @app.workflow("one")
    async def one(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("long")

    errors = Errors()
    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend, on_error=errors), open_engine(app, backend) as engine:
            assert await engine.result(await engine.start("one", run_id="r")) == "ok"
            (step,) = await engine.history("r")
            stats = engine.statistics()
    assert trio.current_time() == 2.5
    beat = step.heartbeat
    assert beat is not None
    assert (beat["attempt"], beat["at"], beat["details"]) == (1, 1.5, {"done": 2})
    assert isinstance(beat["sentAt"], float)  # the worker's Unix time
    assert step.heartbeat_timeout is None
    assert (stats.heartbeats_recorded, stats.stale_heartbeats, stats.heartbeat_timeouts) == (
        2,
        0,
        0,
    )
    assert errors.seen == []


async def test_a_tight_loop_of_beats_costs_one_push_per_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = App("shop")
    made: list[int] = []

    @app.step("busy")
    async def busy(_: Any) -> str:
        info = step_info()
        for k in range(9):  # a beat every 0.3 s, from 0 to 2.4
            info.heartbeat(k)
            made.append(k)
            await trio.sleep(0.3)
        return "ok"

    @app.workflow("one")
    async def one(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("busy")

    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend), open_engine(app, backend) as engine:
            assert await engine.result(await engine.start("one", run_id="r")) == "ok"
            (step,) = await engine.history("r")
            stats = engine.statistics()
    # Pushed at 0 (the first beat), at 1.0 (the latest then: k=3, made at 0.9) and at 2.0
    # (k=6, made at 1.8); beats 7 and 8 wait for 3.0, which the handler's end cancels.
    assert len(made) == 9
    assert stats.heartbeats_recorded == 3
    assert step.heartbeat is not None
    assert (step.heartbeat["at"], step.heartbeat["details"]) == (2.0, 6)


async def test_step_info_outside_a_step_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"only available inside a running step"):
        step_info()
    with pytest.raises(RuntimeError, match=r"transport\.handle handler"):
        dt.step_info().heartbeat()


async def test_heartbeat_details_must_be_json(autojump_clock: trio.testing.MockClock) -> None:
    app = App("shop")

    @app.step("bad")
    async def bad(_: Any) -> str:
        with pytest.raises(dt.PayloadError, match="heartbeat details"):
            step_info().heartbeat({"when": object()})
        return "ok"

    @app.workflow("one")
    async def one(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("bad")

    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend), open_engine(app, backend) as engine:
            assert await engine.result(await engine.start("one")) == "ok"


async def test_a_raw_transport_handler_beats_through_step_info(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen: list[dt.StepHeartbeat] = []

    async def handler(task: dt.RemoteTask) -> str:
        info = dt.step_info()
        assert (info.run_id, info.step_id, info.attempt, info.name) == ("r", "1", 2, "raw")
        assert info.previous_heartbeat == {"page": 7}
        info.heartbeat({"page": 8})
        await trio.sleep(1.0)
        return "ok"

    async def on_beat(beat: dt.StepHeartbeat) -> None:
        seen.append(beat)
        await trio.lowlevel.checkpoint()

    async with dt.open_backend("memory://") as backend:
        async with dt.open_queue_transport(backend, namespace="raw") as transport:
            transport.handle("raw", handler)
            transport.remote.on_heartbeat(on_beat)
            await transport.dispatch(
                dt.RemoteTask("r", "1", 2, "raw", last_heartbeat={"page": 7})
            )
            await trio.sleep(2.0)
    assert [(b.run_id, b.step_id, b.attempt, b.details) for b in seen] == [
        ("r", "1", 2, {"page": 8})
    ]


async def test_heartbeat_timeout_is_checked_at_declaration() -> None:
    app = App("shop")
    with pytest.raises(dt.ConfigError, match="heartbeat_timeout"):
        app.step("x", heartbeat_timeout=0)
    with pytest.raises(TypeError, match="heartbeat_timeout"):
        app.step("x", heartbeat_timeout="3")  # type: ignore[arg-type]


def stalling_app(log: list[tuple[float, int, str]]) -> App:
    """Step ``long`` (heartbeat_timeout 3 s): its first attempt beats once at once, then goes
    silent for 100 s (shielded, so it also outlives the engine's request to stop it) and
    returns late; its second attempt resumes from the first one's last details."""
    app = App("shop")

    @app.step("long", heartbeat_timeout=3.0, retry=ONCE_MORE)
    async def long(_: Any) -> Any:
        info = step_info()
        log.append((trio.current_time(), info.attempt, "start"))
        if info.attempt == 1:
            info.heartbeat({"page": 1})
            with trio.CancelScope(shield=True):
                await trio.sleep(100.0)
            log.append((trio.current_time(), info.attempt, "late"))
            return "late"
        info.heartbeat({"page": 2})
        await trio.sleep(0.5)
        return {"fresh": info.previous_heartbeat}

    @app.workflow("one")
    async def one(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("long")

    return app


async def test_a_step_whose_beats_stop_is_retried_at_heartbeat_timeout_plus_one_check(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log: list[tuple[float, int, str]] = []
    app = stalling_app(log)
    errors = Errors()
    async with dt.open_backend("memory://") as backend:
        async with (
            open_worker(app, backend, concurrency=2, on_error=errors),
            open_engine(app, backend, heartbeat_check_interval=1.0) as engine,
        ):
            outcome = await engine.result(await engine.start("one", run_id="r"))
            done_at = trio.current_time()
            await trio.sleep(100.0)  # the first attempt's late result arrives, and is stale
            (step,) = await engine.history("r")
            stats = engine.statistics()
    # The beat at 0; checks at 1, 2, 3 (3 s silent: not more than the timeout), 4: failed
    # over, the retry dispatched at once (not after ONCE_MORE's 30 s backoff), and far before
    # the stalled threshold (120 s by default).
    assert done_at == 4.5  # attempt 2 ran 4.0 to 4.5
    assert outcome == {"fresh": {"page": 1}}
    assert log == [(0.0, 1, "start"), (4.0, 2, "start"), (100.0, 1, "late")]
    assert (step.status, step.attempt, step.output) == (StepState.COMPLETED, 2, outcome)
    assert step.error["code"] == "heartbeat_timeout"
    assert step.error["details"]["lastHeartbeat"]["details"] == {"page": 1}
    assert step.heartbeat_timeout == 3.0
    assert step.heartbeat is not None
    assert (step.heartbeat["attempt"], step.heartbeat["at"]) == (2, 4.0)
    # The late result of attempt 1 finds the step completed: ignored (counted as a result for
    # a settled step, as any result arriving after the step settled is).
    assert (stats.heartbeat_timeouts, stats.retries, stats.duplicate_results) == (1, 1, 1)
    assert stats.results_applied == 2  # the failover's failure, then attempt 2's result


async def test_the_engine_asks_the_worker_to_stop_the_failed_over_attempt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = App("shop")
    stopped: list[float] = []

    @app.step("long", heartbeat_timeout=2.0, retry=ONCE_MORE)
    async def long(_: Any) -> str:
        info = step_info()
        if info.attempt == 1:
            info.heartbeat()
            try:
                await trio.sleep_forever()
            finally:
                stopped.append(trio.current_time())
        return "second"

    @app.workflow("one")
    async def one(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("long")

    async with dt.open_backend("memory://") as backend:
        async with (
            open_worker(app, backend, concurrency=2) as worker,
            open_engine(app, backend, heartbeat_check_interval=0.5) as engine,
        ):
            assert await engine.result(await engine.start("one", run_id="r")) == "second"
            assert trio.current_time() == 2.5  # beat at 0, then 2.5 s > 2 s at the check
            await trio.sleep(1.0)
            stats = engine.statistics()
            counters = worker.statistics()
    assert stopped == [2.5]  # the cancel-step control message reached the worker
    assert (counters.cancelled, counters.succeeded) == (1, 1)
    # The stopped attempt's (cancelled) result is ignored: stale if it comes while attempt 2
    # runs, for a settled step if after (both end at 2.5, in either order).
    assert stats.duplicate_results + stats.stale_results == 1
    assert stats.results_applied == 2


async def test_a_step_that_never_beats_is_not_failed_over(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = App("shop")

    @app.step("quiet", heartbeat_timeout=1.0)
    async def quiet(_: Any) -> str:
        await trio.sleep(10.0)  # the timer starts at the first beat: none comes
        return "ok"

    @app.workflow("one")
    async def one(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("quiet")

    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend), open_engine(app, backend) as engine:
            assert await engine.result(await engine.start("one")) == "ok"
            stats = engine.statistics()
    assert trio.current_time() == 10.0
    assert stats.heartbeat_timeouts == 0


async def test_a_step_that_keeps_beating_is_never_failed_over(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = App("shop")

    @app.step("steady", heartbeat_timeout=1.5)
    async def steady(_: Any) -> str:
        for _ in range(20):  # 20 s, a beat a second: never 1.5 s silent
            step_info().heartbeat()
            await trio.sleep(1.0)
        return "ok"

    @app.workflow("one")
    async def one(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("steady")

    async with dt.open_backend("memory://") as backend:
        async with (
            open_worker(app, backend),
            open_engine(app, backend, heartbeat_check_interval=0.25) as engine,
        ):
            assert await engine.result(await engine.start("one")) == "ok"
            stats = engine.statistics()
    assert trio.current_time() == 20.0
    assert (stats.heartbeat_timeouts, stats.heartbeats_recorded) == (0, 20)


async def test_a_late_result_while_the_retry_runs_is_stale(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = App("shop")

    @app.step("long", heartbeat_timeout=2.0, retry=ONCE_MORE)
    async def long(_: Any) -> str:
        info = step_info()
        info.heartbeat()
        if info.attempt == 1:
            with trio.CancelScope(shield=True):  # it outlives the request to stop it
                await trio.sleep(5.0)
        else:
            for _ in range(10):
                await trio.sleep(1.0)
                info.heartbeat()
        return f"attempt {info.attempt}"

    @app.workflow("one")
    async def one(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("long")

    async with dt.open_backend("memory://") as backend:
        async with (
            open_worker(app, backend, concurrency=2),
            open_engine(app, backend, heartbeat_check_interval=1.0) as engine,
        ):
            assert await engine.result(await engine.start("one", run_id="r")) == "attempt 2"
            stats = engine.statistics()
    # Failed over at 3 (beat at 0, 3 s > 2 s); attempt 1's result at 5 finds attempt 2
    # current: stale, ignored; attempt 2 ends at 13.
    assert trio.current_time() == 13.0
    assert (stats.heartbeat_timeouts, stats.stale_results, stats.results_applied) == (1, 1, 2)


async def test_a_worker_whose_broker_stalls_sigstop_like_is_failed_over(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A worker that stops reaching the broker (SIGSTOP, a network partition: simulated with
    the fault injector's stall) sends no beats: its attempt is failed over at heartbeat_timeout
    plus one check, and another worker runs the retry; the stalled threshold (120 s) plays no
    part."""
    import random

    from durable_trio.brokers.memory import MemoryBroker
    from durable_trio.testing.faults import Injector, wrap_broker

    app = App("shop")

    @app.step("long", heartbeat_timeout=5.0, retry=ONCE_MORE)
    async def long(_: Any) -> str:
        info = step_info()
        for _ in range(30 if info.attempt == 1 else 1):
            info.heartbeat()
            await trio.sleep(1.0)
        return f"attempt {info.attempt}"

    @app.workflow("one")
    async def one(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("long")

    shared = MemoryBroker()
    paused = Injector("paused", random.Random(0))
    healthy = dt.Backend("memory://", shared)
    stalled_at: list[float] = []
    async with open_engine(app, healthy, heartbeat_check_interval=1.0) as engine:
        async with open_worker(
            app, dt.Backend("memory://", wrap_broker(shared, paused)), instance_id="paused"
        ) as first:
            run_id = await engine.start("one", run_id="r")
            await trio.sleep(2.5)
            paused.stall(60.0)  # beats at 0, 1, 2 went out; nothing more until 62.5
            stalled_at.append(trio.current_time())
            async with open_worker(app, healthy, instance_id="healthy") as second:
                assert await engine.result(run_id) == "attempt 2"
                done_at = trio.current_time()
                stats = engine.statistics()
                served = (first.statistics().executed, second.statistics().executed)
    assert stalled_at == [2.5]
    # The last beat reached the engine at 2; checks at 3 .. 7 (5 s silent at 7: not more),
    # at 8 failed over; the healthy worker runs attempt 2 from 8 to 9.
    assert done_at == 9.0
    assert served == (1, 1)
    assert (stats.heartbeat_timeouts, stats.retries) == (1, 1)


async def test_a_remote_workflow_s_step_is_failed_over_too(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The steps a remote workflow's turns ask for (their checkpoints written from decisions)
    carry the declaration's heartbeat_timeout, and are watched alike."""
    app = App("shop")

    @app.step("long", heartbeat_timeout=3.0, retry=ONCE_MORE)
    async def long(_: Any) -> Any:
        info = step_info()
        info.heartbeat({"page": info.attempt})
        if info.attempt == 1:
            await trio.sleep_forever()  # silent; stopped by the engine's cancel-step
        await trio.sleep(0.5)
        return {"resumed": info.previous_heartbeat}

    @app.workflow("one", remote=True)
    async def one(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("long")

    async with dt.open_backend("memory://") as backend:
        async with (
            open_worker(app, backend, concurrency=2),
            open_engine(app, backend, heartbeat_check_interval=1.0) as engine,
        ):
            outcome = await engine.result(await engine.start("one", run_id="r"))
            done_at = trio.current_time()
            steps = [s for s in await engine.history("r") if s.name == "long"]
            stats = engine.statistics()
    assert outcome == {"resumed": {"page": 1}}
    assert stats.heartbeat_timeouts == 1
    (step,) = steps
    assert (step.attempt, step.heartbeat_timeout) == (2, 3.0)
    # The step beat at 0 (the first turn ran at once); checks at 1, 2, 3 (3 s silent: not
    # more than the timeout), 4: failed over; attempt 2 runs 4.0 to 4.5.
    assert done_at == 4.5
