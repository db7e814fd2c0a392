"""Step timeouts (issue #15 item 4): start-to-close ``timeout=`` (the worker cancels the
handler; the engine's guard when the worker is gone), ``schedule_to_start_timeout=``, the
default report of a step waiting on a queue no live worker serves, unknown step names refused,
and ``Engine.waiting``. Exact virtual times (autojump_clock, memory backend)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import typing
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio import App, StepTimedOut, WorkflowContext, open_engine, open_worker
from durable_trio._engine import RunFailed, StepState
from durable_trio._engine._step_timeouts import StepTimeouts, UnknownStep
from durable_trio._engine._step_watch import StepNotStarted
from durable_trio._transport._options import log_error
from durable_trio.brokers import Job, JobState, SupportsJobState, SupportsQueueListing
from durable_trio.cli._engine import add_engine_commands
from durable_trio.cli._health import prometheus_text, render_text, snapshot
from helpers import Errors

if TYPE_CHECKING:
    from pathlib import Path

NO_JITTER = dt.Retry(max_attempts=3, initial=1.0, multiplier=1.0, jitter=0.0)


def timeout_app(log: list[tuple[str, float]]) -> App:
    app = App("shop")

    @app.step("slow", timeout=5, retry=NO_JITTER)
    async def slow(seconds: float) -> float:
        info = dt.step_info()
        log.append((f"start {info.attempt}", trio.current_time()))
        try:
            await trio.sleep(seconds)
        except trio.Cancelled:
            log.append((f"cancelled {info.attempt}", trio.current_time()))
            raise
        return trio.current_time()

    @app.workflow("one")
    async def one(ctx: WorkflowContext, args: dict[str, Any]) -> Any:
        return await ctx.step(
            args["step"],
            args.get("input"),
            timeout=args.get("timeout"),
            schedule_to_start_timeout=args.get("sts"),
        )

    return app


# --------------------------------------------------------------------------- start-to-close


async def test_a_step_past_its_timeout_is_cancelled_and_retried_per_its_policy(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log: list[tuple[str, float]] = []
    app = timeout_app(log)
    async with dt.open_backend("memory://") as backend:
        async with (
            open_worker(app, backend, on_error=Errors()),
            open_engine(app, backend) as engine,
        ):
            await engine.start("one", {"step": "slow", "input": 100}, run_id="r")
            with pytest.raises(RunFailed) as failed:
                await engine.result("r")
            history = await engine.history("r")
            stats = engine.statistics()
    # attempt n starts at (n-1) * (5 + 1): 5 s of handler, 1 s of backoff
    assert log == [
        ("start 1", 0.0),
        ("cancelled 1", 5.0),
        ("start 2", 6.0),
        ("cancelled 2", 11.0),
        ("start 3", 12.0),
        ("cancelled 3", 17.0),
    ]
    assert trio.current_time() == 17.0
    assert failed.value.error["error"]["code"] == "StepTimedOut"
    assert "did not finish within its timeout of 5 s" in failed.value.error["error"]["message"]
    assert (history[0].attempt, history[0].status) == (3, StepState.FAILED)
    assert history[0].retry["timeouts"] == {"startToClose": 5.0}
    assert (stats.retries, stats.steps_timed_out) == (2, 0)  # the worker's timer did it


async def test_a_step_that_blocks_the_loop_past_its_timeout_is_timed_out_not_completed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Attempt 1 holds the event loop 4 s (a blocking call: the clock moves, no checkpoint)
    with ``timeout=2``, then returns. Its cancel never landed; it was once recorded
    ``completed`` after 4 s, silently. Now it is a timed-out attempt whose error names the
    blocking (its value dropped), reported by the worker, and the retry completes."""
    log: list[tuple[str, float]] = []
    app = App("shop")

    @app.step("blocking", timeout=2, retry=NO_JITTER)
    async def blocking(_: Any) -> str:
        attempt = dt.step_info().attempt
        log.append((f"start {attempt}", trio.current_time()))
        if attempt == 1:
            autojump_clock.jump(4)  # as time.sleep(4) would: no await, the loop held
        return f"value {attempt}"

    @app.workflow("one")
    async def one(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("blocking")

    worker_errors = Errors()
    async with dt.open_backend("memory://") as backend:
        async with (
            open_worker(app, backend, on_error=worker_errors),
            open_engine(app, backend) as engine,
        ):
            await engine.start("one", run_id="r")
            assert await engine.result("r") == "value 2"
            (step,) = await engine.history("r")
    assert log == [("start 1", 0.0), ("start 2", 5.0)]  # 4 s held, then the 1 s backoff
    first, second = step.attempts
    assert isinstance(first, dict)
    assert isinstance(second, dict)
    assert (first["outcome"], second["outcome"]) == ("timed_out", "completed")
    message = first["error"]["message"]
    assert "ran 4.0 s, past its timeout of 2 s, and could not be cancelled" in message
    assert "it blocked the event loop" in message
    assert "its result is dropped" in message
    assert any("blocked the event loop" in str(e) for e in worker_errors.seen)


async def test_ctx_step_timeout_overrides_the_steps_and_a_quick_step_is_unaffected(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log: list[tuple[str, float]] = []
    app = timeout_app(log)
    async with dt.open_backend("memory://") as backend:
        async with (
            open_worker(app, backend, on_error=Errors()),
            open_engine(app, backend) as engine,
        ):
            await engine.start("one", {"step": "slow", "input": 7, "timeout": 10}, run_id="r")
            assert await engine.result("r") == 7.0
            stats = engine.statistics()
            await trio.sleep(60)  # the engine's guard finds the step settled: nothing happens
            after = engine.statistics()
    assert log == [("start 1", 0.0)]
    assert (stats.retries, after.retries, after.steps_timed_out) == (0, 0, 0)


async def test_the_engine_fails_an_attempt_whose_worker_is_gone_at_timeout_plus_grace(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A worker killed mid-step (here: a claim by a worker that never beats, as a SIGKILLed
    one looks once its liveness key is gone): the engine fails the attempt at exactly
    ``ready + timeout + step_timeout_grace`` and the retry runs on a live worker, long before
    the broker's stalled threshold."""
    log: list[tuple[str, float]] = []
    app = timeout_app(log)
    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend, step_timeout_grace=2) as engine:
            queue = engine.transport.names.task_queue("slow")
            await engine.start("one", {"step": "slow", "input": 1}, run_id="r")
            await trio.sleep(0.5)
            ghost = await backend.broker.pop_from(queue, worker="ghost")  # claimed, then killed
            assert ghost is not None
            async with open_worker(app, backend, on_error=Errors()):
                assert await engine.result("r") == 9.0
            stats = engine.statistics()
            history = await engine.history("r")
    # failed at 0 + 5 + 2 = 7, retried after 1 s of backoff, ran 1 s
    assert log == [("start 2", 8.0)]
    assert (stats.steps_timed_out, stats.retries) == (1, 1)
    assert history[0].attempt == 2
    assert "its worker 'ghost' is gone" in history[0].error["message"]


async def test_the_guard_leaves_a_live_worker_to_its_own_timer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The job waited 20 s in a backlog before a live worker took it: the engine's first guard
    (at 7 s) finds it waiting and looks again; the worker's own timeout ends it, not the
    engine."""
    log: list[tuple[str, float]] = []
    app = timeout_app(log)
    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend, step_timeout_grace=2, on_error=Errors()) as engine:
            await engine.start("one", {"step": "slow", "input": 100}, run_id="r")
            await trio.sleep(20)
            async with open_worker(app, backend, on_error=Errors()):
                with pytest.raises(RunFailed):
                    await engine.result("r")
            stats = engine.statistics()
    assert log[:2] == [("start 1", 20.0), ("cancelled 1", 25.0)]
    assert stats.steps_timed_out == 0


# --------------------------------------------------------------------------- schedule-to-start


async def test_a_step_no_worker_takes_fails_at_its_schedule_to_start_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = timeout_app([])
    errors = Errors()
    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend, on_error=errors) as engine:
            await trio.sleep(1)
            await engine.start("one", {"step": "slow", "input": 1, "sts": 4}, run_id="r")
            with pytest.raises(RunFailed) as failed:
                await engine.result("r")
            stats = engine.statistics()
    assert trio.current_time() == 5.0
    error = failed.value.error["error"]
    assert error["code"] == "ScheduleToStartTimeout"
    assert error["retryable"] is False
    assert error["message"] == (
        "ScheduleToStartTimeout: no worker took step 'slow' within its "
        "schedule_to_start_timeout of 4 s: it waited 4.0 s on queue 'shop:tasks:slow'; "
        "no live worker serves it"
    )
    assert (stats.steps_not_started, stats.retries) == (1, 0)
    assert errors.seen == []  # failed before the default report (10 s) was due


async def test_a_step_taken_in_time_is_not_failed_by_schedule_to_start(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log: list[tuple[str, float]] = []
    app = timeout_app(log)
    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend) as engine:
            await engine.start("one", {"step": "slow", "input": 10, "sts": 4}, run_id="r")
            await trio.sleep(3)
            async with open_worker(app, backend, on_error=Errors()):
                with pytest.raises(RunFailed) as failed:  # its 5 s timeout, three times
                    await engine.result("r")
            stats = engine.statistics()
    assert log[0] == ("start 1", 3.0)
    assert failed.value.error["error"]["code"] == "StepTimedOut"
    assert stats.steps_not_started == 0


# --------------------------------------------------------------------------- defaults


async def test_the_default_hook_logs_a_report_in_one_line(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A finding reported without being raised (here ``StepNotStarted``, with no error hook
    given) is one ERROR line, its class's name and its message: no traceback of nothing, no
    module path (what ``durable-trio run`` printed twice on stderr). An error that was raised
    keeps its traceback."""
    app = App("shop")

    @app.workflow("order")
    async def order(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("charge-crad", 1)

    caplog.set_level(logging.ERROR, logger="durable_trio")
    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend) as engine:
            await engine.start("order", run_id="r")
            await trio.sleep(10)
            await trio.testing.wait_all_tasks_blocked()
    [record] = [r for r in caplog.records if r.name == "durable_trio"]
    assert record.exc_info is None
    assert record.getMessage().startswith("StepNotStarted: step 'charge-crad' (run r, step 1)")
    assert "\n" not in logging.Formatter().format(record)

    caplog.clear()
    try:
        raise dt.BrokerError("raised")
    except dt.BrokerError as exc:
        log_error(exc)
    [record] = caplog.records
    assert record.getMessage() == "raised"
    assert record.exc_info is not None
    assert record.exc_info[1] is not None


async def test_a_misspelt_step_name_is_reported_within_the_default_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The engine's app registers no steps (its workers are elsewhere): the misspelt name
    cannot be refused, so the default report names the queue at 10 s, once, and the run waits
    on; ``Engine.waiting`` says where."""
    app = App("shop")

    @app.workflow("order")
    async def order(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("charge-crad", 1)

    errors = Errors()
    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend, on_error=errors) as engine:
            await engine.start("order", run_id="r")
            await trio.sleep(9.9)
            assert errors.seen == []
            await trio.sleep(0.1)
            await trio.testing.wait_all_tasks_blocked()
            assert [type(e) for e in errors.seen] == [StepNotStarted]
            reported_at = trio.current_time()
            await trio.sleep(50)
            waits = await engine.waiting("r")
            status = await engine.status("r")
            stats = engine.statistics()
    assert reported_at == 10.0
    assert str(errors.seen[0]) == (
        "step 'charge-crad' (run r, step 1) has waited 10.0 s on queue "
        "'shop:tasks:charge-crad', which no live worker serves: is the step name right, "
        "and is a worker serving it running?"
    )
    assert status is dt.RunStatus.RUNNING
    assert stats.steps_unstarted_reported == 1
    [wait] = waits
    assert (wait.queue, wait.waited, wait.live_workers, wait.taken) == (
        "shop:tasks:charge-crad",
        60.0,
        0,
        None,  # its job is looked at only by the checks due (the report makes none)
    )
    assert wait.describe() == (
        "step 'charge-crad' (id 1, attempt 1) has waited 60.0 s on queue "
        "'shop:tasks:charge-crad'; no live worker serves it"
    )


async def test_unstarted_reports_are_one_per_queue_per_interval_with_a_count(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """No worker serves the queue (a worker paused or down) while 10 runs a second wait on
    it: once one report per attempt (300 lines in 30 s); now one per queue per 10 s, each
    counting the attempts it stands for. Another queue is reported on its own."""
    app = App("shop")

    @app.workflow("order")
    async def order(ctx: WorkflowContext, step: str) -> Any:
        return await ctx.step(step, 1)

    errors = Errors()
    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend, on_error=errors) as engine:
            for i in range(300):
                await trio.sleep_until(i / 10)
                await engine.start("order", "charge", run_id=f"r{i}")
            await engine.start("order", "refund", run_id="other")  # at 29.9
            await trio.sleep_until(60)
            stats = engine.statistics()
    seen = [e for e in errors.seen if isinstance(e, StepNotStarted)]
    assert len(seen) == len(errors.seen)
    assert [(e.name, e.run_id, e.suppressed) for e in seen] == [
        ("charge", "r0", 0),  # due at 10.0
        ("charge", "r100", 99),  # 20.0: the 99 due in 10.1 .. 19.9
        ("charge", "r200", 99),  # 30.0
        ("refund", "other", 0),  # 39.9: its own queue
    ]
    assert "(99 more attempt(s) on this queue found waiting since the last report" in str(
        seen[1]
    )
    assert stats.steps_unstarted_reported == 301  # every attempt counted


async def test_a_backlog_with_a_live_worker_is_not_reported(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = App("shop")

    @app.step("busy")
    async def busy(_: Any) -> None:
        await trio.sleep(30)

    @app.workflow("many")
    async def many(ctx: WorkflowContext, n: int) -> None:
        await ctx.gather(*(ctx.step("busy") for _ in range(n)))

    errors = Errors()
    async with dt.open_backend("memory://") as backend:
        async with (
            open_worker(app, backend, concurrency=1, on_error=Errors()),
            open_engine(app, backend, on_error=errors) as engine,
        ):
            await engine.start("many", 3, run_id="r")
            await engine.result("r")
            stats = engine.statistics()
    assert trio.current_time() == 90.0
    assert errors.seen == []
    assert stats.steps_unstarted_reported == 0


async def test_unknown_step_names_are_refused_at_once_when_the_app_registers_steps(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = timeout_app([])
    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend) as engine:
            await engine.start("one", {"step": "slwo"}, run_id="r")
            with pytest.raises(RunFailed) as failed:
                await engine.result("r")
            history = await engine.history("r")
    assert trio.current_time() == 0.0
    assert failed.value.error_type == "UnknownStep"
    assert str(failed.value.error["message"]) == (
        "ctx.step: app 'shop' registers no step named 'slwo' (its steps: 'slow'); "
        "did you mean 'slow'?"
    )
    assert history == []  # nothing checkpointed, nothing dispatched
    assert issubclass(UnknownStep, dt.ConfigError)


# --------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan")])
def test_timeouts_must_be_positive_seconds(bad: float) -> None:
    with pytest.raises(dt.ConfigError, match="timeout"):
        App("a").step("s", timeout=bad)
    with pytest.raises(dt.ConfigError, match="schedule_to_start_timeout"):
        StepTimeouts.given("ctx.step", None, bad)
    with pytest.raises(TypeError, match="timeout"):
        App("a").step("s", timeout="5")  # type: ignore[arg-type]


def test_a_worker_timeout_error_is_retryable() -> None:
    assert StepTimedOut("x").retryable is True
    assert StepTimedOut.code == "StepTimedOut"


# --------------------------------------------------------------------------- job state


async def test_job_state(broker: Any) -> None:
    """Every broker answers SupportsJobState: waiting, claimed (and by whom), or gone."""
    assert isinstance(broker, SupportsJobState)
    broker = typing.cast("Any", broker)
    await broker.push_on("q", Job("a", b"{}"))
    await broker.push_on("q", Job("b", b"{}"))
    await broker.push_on("q", Job("c", b"{}"), delay=60)
    assert await broker.job_state("q", "a") == JobState(claimed=False)
    assert await broker.job_state("q", "c") == JobState(claimed=False)
    claimed = await broker.pop_from("q", worker="w1")
    assert claimed is not None
    assert claimed.id == "a"
    assert await broker.job_state("q", "a") == JobState(claimed=True, worker="w1")
    assert await broker.job_state("q", "b") == JobState(claimed=False)
    assert await broker.job_state("q", "zz") is None
    assert await broker.job_state("other", "a") is None
    assert await broker.complete_job(claimed.lease, "q")
    assert await broker.job_state("q", "a") is None


# --------------------------------------------------------------------------- health, metrics


async def test_health_and_metrics_list_an_orphaned_queue(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A queue with waiting jobs and no live worker is listed (table line and metric); a
    served queue and an empty one are not."""
    async with dt.open_backend("memory://") as backend:
        async with dt.open_queue_transport(backend, namespace="ops", instance_id="w1") as transport:
            transport.handle("served", _forever)
            await transport.dispatch(
                dt.RemoteTask(run_id="r", step_id="1", attempt=1, name="sevred")
            )
            await transport.dispatch(
                dt.RemoteTask(run_id="r", step_id="2", attempt=1, name="sevred")
            )
            await transport.dispatch(
                dt.RemoteTask(run_id="r", step_id="3", attempt=1, name="served")
            )
            await trio.sleep(1)
            groups = await snapshot(backend, "ops")
    assert groups is not None
    assert [(g.group, g.depth, len(g.live_workers)) for g in groups] == [
        ("served", 0, 1),
        ("sevred", 2, 0),
    ]
    text = render_text(groups, "ops")
    assert (
        "orphaned: queue 'ops:tasks:sevred' has 2 waiting job(s) and no live worker "
        "(a misspelt step name, or no worker serving it is running)"
    ) in text
    metrics = prometheus_text(groups, namespace="ops")
    assert 'durable_trio_queue_orphaned{queue="ops:tasks:sevred"} 1' in metrics
    assert "ops:tasks:served" not in metrics


async def test_redis_health_lists_an_orphaned_queue(redis_url: str) -> None:
    async with dt.open_backend(redis_url) as backend:
        await backend.broker.push_on("ops:tasks:gone", Job("j1", b"{}"))
        await backend.broker.push_on("ops:tasks:gone", Job("j2", b"{}"), delay=60)
        await backend.broker.push_on("other:tasks:x", Job("j3", b"{}"))
        groups = await snapshot(backend, "ops")
        listed = await backend.broker.waiting_queues("ops:tasks:")  # type: ignore[attr-defined]
    assert listed == ["ops:tasks:gone"]
    assert groups is not None
    assert [(g.group, g.depth, g.live_workers) for g in groups] == [("gone", 2, ())]
    assert 'durable_trio_queue_orphaned{queue="ops:tasks:gone"} 1' in prometheus_text(
        groups, namespace="ops"
    )


async def _forever(_: dt.RemoteTask) -> None:
    await trio.sleep_forever()


# --------------------------------------------------------------------------- durable-trio run

FLOWS = """
from durable_trio import App, WorkflowContext

app = App("cli_orphan")


@app.workflow("order")
async def order(ctx: WorkflowContext, _):
    return await ctx.step("charge-crad", 1)
"""


def _cli_run_timing_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flows: str, workflow: str, run_id: str
) -> list[str]:
    """``durable-trio run`` of ``workflow`` (in a module of ``flows``) on a SQLite file, with
    ``run_id`` and a 0.5 s timeout it exceeds (exit 3): the lines it wrote on stderr."""
    (tmp_path / "cli_flows.py").write_text(flows)
    target = f"{tmp_path / 'cli_flows.py'}:app"
    backend = f"sqlite:///{tmp_path / 'cli.db'}".replace("///", "////", 1)
    parser = argparse.ArgumentParser()
    add_engine_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["run", target, workflow, "--backend", backend, "--run-id", run_id, "--timeout", "0.5"]
    )
    assert args.func(args) == 3
    return capsys.readouterr().err.splitlines()


def test_cli_run_that_does_not_finish_names_the_queue_it_waits_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _cli_run_timing_out(tmp_path, capsys, FLOWS, "order", "o")
    assert err[0] == "run o did not finish in 0.5 s"
    assert err[1].startswith("  step 'charge-crad' (id 1, attempt 1) has waited ")
    assert err[1].endswith(" on queue 'cli_orphan:tasks:charge-crad'; no live worker serves it")


WAITING_FLOWS = """
from durable_trio import App, WorkflowContext

app = App("cli_waits")


@app.workflow("approve")
async def approve(ctx: WorkflowContext, _):
    return await ctx.wait_signal("ok", timeout=3600)


@app.workflow("nap")
async def nap(ctx: WorkflowContext, _):
    await ctx.sleep(100)


@app.workflow("parent")
async def parent(ctx: WorkflowContext, _):
    return await ctx.child("approve", 1)
"""


@pytest.mark.parametrize(
    ("workflow", "line"),
    [
        (
            "approve",
            "  step 1 waits on signal 'ok' (it gives up in 3600 s); send it: durable-trio runs"
            " signal 'w 1' ok [PAYLOAD-JSON]",
        ),
        ("nap", "  step 1 sleeps (ctx.sleep) for 100 s more"),
        ("parent", "  step 1 waits on child run 'w 1/1' (approve)"),
    ],
)
def test_cli_run_that_does_not_finish_names_the_signal_timer_or_child_it_waits_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], workflow: str, line: str
) -> None:
    err = _cli_run_timing_out(tmp_path, capsys, WAITING_FLOWS, workflow, "w 1")
    assert err[0] == "run w 1 did not finish in 0.5 s"
    # (a real SQLite file, so the wall clock: the seconds left are those of the moment read)
    [shown] = err[1:]
    assert re.sub(r"\d+ s\b", "N s", shown) == re.sub(r"\d+ s\b", "N s", line)


def test_cli_run_that_does_not_finish_names_an_odd_run_inert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run id holding an ESC sequence and a line break (``--run-id``, or one the store
    picked for a dedup key) is spelled out in those lines: nothing a terminal acts on."""
    odd = "o\x1b]0;title\x07\n"
    err = _cli_run_timing_out(tmp_path, capsys, FLOWS, "order", odd)
    assert err[0] == "run o\\x1b]0;title\\x07\\n did not finish in 0.5 s"
    assert err[1].startswith("  step 'charge-crad' (id 1, attempt 1) has waited ")


async def test_waiting_queues(broker: Any) -> None:
    """Every broker answers SupportsQueueListing: the queues of a prefix with waiting jobs."""
    assert isinstance(broker, SupportsQueueListing)
    broker = typing.cast("Any", broker)
    await broker.push_on("ops:tasks:a", Job("1", b"{}"))
    await broker.push_on("ops:tasks:b", Job("2", b"{}"), delay=60)
    await broker.push_on("ops:tasks:c", Job("3", b"{}"))
    await broker.push_on("ops:tasksX", Job("4", b"{}"))
    await broker.push_on("zz", Job("5", b"{}"))
    claimed = await broker.pop_from("ops:tasks:c")
    assert claimed is not None  # claimed: no longer waiting
    assert await broker.waiting_queues("ops:tasks:") == ["ops:tasks:a", "ops:tasks:b"]
    assert await broker.waiting_queues("ops:tasks:a") == ["ops:tasks:a"]
    assert await broker.waiting_queues("nothing:") == []


async def test_a_remote_workflows_step_timeout_reaches_the_checkpoint_and_the_worker(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A remote workflow's ``ctx.step(..., timeout=)`` travels in its turn's command: the
    engine (which declares the workflow without its code) stores it and the worker applies
    it."""
    log: list[tuple[str, float]] = []
    code = timeout_app(log)

    @code.workflow("flow", remote=True)
    async def flow(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("slow", 100, timeout=2, retry=dt.Retry(max_attempts=1))

    declared = App("shop")
    declared.remote_workflow("flow")
    async with dt.open_backend("memory://") as backend:
        async with (
            open_engine(declared, backend) as engine,
            open_worker(code, backend, on_error=Errors()),
        ):
            await engine.start("flow", run_id="f")
            with pytest.raises(RunFailed):
                await engine.result("f")
            history = await engine.history("f")
    assert log == [("start 1", 0.0), ("cancelled 1", 2.0)]
    assert history[0].retry["timeouts"] == {"startToClose": 2.0}
    assert history[0].error["code"] == "StepTimedOut"


async def test_an_expected_retry_is_one_warning_and_the_last_failure_an_error(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    """A flaky step and a timed-out one: each earlier attempt is one WARNING line (no
    traceback at that level), the last attempt's failure is the ERROR with the traceback."""
    app = dt.App("shop")

    @app.step("flaky", retry=dt.Retry(max_attempts=3, initial=1.0, jitter=0.0))
    async def flaky(_: int) -> int:
        raise RuntimeError("boom")

    @app.step("slow", timeout=1.0, retry=dt.Retry(max_attempts=2, initial=1.0, jitter=0.0))
    async def slow(_: int) -> int:
        await trio.sleep(5)
        return 0

    @app.workflow("both")
    async def both(ctx: dt.WorkflowContext, _: int) -> str:
        for name in ("flaky", "slow"):
            with contextlib.suppress(dt.StepFailed):
                await ctx.step(name, 0)
        return "done"

    caplog.set_level(logging.INFO, logger="durable_trio")
    async with dt.open_backend("memory://") as backend:
        async with dt.open_worker(app, backend), dt.open_engine(app, backend) as engine:
            assert await engine.result(await engine.start("both", 0)) == "done"
    mine = [r for r in caplog.records if r.name == "durable_trio"]
    warnings = [r.getMessage() for r in mine if r.levelno == logging.WARNING]
    errors = [r for r in mine if r.levelno == logging.ERROR]
    assert [w.split(" (run ")[0] for w in warnings] == [
        "step 'flaky' attempt 1 of 3",
        "step 'flaky' attempt 2 of 3",
        "step 'slow' attempt 1 of 2",
    ]
    assert all(r.exc_info is None for r in mine if r.levelno == logging.WARNING)
    assert [r.getMessage().split(" raised ")[0] for r in errors] == ["step 'flaky'", "step 'slow'"]
    assert all(r.exc_info is not None for r in errors)
