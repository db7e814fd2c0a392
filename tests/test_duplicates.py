"""Duplicates explained (docs/concepts.md, "At-least-once windows"): a step that completes twice
for one attempt is applied once, and the engine records why (whose lease was lost, when) from
the delivery evidence each result carries. Exact virtual times on the memory broker; bounds on
SQLite and Redis."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio._engine import App, StepState, WorkflowContext, open_engine, open_worker
from durable_trio._engine._duplicates import explain
from durable_trio._engine._stores.memory import MemoryRunStore
from durable_trio.brokers.memory import MemoryBroker
from durable_trio.keys.memory import MemoryKeyStore
from durable_trio.testing import Simulation
from durable_trio.testing._sample import CHAOS, expected, sample_app, workload
from helpers import PausedRenewalBroker
from test_leases_real import PausedRenewal

if TYPE_CHECKING:
    from pathlib import Path


def twice_app(pause: Any, first_takes: float, then_takes: float) -> tuple[App, list[str]]:
    """One step: its first execution stops renewing its claim (a SIGSTOPped worker, seen from
    the broker) and takes ``first_takes`` seconds; every later one ``then_takes``."""
    app = App("twice")
    ran: list[str] = []

    @app.step("work")
    async def work(x: int) -> str:
        n = len(ran)
        ran.append(f"{n}@{trio.current_time()}")
        if n == 0:
            pause.paused = True
            await trio.sleep(first_takes)
            return "first"
        await trio.sleep(then_takes)
        return "second"

    @app.workflow("one")
    async def one(ctx: WorkflowContext, x: int) -> Any:
        return await ctx.step("work", x)

    return app, ran


WORKER: dict[str, Any] = {
    "stalled_threshold": 10.0, "stalled_check_interval": 5.0, "concurrency": 1
}


async def test_a_lost_lease_duplicate_is_recorded_with_whose_lease_and_when(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shared = MemoryBroker()
    slow = PausedRenewalBroker(shared)
    keys = MemoryKeyStore()
    app, ran = twice_app(slow, first_takes=30.0, then_takes=1.0)
    shared_backend = dt.Backend(url="memory://", broker=shared, keys=keys)
    slow_backend = dt.Backend(url="memory://", broker=slow, keys=keys)
    async with open_engine(app, shared_backend) as engine:
        async with open_worker(app, slow_backend, instance_id="a", **WORKER):
            run_id = await engine.start("one", 1, run_id="r")
            await trio.sleep(1)  # a claimed it at 0 and stopped renewing
            async with open_worker(app, shared_backend, instance_id="b", **WORKER):
                assert await engine.result(run_id) == "second"
                completed_at = trio.current_time()
                await trio.sleep(40)  # a's handler ends at 30: its result lands too
        history = await engine.history(run_id)
        duplicates = engine.duplicates(run_id)
        stats = engine.statistics()
    # a ran it at 0; b's sweep at 11 (b opened at 1, sweeps every 5 s) took it back (silent
    # since 0, past the 10 s threshold) and b ran it at 11, done at 12; a, never told (its
    # renewals "succeeded"), ended at 30.
    assert ran == ["0@0.0", "1@11.0"]
    assert completed_at == 12.0
    # The first result stays; the duplicate changed nothing.
    assert [(s.status, s.output) for s in history] == [(StepState.COMPLETED, "second")]
    assert stats.results_applied == 1
    assert stats.duplicate_results == 1
    assert stats.duplicate_completions == 1
    [dup] = duplicates
    assert (dup.run_id, dup.step_id, dup.attempt, dup.at) == ("r", "1", 1, 30.0)
    assert dup.lost == ({"at": 11.0, "worker": "a", "counted": True},)
    assert dup.applied["worker"] == "b"
    assert dup.applied["stalledCount"] == 1
    assert dup.applied["stalls"] == [{"at": 11.0, "worker": "a", "counted": True}]
    assert dup.duplicate["worker"] == "a"
    assert dup.duplicate["stalledCount"] == 0
    assert "stalls" not in dup.duplicate
    assert dup.applied["lease"] != dup.duplicate["lease"]
    assert dup.cause.startswith("the lease of a at 11.0 was lost")
    assert "b (delivery 2" in dup.cause
    assert engine.duplicates() == duplicates
    assert history[0].duplicates == (dup.to_json(),)
    assert dup.to_json()["lost"] == [{"at": 11.0, "worker": "a", "counted": True}]


async def test_the_runs_of_one_attempt_on_several_claims_are_in_its_stored_attempt_log(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The attempt ran twice (a stopped renewing, b's sweep took its task back at 11): the
    store's attempt log says so, so ``runs show`` (another process, the store only) lists one
    attempt that ran on 2 claims, whose they were and when, not one silent run."""
    shared = MemoryBroker()
    slow = PausedRenewalBroker(shared)
    keys = MemoryKeyStore()
    app, ran = twice_app(slow, first_takes=30.0, then_takes=1.0)
    shared_backend = dt.Backend(url="memory://", broker=shared, keys=keys)
    slow_backend = dt.Backend(url="memory://", broker=slow, keys=keys)
    async with open_engine(app, shared_backend) as engine:
        async with open_worker(app, slow_backend, instance_id="a", **WORKER):
            run_id = await engine.start("one", 1, run_id="r")
            await trio.sleep(1)
            async with open_worker(app, shared_backend, instance_id="b", **WORKER):
                assert await engine.result(run_id) == "second"
        async with dt.open_operations(shared_backend, namespace="twice") as ops:
            (step,) = (await ops.show_run(run_id)).steps
    assert ran == ["0@0.0", "1@11.0"]
    (attempt,) = step.attempts
    assert (attempt.attempt, attempt.status, attempt.worker) == (1, "completed", "b")
    assert attempt.deliveries == 2
    assert attempt.stalls == [{"at": 11.0, "worker": "a"}]
    assert step.notes == ("attempt 1 ran on 2 claims of its task (taken back from a at 11.0)",)
    assert attempt.to_json()["deliveries"] == 2


async def test_the_stopped_workers_result_applied_first_still_names_its_lost_lease(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The slow first holder lands first (b takes longer): the copy is b's, whose evidence
    names a's lost lease."""
    shared = MemoryBroker()
    slow = PausedRenewalBroker(shared)
    keys = MemoryKeyStore()
    app, ran = twice_app(slow, first_takes=20.0, then_takes=10.0)
    shared_backend = dt.Backend(url="memory://", broker=shared, keys=keys)
    slow_backend = dt.Backend(url="memory://", broker=slow, keys=keys)
    async with open_engine(app, shared_backend) as engine:
        async with open_worker(app, slow_backend, instance_id="a", **WORKER):
            run_id = await engine.start("one", 1, run_id="r")
            await trio.sleep(1)
            async with open_worker(app, shared_backend, instance_id="b", **WORKER):
                assert await engine.result(run_id) == "first"
                await trio.sleep(20)
        history = await engine.history(run_id)
        [dup] = engine.duplicates(run_id)
    assert ran == ["0@0.0", "1@11.0"]
    assert [s.output for s in history] == ["first"]
    assert dup.at == 21.0
    assert dup.applied["worker"] == "a"
    assert dup.duplicate["worker"] == "b"
    assert dup.lost == ({"at": 11.0, "worker": "a", "counted": True},)


async def test_a_handler_left_to_finish_after_its_lost_lease_says_when_it_noticed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``cancel_on_lost_lease=False`` on the memory broker (the result pushed by the handler's
    job): the copy says when its worker learnt of the loss."""
    shared = MemoryBroker()
    slow = PausedRenewalBroker(shared)
    keys = MemoryKeyStore()
    app, ran = twice_app(slow, first_takes=30.0, then_takes=1.0)
    shared_backend = dt.Backend(url="memory://", broker=shared, keys=keys)
    slow_backend = dt.Backend(url="memory://", broker=slow, keys=keys)
    async with open_engine(app, shared_backend) as engine:
        async with open_worker(
            app, slow_backend, instance_id="a", cancel_on_lost_lease=False, **WORKER
        ):
            run_id = await engine.start("one", 1, run_id="r")
            await trio.sleep(1)
            async with open_worker(app, shared_backend, instance_id="b", **WORKER):
                await trio.sleep(15)
                slow.paused = False  # t=16: a's next renewal round (t=20) finds the loss
                assert await engine.result(run_id) == "second"
                await trio.sleep(20)
        [dup] = engine.duplicates(run_id)
    assert ran == ["0@0.0", "1@11.0"]
    assert dup.at == 30.0
    assert dup.duplicate["worker"] == "a"
    assert dup.duplicate["leaseLostAt"] == 20.0
    assert dup.lost == ({"at": 11.0, "worker": "a", "counted": True},)


async def test_a_duplicate_is_never_applied_twice_and_one_result_delivered_twice_is_named(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The same completed result handed to the engine again (a publish retried, a result job
    redelivered): applied once, recorded as one delivery's result arriving twice; a copy with a
    different output changes nothing either."""
    app = App("once")

    @app.step("work")
    async def work(x: int) -> int:
        return x + 1

    @app.workflow("one")
    async def one(ctx: WorkflowContext, x: int) -> Any:
        return await ctx.step("work", x)

    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend) as engine, open_worker(app, backend):
            run_id = await engine.start("one", 1, run_id="r")
            assert await engine.result(run_id) == 2
            other = dt.StepResult("r", "1", 1, dt.StepStatus.COMPLETED, output=99,
                                  delivery={"worker": "x", "job": "J2", "lease": "L2",
                                            "stalledCount": 0})
            await engine.transport.publish_result(other)
            await trio.sleep(1)
            applied = engine.duplicates(run_id)[0].applied
            # the worker's own result once more (same claim, same lease)
            again = dt.StepResult("r", "1", 1, dt.StepStatus.COMPLETED, output=2,
                                  delivery=applied)
            await engine.transport.publish_result(again)
            failed_late = dt.StepResult.failure(
                dt.RemoteTask("r", "1", 1, "work"), dt.StepError("late")
            )
            await engine.transport.publish_result(failed_late)
            await trio.sleep(1)
            history = await engine.history(run_id)
            stats = engine.statistics()
            duplicates = engine.duplicates(run_id)
    assert [(s.status, s.output) for s in history] == [(StepState.COMPLETED, 2)]
    assert stats.results_applied == 1
    assert stats.duplicate_results == 3  # two completed copies and one failed one
    assert stats.duplicate_completions == 2
    assert len(duplicates) == 2
    first, second = duplicates
    assert applied is not None
    assert applied["stalledCount"] == 0
    assert (first.applied, second.applied) == (applied, applied)
    assert first.duplicate["lease"] == "L2"
    assert first.cause.startswith("the attempt was dispatched twice")  # another job id
    assert second.duplicate == applied
    assert second.cause.startswith("one delivery's result arrived twice")
    assert second.lost == ()


async def test_a_copy_met_by_another_engine_names_what_remains_possible(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The engine that applied the result is gone (restarted, or another engine consumed the
    copy): the copy's own evidence is all there is, and the cause says so."""
    app = App("restart")

    @app.step("work")
    async def work(x: int) -> int:
        return x + 1

    @app.workflow("one")
    async def one(ctx: WorkflowContext, x: int) -> Any:
        return await ctx.step("work", x)

    store = MemoryRunStore()
    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend, store=store) as first, open_worker(app, backend):
            assert await first.result(await first.start("one", 1, run_id="r")) == 2
        async with open_engine(app, backend, store=store) as second:
            copy = dt.StepResult("r", "1", 1, dt.StepStatus.COMPLETED, output=2,
                                 delivery={"worker": "w", "job": "J", "lease": "L",
                                           "stalledCount": 0})
            await second.transport.publish_result(copy)
            await trio.sleep(1)
            [dup] = second.duplicates("r")
            history = await second.history("r")
    assert dup.applied is None
    assert dup.cause.startswith("the applied result's evidence is not known here")
    assert [(s.output, len(s.duplicates)) for s in history] == [(2, 1)]


def test_explain_names_every_window() -> None:
    one = {"worker": "a", "job": "J", "lease": "L1", "stalledCount": 0}
    again: dict[str, Any] = {"worker": "b", "job": "J", "lease": "L2", "stalledCount": 2,
             "stalls": [{"at": 5.0, "worker": "a"}, {"at": 9.0, "worker": "c"}]}
    cause, lost = explain(one, dict(one))
    assert cause.startswith("one delivery's result arrived twice (a (delivery 1, lease L1))")
    assert lost == ()
    cause, lost = explain(again, one)  # the later delivery applied first
    assert lost == ({"at": 5.0, "worker": "a"}, {"at": 9.0, "worker": "c"})
    assert cause.startswith("the lease of a at 5.0, c at 9.0 was lost")
    middle = {
        "worker": "c", "job": "J", "lease": "L3", "stalledCount": 1,
        "stalls": [{"at": 5.0, "worker": "a"}],
    }
    assert explain(middle, again)[1] == ({"at": 9.0, "worker": "c"},)
    # A stall not counted (a claim that never started) is in the history: the place of the
    # earlier delivery is the length of its history, not its count (a kill storm's case).
    stalls: list[Any] = [{"at": 1.0, "worker": "w4", "counted": True},
                         {"at": 2.0, "worker": "w8", "counted": False}]
    ran = {"worker": "w11", "job": "J", "lease": "L4", "stalledCount": 1, "stalls": stalls}
    rerun = {"worker": "w11", "job": "J", "lease": "L5", "stalledCount": 2,
             "stalls": [*stalls, {"at": 3.0, "worker": "w11", "counted": True},
                        {"at": 4.0, "worker": "w12", "counted": False}]}
    for pair in ((ran, rerun), (rerun, ran)):
        cause, lost = explain(*pair)
        assert [s["worker"] for s in lost] == ["w11", "w12"]
        assert cause.startswith("the lease of w11 at 3.0, w12 at 4.0 was lost")
    # Not known here which result was applied: the copy's own evidence.
    assert explain(None, again)[1] == tuple(again["stalls"])
    cause, lost = explain(None, {**one, "leaseLostAt": 7.5})
    assert cause.startswith("the lease of a (delivery 1, lease L1) was lost while its handler")
    assert "noticed at 7.5" in cause
    cause, lost = explain(None, one)
    assert cause.startswith("the applied result's evidence is not known here")
    assert "either the lease of a (delivery 1, lease L1) was lost" in cause
    assert "this same result was delivered again" in cause
    assert "no delivery evidence" in explain(None, None)[0]
    cause, _ = explain(one, {"worker": "a", "job": "J", "lease": "L9", "stalledCount": 0})
    assert "handed back" in cause
    cause, _ = explain(one, {"worker": "a", "job": "K", "lease": "L9", "stalledCount": 0})
    assert cause.startswith("the attempt was dispatched twice (jobs J and K)")


# --------------------------------------------------------------------------- real brokers

THRESHOLD = 0.3
CHECK = 0.1


@pytest.fixture(params=["sqlite", "redis", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return "sqlite:///" + str(tmp_path / "dups.db")
    if request.param == "postgres":
        return str(request.getfixturevalue("postgres_schema_url"))
    return str(request.getfixturevalue("redis_url"))


async def test_a_lost_lease_duplicate_is_recorded_on_real_brokers(url: str) -> None:
    options: dict[str, Any] = {
        "namespace": "dups",
        "stalled_threshold": THRESHOLD,
        "stalled_check_interval": CHECK,
        "poll_interval": 0.05,
        "concurrency": 1,
    }
    async with dt.open_backend(url) as backend:
        slow = PausedRenewal(backend.broker)
        app, ran = twice_app(slow, first_takes=6 * THRESHOLD, then_takes=0.0)
        slow_backend = dt.Backend(url=url, broker=slow, keys=backend.keys)
        async with open_engine(app, backend, namespace="dups") as engine:
            async with open_worker(app, slow_backend, instance_id="a", **options):
                run_id = await engine.start("one", 1, run_id="r")
                with trio.fail_after(10):
                    while not ran:  # noqa: ASYNC110
                        await trio.sleep(0.01)
                    async with open_worker(app, backend, instance_id="b", **options):
                        assert await engine.result(run_id) == "second"
                        while not engine.duplicates(run_id):  # noqa: ASYNC110
                            await trio.sleep(0.02)
            history = await engine.history(run_id)
            [dup] = engine.duplicates(run_id)
            stats = engine.statistics()
    assert len(ran) == 2
    assert [s.output for s in history] == ["second"]
    assert stats.results_applied == 1
    assert stats.duplicate_completions == 1
    assert (dup.applied["worker"], dup.duplicate["worker"]) == ("b", "a")
    assert [s["worker"] for s in dup.lost] == ["a"]
    assert dup.cause.startswith("the lease of a at ")


def test_the_simulation_records_every_duplicate_completed_result_with_its_cause() -> None:
    """Under the chaos profile steps complete twice (lost leases, results published twice,
    tasks pushed twice): the invariant holds, so each one was recorded with its cause."""
    report = Simulation(
        sample_app("dups"), workload, seed=3, expected_output=expected, runs=200,
        duration=3 * 3600, faults=CHAOS,
    ).run_sync()
    assert report.violations == ()
    assert report.engine.duplicate_completions > 0
