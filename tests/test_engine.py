"""The durable engine under a virtual clock (memory backend): replay, retries with exact backoff
times, idempotent application, non-determinism, cancel, durable timers, gather, reconcile."""

from __future__ import annotations

import argparse
import builtins
import json
import typing
from collections import Counter
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio._engine import (
    App,
    Engine,
    NonDeterminismError,
    Retry,
    RunCancelled,
    RunFailed,
    RunNotFound,
    RunRecord,
    RunStatus,
    StepFailed,
    StepKind,
    StepRecord,
    StepState,
    UnknownWorkflow,
    WorkflowContext,
    open_engine,
    open_run_store,
    open_worker,
    step_info,
)
from durable_trio._engine._runtime import UNCONFIRMED_GRACE
from durable_trio._engine._stored_retry import StoredRetry
from durable_trio._engine._stores.memory import MemoryRunStore
from durable_trio.cli._engine import add_engine_commands, load_app
from durable_trio.keys.memory import MemoryKeyStore
from helpers import DefectiveBroker, Errors, wait_status

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

EXACT = Retry(max_attempts=4, initial=1.0, multiplier=2.0, max_delay=60.0, jitter=0.0)


class Flaky(Exception):
    """A failure worth retrying."""


class Declined(Exception):
    """A failure no retry can fix."""


def shop() -> tuple[App, Counter[str]]:
    """An app whose steps count their executions (by idempotency key)."""
    app = App("shop")
    runs: Counter[str] = Counter()

    @app.step("double")
    async def double(x: int) -> int:
        runs[step_info().idempotency_key] += 1
        return x * 2

    @app.step("slow")
    async def slow(seconds: float) -> float:
        runs[step_info().idempotency_key] += 1
        await trio.sleep(seconds)
        return trio.current_time()

    @app.step("fail-then-succeed", retry=EXACT)
    async def fail_then_succeed(failures: int) -> dict[str, Any]:
        info = step_info()
        runs[info.idempotency_key] += 1
        if info.attempt <= failures:
            raise Flaky(f"attempt {info.attempt} failed")
        return {"attempt": info.attempt, "at": trio.current_time()}

    @app.step("decline", retry=Retry(max_attempts=5, non_retryable=(Declined,)))
    async def decline(_: Any) -> None:
        runs[step_info().idempotency_key] += 1
        raise Declined("card declined")

    @app.step("hang")
    async def hang(_: Any) -> None:
        runs[step_info().idempotency_key] += 1
        await trio.sleep_forever()

    @app.workflow("three")
    async def three(ctx: WorkflowContext, x: int) -> list[int]:
        a = await ctx.step("double", x)
        b = await ctx.step("double", a)
        c = await ctx.step("double", b)
        return [a, b, c]

    return app, runs


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


# --------------------------------------------------------------------------- basics


async def test_a_three_step_workflow_completes(autojump_clock: trio.testing.MockClock) -> None:
    app, runs = shop()
    errors = Errors()
    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend, on_error=errors):
            async with open_engine(app, backend, on_error=errors) as engine:
                run_id = await engine.start("three", 3, run_id="order-1")
                assert await engine.result(run_id) == [6, 12, 24]
                assert await engine.status(run_id) is RunStatus.COMPLETED
                history = await engine.history(run_id)
                stats = engine.statistics()
                listed = await engine.list()
    assert trio.current_time() == 0.0
    assert [(s.step_id, s.name, s.status, s.output) for s in history] == [
        ("1", "double", StepState.COMPLETED, 6),
        ("2", "double", StepState.COMPLETED, 12),
        ("3", "double", StepState.COMPLETED, 24),
    ]
    assert runs == {"order-1:1": 1, "order-1:2": 1, "order-1:3": 1}
    assert (stats.runs_started, stats.runs_completed, stats.steps_dispatched) == (1, 1, 3)
    assert (stats.results_applied, stats.duplicate_results, stats.stale_results) == (3, 0, 0)
    assert [r.run_id for r in listed] == ["order-1"]
    assert errors.seen == []


async def test_start_is_idempotent_and_checks_its_arguments(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, runs = shop()
    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend), open_engine(app, backend) as engine:
            first = await engine.start("three", 1, run_id="same")
            again = await engine.start("three", 99, run_id="same")
            assert first == again == "same"
            assert await engine.result("same") == [2, 4, 8]
            with pytest.raises(UnknownWorkflow, match="no workflow 'nope'"):
                await engine.start("nope")
            with pytest.raises(dt.PayloadError, match="not JSON-serialisable"):
                await engine.start("three", object())
            with pytest.raises(RunNotFound):
                await engine.result("missing")
    assert sum(runs.values()) == 3


async def test_a_failing_workflow_fails_its_run(autojump_clock: trio.testing.MockClock) -> None:
    app = App("shop")

    @app.workflow("broken")
    async def broken(ctx: WorkflowContext, _: Any) -> None:
        raise ValueError("no such order")

    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend) as engine:
            run_id = await engine.start("broken")
            with pytest.raises(RunFailed) as failed:
                await engine.result(run_id)
            assert await engine.status(run_id) is RunStatus.FAILED
    assert failed.value.error_type == "ValueError"
    assert failed.value.error["message"] == "no such order"


def test_step_info_outside_a_step() -> None:
    with pytest.raises(RuntimeError, match="only available inside a running step"):
        step_info()


# --------------------------------------------------------------------------- gather


async def test_step_ids_are_assigned_at_call_time_and_gather_runs_steps_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, runs = shop()

    @app.workflow("parallel")
    async def parallel(ctx: WorkflowContext, _: Any) -> dict[str, Any]:
        first = ctx.step("slow", 5.0)  # id 1
        second = ctx.step("slow", 3.0)  # id 2
        late_first = await second  # a handle runs when awaited: in the other order, ids stay
        early = await first
        both = await ctx.gather(ctx.step("slow", 4.0), ctx.step("slow", 2.0))  # ids 3, 4
        return {"ends": [late_first, early, *both]}

    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend), open_engine(app, backend) as engine:
            run_id = await engine.start("parallel", run_id="p")
            outcome = await engine.result(run_id)
            history = await engine.history(run_id)
    # 2 then 1 one after the other (3 s + 5 s), then 3 and 4 side by side (4 s, not 6).
    assert outcome == {"ends": [3.0, 8.0, 12.0, 10.0]}
    assert trio.current_time() == 12.0
    assert [(s.step_id, s.input) for s in history] == [
        ("1", 5.0),
        ("2", 3.0),
        ("3", 4.0),
        ("4", 2.0),
    ]
    assert set(runs) == {"p:1", "p:2", "p:3", "p:4"}


async def test_gather_waits_for_all_then_raises_the_first_failure_by_position(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, _ = shop()
    seen: list[Any] = []

    @app.workflow("fan")
    async def fan(ctx: WorkflowContext, _: Any) -> str:
        outcomes = await ctx.gather(
            ctx.step("slow", 2.0), ctx.step("decline"), return_exceptions=True
        )
        seen.append([type(o).__name__ for o in outcomes])
        try:
            await ctx.gather(ctx.step("slow", 4.0), ctx.step("decline"), ctx.step("decline"))
        except StepFailed as exc:
            seen.append((exc.step_id, trio.current_time()))
        return "done"

    async with dt.open_backend("memory://") as backend:
        errors = Errors()
        async with open_worker(app, backend, on_error=errors), open_engine(app, backend) as engine:
            assert await engine.result(await engine.start("fan")) == "done"
    # The first gather settles at t=2; the second waits for its slow step (t=6) even though
    # both declines failed at once, then raises the first failure in argument order (id 4).
    assert seen == [["float", "StepFailed"], ("4", 6.0)]


# --------------------------------------------------------------------------- retries


async def test_retries_happen_at_exact_backoff_times(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, runs = shop()

    @app.workflow("retry")
    async def retry(ctx: WorkflowContext, failures: int) -> Any:
        return await ctx.step("fail-then-succeed", failures)

    errors = Errors()
    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend, on_error=errors), open_engine(app, backend) as engine:
            outcome = await engine.result(await engine.start("retry", 3, run_id="r"))
            (step,) = await engine.history("r")
            stats = engine.statistics()
    # Attempts at 0, then 1 s, 2 s, 4 s later: t = 0, 1, 3, 7.
    assert outcome == {"attempt": 4, "at": 7.0}
    assert trio.current_time() == 7.0
    assert runs == {"r:1": 4}
    assert (step.attempt, step.status, step.error["code"]) == (4, StepState.COMPLETED, "Flaky")
    assert (stats.retries, stats.steps_dispatched, stats.results_applied) == (3, 4, 4)


async def test_retry_delays_are_capped_and_exhausted_retries_fail_into_the_workflow(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, runs = shop()
    caught: list[tuple[str, int, float]] = []

    @app.workflow("capped")
    async def capped(ctx: WorkflowContext, _: Any) -> str:
        policy = Retry(max_attempts=4, initial=10.0, multiplier=3.0, max_delay=20.0, jitter=0.0)
        try:
            await ctx.step("fail-then-succeed", 100, retry=policy)
        except StepFailed as exc:
            caught.append((exc.error.message, exc.attempts, trio.current_time()))
            return "compensated"
        return "charged"

    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend, on_error=Errors()):
            async with open_engine(app, backend) as engine:
                assert await engine.result(await engine.start("capped", run_id="c")) == (
                    "compensated"
                )
    # Delays 10, then min(30, 20) = 20, then min(90, 20) = 20: attempts at 0, 10, 30, 50.
    assert caught == [("Flaky: attempt 4 failed", 4, 50.0)]
    assert runs == {"c:1": 4}


async def test_an_uncaught_step_failure_fails_the_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, runs = shop()

    @app.workflow("charge")
    async def charge(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("decline")

    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend, on_error=Errors()):
            async with open_engine(app, backend) as engine:
                run_id = await engine.start("charge", run_id="d")
                with pytest.raises(RunFailed) as failed:
                    await engine.result(run_id)
    # Declined is non-retryable for this step: one attempt, at once, despite max_attempts=5.
    assert runs == {"d:1": 1}
    assert trio.current_time() == 0.0
    assert failed.value.error_type == "StepFailed"
    assert failed.value.error["attempts"] == 1
    assert failed.value.error["error"]["code"] == "Declined"
    assert failed.value.error["error"]["retryable"] is False


async def test_an_exception_marked_not_retryable_fails_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = App("shop")
    attempts: list[int] = []

    class Fatal(Exception):
        retryable = False

    @app.step("fatal", retry=Retry(max_attempts=9))
    async def fatal(_: Any) -> None:
        attempts.append(step_info().attempt)
        raise Fatal("nope")

    @app.workflow("wf")
    async def wf(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("fatal")

    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend, on_error=Errors()):
            async with open_engine(app, backend) as engine:
                with pytest.raises(RunFailed, match="after 1 attempt: Fatal: nope"):
                    await engine.result(await engine.start("wf"))
    assert attempts == [1]


async def test_a_stalled_step_from_the_poison_bridge_is_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """T9's bridge (docs/spec.md) publishes a RETRYABLE failed result with code "stalled" for a
    task that stalled too often; the engine retries it like any retryable failure."""
    app = App("shop")
    attempts: list[tuple[int, float]] = []

    @app.step("stuck-once", retry=EXACT)
    async def stuck_once(_: Any) -> str:
        info = step_info()
        attempts.append((info.attempt, trio.current_time()))
        if info.attempt == 1:
            await trio.sleep_forever()  # a worker that hangs (its lease keeps being renewed)
        return "unstuck"

    @app.workflow("wf")
    async def wf(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("stuck-once")

    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend, concurrency=2, close_timeout=0.0):
            async with open_engine(app, backend) as engine:
                run_id = await engine.start("wf", run_id="s")
                await trio.sleep(100)
                bridge = dt.StepResult(
                    run_id,
                    "1",
                    1,
                    dt.StepStatus.FAILED,
                    error=dt.StepError("stalled more than 3 times", code="stalled"),
                )
                await engine.transport.publish_result(bridge)
                assert await engine.result(run_id) == "unstuck"
                assert engine.statistics().retries == 1
    assert attempts == [(1, 0.0), (2, 101.0)]


# --------------------------------------------------------------------------- idempotent application


async def test_duplicate_stale_and_orphan_results_are_ignored_and_counted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, _ = shop()

    @app.workflow("wf")
    async def wf(ctx: WorkflowContext, _: Any) -> list[Any]:
        first = await ctx.step("fail-then-succeed", 1)  # fails at t=0, retried at t=1
        await ctx.sleep(100)
        return [first, await ctx.step("double", 21)]

    def result(step_id: str, attempt: int, output: Any) -> dt.StepResult:
        return dt.StepResult("w", step_id, attempt, dt.StepStatus.COMPLETED, output=output)

    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend, on_error=Errors()):
            async with open_engine(app, backend) as engine:
                await engine.start("wf", run_id="w")
                await trio.sleep(0.5)  # step 1 is at attempt 2, waiting for its backoff
                publish = engine.transport.publish_result
                await publish(result("1", 1, "late answer from attempt 1"))  # stale
                await trio.sleep(1.0)  # attempt 2 completed at t=1
                await publish(result("1", 2, "the same answer, delivered twice"))  # duplicate
                await publish(result("9", 1, "a step the run never asked for"))  # orphan
                await publish(dt.StepResult("nobody", "1", 1, dt.StepStatus.COMPLETED))  # orphan
                assert await engine.result("w") == [{"attempt": 2, "at": 1.0}, 42]
                stats = engine.statistics()
                history = await engine.history("w")
    assert (stats.stale_results, stats.duplicate_results, stats.orphan_results) == (1, 1, 2)
    assert stats.results_applied == 3  # attempt 1 failed, attempt 2, step 3
    assert history[0].output == {"attempt": 2, "at": 1.0}


# --------------------------------------------------------------------------- durable timers


async def test_sleep_wakes_at_exactly_its_time(autojump_clock: trio.testing.MockClock) -> None:
    app = App("shop")
    woke: list[float] = []

    @app.workflow("nap")
    async def nap(ctx: WorkflowContext, seconds: float) -> None:
        await ctx.sleep(seconds)
        woke.append(trio.current_time())
        await ctx.gather(ctx.sleep(5), ctx.sleep(2.5))
        woke.append(trio.current_time())

    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend) as engine:
            await trio.sleep(1.5)
            await engine.result(await engine.start("nap", 10))
            stats = engine.statistics()
    assert woke == [11.5, 16.5]
    assert stats.timers_fired == 3


async def test_a_sleep_survives_an_engine_restart_and_keeps_its_wake_up_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = App("shop")
    woke: list[tuple[float, bool]] = []

    @app.workflow("nap")
    async def nap(ctx: WorkflowContext, _: Any) -> float:
        await ctx.sleep(10)
        woke.append((trio.current_time(), ctx.is_replaying))
        return trio.current_time()

    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend, engine_id="first") as first:
            await first.start("nap", run_id="n")
            await trio.sleep(4)
        assert await first.status("n") is RunStatus.PENDING  # released on close
        await trio.sleep(2)
        async with open_engine(app, backend, engine_id="second") as second:
            assert await second.result("n") == 10.0  # not 6 + 10
            assert second.statistics().runs_resumed == 1
    assert woke == [(10.0, False)]


# --------------------------------------------------------------------------- replay and reconcile


async def test_replay_after_a_restart_runs_no_completed_step_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, runs = shop()
    bodies: list[tuple[float, bool]] = []

    @app.workflow("pipeline")
    async def pipeline(ctx: WorkflowContext, _: Any) -> list[Any]:
        bodies.append((trio.current_time(), ctx.is_replaying))
        a = await ctx.step("double", 1)
        b = await ctx.run("local", lambda: {"computed": a})
        c = await ctx.step("slow", 10.0)  # in flight when the first engine goes away
        return [a, b, c, await ctx.step("double", 2)]

    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend):
            async with open_engine(app, backend, engine_id="a") as first:
                await first.start("pipeline", run_id="p")
                await trio.sleep(5)
            assert (await first.get("p")).owner is None
            async with open_engine(app, backend, engine_id="b") as second:
                assert await second.result("p") == [2, {"computed": 2}, 10.0, 4]
                stats = second.statistics()
    assert bodies == [(0.0, False), (5.0, True)]
    # Every step ran once: the completed ones were replayed from history, the one in flight
    # was not re-dispatched (its task was on the broker), its result applied by the new engine.
    assert runs == {"p:1": 1, "p:3": 1, "p:4": 1}
    assert (stats.runs_resumed, stats.redispatched, stats.local_steps_run) == (1, 0, 0)


async def test_a_dead_engines_runs_are_taken_over_once_its_lease_lapses(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, runs = shop()
    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend):

            @app.workflow("later")
            async def later(ctx: WorkflowContext, _: Any) -> float:
                await ctx.sleep(1)
                await ctx.step("double", 1)
                return trio.current_time()

            # "Dead": it stops without releasing its runs (as SIGKILL would).
            async with open_engine(app, backend, engine_id="dead", release_on_close=False) as a:
                await a.start("later", run_id="l")
                await trio.sleep(0.5)
            # Its lease (30 s from t=0) lapses at t=30; reconcile looks every 5 s from t=12.
            await trio.sleep(11.5)
            async with open_engine(app, backend, engine_id="heir", reconcile_interval=5) as b:
                assert b.statistics().runs_resumed == 0
                assert await b.result("l") == 32.0
                assert (await b.get("l")).status is RunStatus.COMPLETED
    assert runs == {"l:2": 1}


async def test_an_engine_restarted_under_its_id_takes_its_runs_back_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, _ = shop()

    @app.workflow("later")
    async def later(ctx: WorkflowContext, _: Any) -> float:
        await ctx.sleep(1)
        return trio.current_time()

    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend, engine_id="svc", release_on_close=False) as a:
            await a.start("later", run_id="l")
            await trio.sleep(0.5)
        async with open_engine(app, backend, engine_id="svc") as again:
            assert again.statistics().runs_resumed == 1
            assert await again.result("l") == 1.0


async def test_a_cancel_around_open_engine_still_releases_its_runs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, runs = shop()

    @app.workflow("later")
    async def later(ctx: WorkflowContext, _: Any) -> float:
        await ctx.sleep(10)
        await ctx.step("double", 1)
        return trio.current_time()

    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend):
            # The cancel reaches the run's driver as well as the body: the run it held must
            # still be released, not left owned by this engine until its 30 s lease lapses.
            with trio.move_on_after(4) as outer:
                async with open_engine(app, backend, engine_id="gone") as first:
                    await first.start("later", run_id="l")
                    await trio.sleep_forever()
            assert outer.cancelled_caught
            assert trio.current_time() == 4.0
            record = await first.get("l")
            assert (record.status, record.owner) == (RunStatus.PENDING, None)
            async with open_engine(app, backend, engine_id="heir") as second:
                # taken over on entry, at t=4 (not at t=30 when the lease would have lapsed)
                assert (second.statistics().runs_resumed, trio.current_time()) == (1, 4.0)
                assert (await second.get("l")).owner == "heir"
                assert await second.result("l") == 10.0
    assert runs == {"l:2": 1}


async def _orphan_unconfirmed_at_step_2(backend: dt.Backend) -> None:
    """Run ``orphan`` of ``three`` as a dead engine left it: step 1 completed, step 2's attempt
    checkpointed with no dispatch recorded."""
    async with open_run_store(backend, "shop") as store:
        now = store.now()
        await store.create_run(
            RunRecord("orphan", "three", 5, RunStatus.RUNNING, now, now, owner="dead")
        )
        for step_id, value in (("1", 10), ("2", None)):
            done = value is not None
            await store.begin_step(
                StepRecord(
                    "orphan",
                    step_id,
                    StepKind.REMOTE,
                    "double",
                    StepState.COMPLETED if done else StepState.PENDING,
                    input=5 if done else 10,
                    output=value,
                    dispatched=done,
                    retry=Retry().to_json(),
                )
            )


async def test_reconcile_redispatches_an_attempt_whose_dispatch_was_never_confirmed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An engine that died between checkpointing a step and sending its task left no task on
    the broker: the next engine must send it."""
    app, runs = shop()
    async with dt.open_backend("memory://") as backend:
        await _orphan_unconfirmed_at_step_2(backend)
        async with open_worker(app, backend), open_engine(app, backend) as engine:
            assert await engine.result("orphan") == [10, 20, 40]
            stats = engine.statistics()
    assert (stats.runs_resumed, stats.redispatched, stats.steps_dispatched) == (1, 1, 2)
    assert runs == {"orphan:2": 1, "orphan:3": 1}


async def test_reconcile_applies_a_result_already_in_before_sending_an_unconfirmed_attempt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An engine that died between sending a step's task and checkpointing that it did: the
    worker ran the step and its result waits on the results queue. The next engine applies
    that result (within its grace) instead of sending the task again: the step ran once (it
    ran twice in a chaos run, the second time before its checkpoint)."""
    app, runs = shop()
    async with dt.open_backend("memory://") as backend:
        await _orphan_unconfirmed_at_step_2(backend)
        # What the dead engine sent before it died: run by a worker, its result left queued.
        async with dt.open_queue_transport(backend, namespace="shop") as sender:
            await sender.dispatch(
                dt.RemoteTask(run_id="orphan", step_id="2", attempt=1, name="double", input=10)
            )
        async with open_worker(app, backend):
            await trio.testing.wait_all_tasks_blocked()  # the step ran, its result is queued
        assert runs == {"orphan:2": 1}
        async with open_worker(app, backend), open_engine(app, backend) as engine:
            assert await engine.result("orphan") == [10, 20, 40]
            stats = engine.statistics()
    assert (stats.runs_resumed, stats.redispatched, stats.results_applied) == (1, 0, 2)
    assert runs == {"orphan:2": 1, "orphan:3": 1}


async def test_reconcile_waits_out_a_grace_for_an_unconfirmed_attempt_still_running(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The same, with the step still running on a worker when the next engine replays the run:
    the engine waits ``UNCONFIRMED_GRACE`` for its result before sending the task again (a
    second job, which a second worker would run at once), so the step runs once."""
    app, runs = shop()

    @app.workflow("nap")
    async def nap(ctx: WorkflowContext, seconds: float) -> float:
        return typing.cast("float", await ctx.step("slow", seconds))

    async with dt.open_backend("memory://") as backend:
        async with open_run_store(backend, "shop") as store:
            now = store.now()
            await store.create_run(
                RunRecord("orphan", "nap", 0.5, RunStatus.RUNNING, now, now, owner="dead")
            )
            await store.begin_step(
                StepRecord(
                    "orphan", "1", StepKind.REMOTE, "slow", StepState.PENDING, input=0.5,
                    retry=Retry().to_json(),
                )
            )  # fmt: skip
        async with open_worker(app, backend, concurrency=4):
            async with dt.open_queue_transport(backend, namespace="shop") as sender:
                await sender.dispatch(
                    dt.RemoteTask(run_id="orphan", step_id="1", attempt=1, name="slow", input=0.5)
                )  # what the dead engine sent before it died
            await trio.testing.wait_all_tasks_blocked()  # the worker runs it: it sleeps 0.5 s
            assert runs == {"orphan:1": 1}
            started = trio.current_time()
            async with open_engine(app, backend) as engine:
                assert await engine.result("orphan") == started + 0.5
                stats = engine.statistics()
    assert (stats.runs_resumed, stats.redispatched, stats.steps_dispatched) == (1, 0, 0)
    assert runs == {"orphan:1": 1}
    assert UNCONFIRMED_GRACE > 0.5


async def test_a_claimed_run_of_a_workflow_the_app_lacks_is_failed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, _ = shop()
    async with dt.open_backend("memory://") as backend:
        async with open_run_store(backend, "shop") as store:
            await store.create_run(
                RunRecord("ghost", "retired-workflow", None, RunStatus.PENDING, 0, 0)
            )
        async with open_engine(app, backend) as engine:
            with pytest.raises(RunFailed) as failed:
                await engine.result("ghost")
    assert failed.value.error_type == "UnknownWorkflow"


async def test_result_stops_waiting_when_the_engine_closes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, _ = shop()

    @app.workflow("long")
    async def long(ctx: WorkflowContext, _: Any) -> None:
        await ctx.sleep(1000)

    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend) as engine:
            run_id = await engine.start("long")
            async with trio.open_nursery() as nursery:

                async def close_soon() -> None:
                    await trio.sleep(1)
                    await engine.aclose()

                nursery.start_soon(close_soon)
                with pytest.raises(dt.DurableTrioError, match="closed before run"):
                    await engine.result(run_id)


async def test_a_detached_run_is_picked_up_by_reconcile(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, _ = shop()
    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend), open_engine(app, backend) as engine:
            run_id = await engine.start("three", 1, detach=True)
            assert await engine.status(run_id) is RunStatus.PENDING
            assert await engine.result(run_id) == [2, 4, 8]
    assert trio.current_time() == 5.0  # the first reconcile tick


async def test_results_applied_by_another_engine_reach_the_owner_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = App("shop")

    @app.workflow("wf")
    async def wf(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("served-elsewhere", 1)

    async with dt.open_backend("memory://") as backend:
        async with AsyncExitStack() as stack:
            owner = await stack.enter_async_context(open_engine(app, backend, engine_id="o"))
            other = await stack.enter_async_context(
                open_engine(app, backend, engine_id="x", reconcile=False)
            )
            await owner.start("wf", run_id="r")
            await trio.sleep(2.25)
            # The other engine's results loop took the result: it applies it to the store.
            done = dt.StepResult("r", "1", 1, dt.StepStatus.COMPLETED, output="from x")
            await other._results.on_result(done)
            assert other.statistics().results_applied == 1
            # The other engine rang the store's wakes: the owner's watch re-read the run's
            # waited checkpoint at once (without the ring: at its next tick, every 1 s from
            # its start, t=3) and settled the run.
            assert await owner.result("r") == "from x"
            assert (await owner.get("r")).updated_at == 2.25
            assert trio.current_time() == 2.25
            assert await other.result("r") == "from x"  # read from the store
            assert owner.statistics().runs_completed == 1


# --------------------------------------------------------------------------- non-determinism


def versioned(first_step: str, *, stop_early: bool = False) -> App:
    app = App("shop")

    @app.step("reserve")
    async def reserve(_: Any) -> str:
        return "reserved"

    @app.step("charge")
    async def charge(_: Any) -> str:
        return "charged"

    @app.workflow("order")
    async def order(ctx: WorkflowContext, _: Any) -> list[Any]:
        first = await ctx.step(first_step)
        if stop_early:
            return [first]
        await ctx.sleep(60)
        return [first, await ctx.step("charge")]

    return app


async def blocked(engine: Engine, run_id: str) -> RunRecord:
    """Wait until ``run_id`` is parked blocked (its replay hit non-determinism)."""
    return await wait_status(engine, run_id, RunStatus.BLOCKED)


async def test_replay_asking_for_another_step_blocks_the_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    v1, v2 = versioned("reserve"), versioned("charge")
    async with dt.open_backend("memory://") as backend:
        async with open_worker(v1, backend), open_engine(v1, backend) as old:
            await old.start("order", run_id="o")
            await trio.sleep(10)
        async with open_worker(v2, backend), open_engine(v2, backend) as new:
            record = await blocked(new, "o")
            stats = new.statistics()
    assert record.error["type"] == "NonDeterminismError"
    assert record.error["stepId"] == "1"
    assert (record.error["expected"], record.error["found"]) == (
        "ctx.step('reserve')",
        "ctx.step('charge')",
    )
    assert "history holds ctx.step('reserve'), the workflow now asks for ctx.step('charge')" in (
        record.error["message"]
    )
    assert stats.nondeterminism_failures == stats.runs_blocked == 1


async def test_history_the_workflow_no_longer_reaches_is_non_determinism(
    autojump_clock: trio.testing.MockClock,
) -> None:
    v1, v2 = versioned("reserve"), versioned("reserve", stop_early=True)
    async with dt.open_backend("memory://") as backend:
        async with open_worker(v1, backend), open_engine(v1, backend) as old:
            await old.start("order", run_id="o")
            await trio.sleep(10)
        async with open_worker(v2, backend), open_engine(v2, backend) as new:
            record = await blocked(new, "o")
    assert "history holds steps it no longer asks for: 2" in record.error["message"]
    assert (record.error["expected"], record.error["found"]) == ("2: ctx.sleep(...)", None)


async def test_non_determinism_inside_gather_stops_the_siblings(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = App("shop")
    which = {"name": "a"}

    @app.step("a")
    async def a(_: Any) -> str:
        return "a"

    @app.step("b")
    async def b(_: Any) -> str:
        await trio.sleep(1000)
        return "b"

    @app.workflow("wf")
    async def wf(ctx: WorkflowContext, _: Any) -> list[Any]:
        return await ctx.gather(ctx.step("b"), ctx.step(which["name"]))

    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend, close_timeout=0.0):
            async with open_engine(app, backend) as old:
                await old.start("wf", run_id="g")
                await trio.sleep(1)
            which["name"] = "b"  # step 2 was 'a' in history
            async with open_engine(app, backend) as new:
                record = await blocked(new, "g")
    assert record.updated_at == 1.0  # blocked at once: not after step 1's 1000 s


def test_non_determinism_error_names_the_step() -> None:
    exc = NonDeterminismError("boom", run_id="r", step_id="3")
    assert (exc.run_id, exc.step_id, str(exc)) == ("r", "3", "boom")


# --------------------------------------------------------------------------- cancel


async def test_cancel_stops_the_run_and_its_running_step(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, runs = shop()

    @app.workflow("stuck")
    async def stuck(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("hang")

    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend, on_error=Errors()) as worker:
            async with open_engine(app, backend) as engine:
                run_id = await engine.start("stuck", run_id="k")
                await trio.sleep(5)
                assert await engine.cancel(run_id, reason="customer changed their mind")
                assert not await engine.cancel(run_id)  # already over
                with pytest.raises(RunCancelled, match="customer changed their mind"):
                    await engine.result(run_id)
                assert await engine.status(run_id) is RunStatus.CANCELLED
                await trio.sleep(1)  # control message taken, the step cancelled, its result late
                stats = engine.statistics()
            wstats = worker.statistics()
    assert runs == {"k:1": 1}
    assert (wstats.cancelled, wstats.running) == (1, 0)
    assert (stats.runs_cancelled, stats.orphan_results, stats.active_runs) == (1, 1, 0)


async def test_a_run_cancelled_elsewhere_is_cancelled_by_its_owner_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The canceller writes the cancel mark; the owner delivers it (RunCancelled in the
    workflow, which does not catch it) and settles the run (docs/engine.md, "Cancellation
    inside a workflow")."""
    app = App("shop")
    reached: list[float] = []

    @app.workflow("long")
    async def long(ctx: WorkflowContext, _: Any) -> None:
        await ctx.sleep(1000)
        reached.append(trio.current_time())

    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend, engine_id="o") as owner:
            async with open_engine(app, backend, engine_id="x", reconcile=False) as other:
                await owner.start("long", run_id="c")
                await trio.sleep(1)
                assert await other.cancel("c")
                # The mark rang the store's wakes: the owner looked at once (without the ring,
                # at its look every run_lease / 3, 10 s).
                assert (await other.get("c")).updated_at == 1.0
                assert owner.statistics().active_runs == 0
                assert owner.statistics().runs_cancelled == 1
    assert reached == []


# --------------------------------------------------------------------------- local steps


async def test_a_local_step_is_checkpointed_retried_durably_and_never_rerun_on_replay(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = App("shop")
    calls: list[tuple[int, float]] = []

    def lookup() -> dict[str, Any]:
        info = step_info()
        calls.append((info.attempt, trio.current_time()))
        if info.attempt < 3:
            raise Flaky("not yet")
        return {"rate": 1.25, "key": info.idempotency_key, "kind": info.kind}

    async def fetch() -> list[int]:
        await trio.sleep(1)
        return [1, 2]

    @app.workflow("wf")
    async def wf(ctx: WorkflowContext, _: Any) -> list[Any]:
        rate = await ctx.run("rate", lookup, retry=Retry(initial=2.0, jitter=0.0))
        listed = await ctx.run("fetch", fetch)
        await ctx.sleep(100)
        return [rate, listed]

    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend, engine_id="a") as first:
            await first.start("wf", run_id="l")
            await trio.sleep(50)
        async with open_engine(app, backend, engine_id="b") as second:
            outcome = await second.result("l")
    assert calls == [(1, 0.0), (2, 2.0), (3, 6.0)]
    assert outcome == [{"rate": 1.25, "key": "l:1", "kind": "local"}, [1, 2]]


# --------------------------------------------------------------------------- Retry


def test_retry_schedule_is_exponential_capped_and_reproducible_with_a_seed() -> None:
    policy = Retry(max_attempts=6, initial=1.0, multiplier=2.0, max_delay=10.0, jitter=0.0)
    assert policy.schedule() == [1.0, 2.0, 4.0, 8.0, 10.0]
    jittery = Retry(max_attempts=6, initial=1.0, multiplier=2.0, max_delay=10.0, jitter=0.5)
    once, twice = jittery.schedule(seed=7), jittery.schedule(seed=7)
    assert once == twice
    assert once != jittery.schedule(seed=8)
    for delay, base in zip(once, [1.0, 2.0, 4.0, 8.0, 10.0], strict=True):
        assert base * 0.5 <= delay <= base


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"initial": -1.0},
        {"multiplier": 0.5},
        {"jitter": 1.5},
        {"max_delay": float("inf")},
        {"non_retryable": (int,)},
    ],
)
def test_retry_rejects_options_that_cannot_work(kwargs: dict[str, Any]) -> None:
    with pytest.raises(dt.ConfigError):
        Retry(**kwargs)


def test_a_retry_cap_follows_initial_and_refuses_to_sit_below_it() -> None:
    """``Retry(initial=600)`` waits 600 s (it waited the default cap's 60); a cap set below
    ``initial`` is refused; a checkpoint stored with one keeps its delays and its attempts."""
    assert Retry(initial=600.0, jitter=0.0).schedule() == [600.0, 600.0]
    assert Retry(initial=5.0, jitter=0.0).max_delay == 60.0
    with pytest.raises(dt.ConfigError, match=r"max_delay \(60.0 s\) is below initial \(600.0"):
        Retry(initial=600.0, max_delay=60.0)
    old = {"maxAttempts": 7, "initial": 600.0, "multiplier": 2.0, "maxDelay": 60.0, "jitter": 0}
    stored = StoredRetry.from_json(old).policy
    assert (stored.max_attempts, stored.schedule()) == (7, [60.0] * 6)


def test_retry_matches_non_retryable_types_and_names() -> None:
    policy = Retry(max_attempts=3, non_retryable=Declined)
    assert policy.is_non_retryable(Declined())
    assert not policy.is_non_retryable(Flaky())
    assert policy.retries_after(1, "Flaky")
    assert not policy.retries_after(1, "Declined")
    assert not policy.retries_after(3, None)
    assert policy.to_json()["nonRetryable"] == ["Declined"]


async def test_engine_seed_makes_jitter_reproducible(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, _ = shop()
    jittery = Retry(max_attempts=3, initial=10.0, jitter=1.0)

    @app.workflow("wf")
    async def wf(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("fail-then-succeed", 2, retry=jittery)

    ends = []
    for _ in range(2):
        async with dt.open_backend("memory://") as backend:
            async with open_worker(app, backend, on_error=Errors()):
                async with open_engine(app, backend, seed=42) as engine:
                    start = trio.current_time()
                    await engine.result(await engine.start("wf", run_id="same"))
                    ends.append(trio.current_time() - start)
    assert ends[0] == ends[1]
    assert 0 < ends[0] < 30.0


async def once_async(x: Any) -> Any:
    return x


def test_the_app_refuses_what_cannot_work() -> None:
    app = App("shop")
    with pytest.raises(dt.ConfigError, match="must be a function"):
        app.step("not-code")(42)  # type: ignore[type-var]
    with pytest.raises(dt.ConfigError, match="cpu=True runs a plain"):  # a def: in a thread
        app.step("async-only", cpu=True)(once_async)

    @app.step("once")
    async def once(x: Any) -> Any:
        return x

    with pytest.raises(dt.ConfigError, match="already registered"):
        app.step("once")(once)
    with pytest.raises(dt.ConfigError):
        App("")


async def test_open_worker_refuses_unknown_steps() -> None:
    app, _ = shop()
    async with dt.open_backend("memory://") as backend:
        with pytest.raises(dt.ConfigError, match="no step"):
            async with open_worker(app, backend, steps=["nope"]):
                pass  # pragma: no cover


# --------------------------------------------------------------------------- command line

FLOWS = """
from durable_trio._engine import App, WorkflowContext

app = App("cli-flows")


@app.step("greet")
async def greet(name):
    return f"hello, {name}"


@app.workflow("hello")
async def hello(ctx: WorkflowContext, name):
    return await ctx.step("greet", name)


@app.workflow("broken")
async def broken(ctx: WorkflowContext, _):
    raise ValueError("nope")
"""


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_engine_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    status: int = args.func(args)
    return status


def test_cli_run_starts_a_run_and_prints_its_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "cli_flows.py").write_text(FLOWS)
    target = f"{tmp_path / 'cli_flows.py'}:app"
    backend = f"sqlite:///{tmp_path / 'cli.db'}".replace("///", "////", 1)
    assert (
        _cli("run", target, "hello", "--input", '"trio"', "--backend", backend, "--with-worker")
        == 0
    )
    assert json.loads(capsys.readouterr().out)["output"] == "hello, trio"
    assert _cli("run", target, "broken", "--backend", backend, "--run-id", "b") == 1
    assert json.loads(capsys.readouterr().out)["error"]["type"] == "ValueError"
    assert _cli("run", target, "hello", "--backend", backend, "--detach", "--run-id", "d") == 0
    assert json.loads(capsys.readouterr().out) == {"runId": "d", "status": "pending"}
    assert _cli("run", target, "hello", "--backend", backend, "--input", "{oops") == 2
    # The input as the positional a newcomer types first, given once
    assert _cli("run", target, "hello", '"you"', "--backend", backend, "--with-worker") == 0
    assert json.loads(capsys.readouterr().out)["output"] == "hello, you"
    assert _cli("run", target, "hello", '"a"', "--input", '"b"', "--backend", backend) == 2
    assert "give the run's input once" in capsys.readouterr().err
    assert _cli("run", target, "hello", "{oops", "--backend", backend) == 2
    assert capsys.readouterr().err.startswith("error: INPUT is not JSON")


async def test_take_over_drives_one_orphaned_run_and_leaves_the_others(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = napper()
    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend, reconcile=False) as engine:
            for run_id in ("a", "b"):
                await engine.start("nap", run_id=run_id, detach=True)
            assert await engine.take_over("a") is True
            assert await engine.take_over("a") is True  # already driven here
            other = await engine.get("b")
            assert (other.status, other.owner) == (RunStatus.PENDING, None)
            assert await engine.result("a") is None
            assert trio.current_time() == 60
            assert await engine.take_over("a") is False  # ended
            assert (await engine.get("b")).status is RunStatus.PENDING
            assert await engine.take_over("nobody") is False
            async with open_engine(app, backend, reconcile=False, engine_id="live") as live:
                await live.start("nap", run_id="c")
                assert await engine.take_over("c") is False  # a live engine drives it
                assert (await engine.get("c")).owner == "live"
                assert (await engine.get("b")).owner is None  # nothing claimed meanwhile


RETRIED_FLOWS = """
from pathlib import Path

from durable_trio._engine import App, Retry, WorkflowContext

app = App("retried")


@app.step("fetch", retry=Retry(max_attempts=1))
async def fetch(flag):
    if not Path(flag).exists():
        raise RuntimeError("not yet")
    return "fetched"


@app.workflow("fetch-once")
async def fetch_once(ctx: WorkflowContext, flag):
    return await ctx.step("fetch", flag)
"""


@pytest.mark.chaos
def test_cli_run_with_an_existing_retried_run_id_drives_it_to_its_end(tmp_path: Path) -> None:
    """Issue 30, item 3, with real processes: a run fails, ``runs retry`` reopens it (pending,
    no owner), and ``run --run-id R --with-worker`` (an engine that reconciles nothing) takes
    that run over, runs its step's next attempt and prints the result, instead of waiting for
    another engine until its ``--timeout``."""
    import subprocess
    import sys

    (tmp_path / "retried_flows.py").write_text(RETRIED_FLOWS)
    flag = tmp_path / "ready"
    backend = ["--backend", f"sqlite:///{tmp_path / 'r.db'}"]
    target = "retried_flows:app"

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "durable_trio", *argv],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    run = ["run", target, "fetch-once", "--run-id", "R", "--input", json.dumps(str(flag))]
    failed = cli(*run, "--with-worker", *backend)
    assert failed.returncode == 1, failed.stderr
    assert json.loads(failed.stdout)["status"] == "failed"
    flag.touch()
    retried = cli("runs", "retry", "R", "--namespace", "retried", *backend)
    assert retried.returncode == 0, retried.stderr
    done = cli(*run, "--with-worker", "--timeout", "20", *backend)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"runId": "R", "status": "completed", "output": "fetched"}


def test_cli_load_app_explains_what_is_wrong(tmp_path: Path) -> None:
    (tmp_path / "not_an_app.py").write_text("app = 42\n")
    with pytest.raises(dt.ConfigError, match="is not a durable_trio App"):
        load_app(f"{tmp_path / 'not_an_app.py'}:app")
    with pytest.raises(dt.ConfigError, match="cannot import"):
        load_app("no_such_module_anywhere:app")


# --------------------------------------------------------------------------- leaving the block


class Mine(Exception):
    """The body's own exception."""


class DefectiveRunStore(MemoryRunStore):
    """``renew_runs`` raises a programming error (not a ``BrokerError``), which ends the
    engine's lease keeper and with it the engine; ``raised`` is set just before."""

    def __init__(self) -> None:
        super().__init__()
        self.raised = trio.Event()

    async def renew_runs(self, owner: str, run_ids: Sequence[str], lease: float) -> set[str]:
        self.raised.set()
        raise TypeError("a store defect")


def napper() -> App:
    app = App("nap")

    @app.workflow("nap")
    async def nap(ctx: WorkflowContext, _: Any) -> None:
        await ctx.sleep(60)

    return app


async def test_the_body_exception_leaves_open_engine_bare_when_a_loop_fails_with_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The body raises the instant the lease keeper (first round at run_lease / 3 = 1 s) meets
    a store defect: the caller gets its own exception, the defect attached."""
    store = DefectiveRunStore()

    async def body() -> None:
        async with dt.open_backend("memory://") as backend:
            async with open_engine(napper(), backend, store=store, run_lease=3.0) as engine:
                await engine.start("nap", run_id="n")
                await store.raised.wait()
                raise Mine("mine")

    with pytest.raises(Mine, match="mine") as caught:
        await body()
    assert trio.current_time() == 1.0
    assert isinstance(caught.value.__context__, TypeError)
    assert caught.value.__notes__ == [
        "durable_trio: the engine also raised TypeError('a store defect') at the same time "
        "(attached as __context__)"
    ]


async def test_the_body_exception_leaves_open_engine_bare_when_its_transport_fails_with_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The engine's transport meets a broker defect finalizing a step's result the
    instant the body raises: its exception leaves open_engine as it is, the defect attached."""
    app, _ = shop()
    broker = DefectiveBroker(on_queue="shop:results")
    backend = dt.Backend(url="memory://", broker=broker, keys=MemoryKeyStore())

    async def body() -> None:
        async with open_worker(app, backend), open_engine(app, backend) as engine:
            assert broker.on_queue == engine.transport.names.results
            await engine.start("three", 1, run_id="r")
            await broker.raised.wait()
            raise Mine("mine")

    with pytest.raises(Mine, match="mine") as caught:
        await body()
    assert trio.current_time() == 0.0
    assert isinstance(caught.value.__context__, TypeError)
    assert caught.value.__notes__ == [
        "durable_trio: the engine also raised TypeError('a broker defect') at the same time "
        "(attached as __context__)"
    ]


async def test_a_lone_engine_loop_failure_leaves_open_engine_bare(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = DefectiveRunStore()

    async def body() -> None:
        async with dt.open_backend("memory://") as backend:
            async with open_engine(napper(), backend, store=store, run_lease=3.0) as engine:
                await engine.start("nap", run_id="n")
                await trio.sleep_forever()

    with pytest.raises(TypeError, match="a store defect"):
        await body()
    assert trio.current_time() == 1.0


# --------------------------------------------------------------------------- the Engine class


def test_every_public_engine_method_has_resolvable_type_hints() -> None:
    """``Engine.list`` shadows the builtin in the class body: no annotation may name it."""
    public = {
        name: member.fget if isinstance(member, property) else member
        for name, member in vars(Engine).items()
        if not name.startswith("_") and (callable(member) or isinstance(member, property))
    }
    assert {"list", "history", "start", "result", "cancel", "statistics"} <= set(public)
    hints = {name: typing.get_type_hints(function) for name, function in public.items()}
    assert hints["list"]["return"] == builtins.list[RunRecord]
    assert hints["history"]["return"] == builtins.list[StepRecord]
    assert hints["list"]["status"] == RunStatus | str | None
    assert hints["statistics"]["return"] is dt.EngineStatistics


def test_the_counters_are_the_statistics_fields() -> None:
    """``_counters`` spells out the snapshot's field names so the engine counts without
    importing its class (built on the first ``Engine.statistics``)."""
    import attrs

    from durable_trio._engine._counters import COUNTERS, GAUGES

    names = [field.name for field in attrs.fields(dt.EngineStatistics)]
    assert set(names) >= GAUGES
    assert tuple(name for name in names if name not in GAUGES) == COUNTERS
