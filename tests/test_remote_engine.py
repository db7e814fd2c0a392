"""The engine drives remote workflows (T14-T16, docs/spec.md) and serves store-less tenant pods
as their control plane (T18-T23), under a virtual clock with exact times (memory) and for real
(Redis)."""

from __future__ import annotations

from collections import Counter
from contextlib import AsyncExitStack
from typing import Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio._engine import (
    App,
    EngineStatistics,
    Retry,
    RunCancelled,
    RunFailed,
    RunNotFound,
    RunStatus,
    StepFailed,
    StepKind,
    StepState,
    UnknownWorkflow,
    WorkflowContext,
    open_engine,
    open_worker,
)
from helpers import Errors, wait_status

NO_RETRY = Retry(max_attempts=1)


class Declined(Exception):
    """A failure no retry can fix."""

    retryable = False


def worker_app(executions: Counter[str]) -> App:
    """The workflow worker's app: the code of remote workflow ``order`` and its steps."""
    app = App("shop")

    @app.step("charge")
    async def charge(order: dict[str, Any]) -> str:
        executions[f"charge:{order['id']}"] += 1
        if order.get("decline"):
            raise Declined("card declined")
        return f"receipt-{order['id']}"

    @app.step("reserve")
    async def reserve(item: str) -> str:
        executions[f"reserve:{item}"] += 1
        return f"reserved-{item}"

    @app.workflow("order", remote=True)
    async def order(ctx: WorkflowContext, order: dict[str, Any]) -> dict[str, Any]:
        def stamp() -> str:
            executions[f"stamp:{order['id']}"] += 1
            return f"stamp-{order['id']}"

        stamp_value = await ctx.run("stamp", stamp)
        items = await ctx.gather(*(ctx.step("reserve", item) for item in order["items"]))
        try:
            receipt = await ctx.step("charge", order, retry=NO_RETRY)
        except StepFailed as failed:
            return {"declined": failed.error.message, "items": items}
        await ctx.sleep(order.get("wait", 10))
        return {"receipt": receipt, "items": items, "stamp": stamp_value}

    @app.workflow("explodes", remote=True)
    async def explodes(ctx: WorkflowContext, _: Any) -> None:
        await ctx.step("reserve", "x")
        raise ValueError("boom in the workflow")

    return app


def engine_app() -> App:
    """The engine's app: it declares the remote workflows without their code."""
    app = App("shop")
    app.remote_workflow("order")
    app.remote_workflow("explodes")
    app.remote_workflow("nobody-serves-it")
    return app


ORDER = {"id": 1, "items": ["a", "b"]}


async def test_t14_the_engine_drives_a_remote_workflow_turn_by_turn(
    autojump_clock: trio.testing.MockClock,
) -> None:
    executions: Counter[str] = Counter()
    async with (
        dt.open_backend("memory://") as backend,
        open_worker(worker_app(executions), backend),
        open_engine(engine_app(), backend) as engine,
    ):
        start = trio.current_time()
        run_id = await engine.start("order", ORDER)
        output = await engine.result(run_id)
        # The only time that passes is the durable timer's.
        assert trio.current_time() - start == 10.0
        history = await engine.history(run_id)
        stats = engine.statistics()
    assert output == {
        "receipt": "receipt-1",
        "items": ["reserved-a", "reserved-b"],
        "stamp": "stamp-1",
    }
    assert [(r.step_id, r.kind, r.name, r.status) for r in history] == [
        ("1", StepKind.LOCAL, "stamp", StepState.COMPLETED),
        ("2", StepKind.REMOTE, "reserve", StepState.COMPLETED),
        ("3", StepKind.REMOTE, "reserve", StepState.COMPLETED),
        ("4", StepKind.REMOTE, "charge", StepState.COMPLETED),
        ("5", StepKind.TIMER, "sleep", StepState.COMPLETED),
    ]
    # Every step ran once; the local step ran on the workflow worker, once.
    assert executions == Counter({"stamp:1": 1, "reserve:a": 1, "reserve:b": 1, "charge:1": 1})
    # Turns: start; after a and b settle (one turn each); after charge; after the timer.
    assert 4 <= stats.turns_dispatched <= 5
    assert stats.decisions_applied == stats.turns_dispatched
    assert stats.step_events == 2  # T16: stamp started + completed, each checkpointed once
    assert stats.runs_completed == 1


async def test_t14_a_failed_step_reaches_the_remote_workflow_code(
    autojump_clock: trio.testing.MockClock,
) -> None:
    executions: Counter[str] = Counter()
    async with (
        dt.open_backend("memory://") as backend,
        open_worker(worker_app(executions), backend),
        open_engine(engine_app(), backend) as engine,
    ):
        run_id = await engine.start("order", {"id": 2, "items": [], "decline": True})
        output = await engine.result(run_id)
    assert output == {"declined": "Declined: card declined", "items": []}
    assert executions["charge:2"] == 1


async def test_t14_a_raising_workflow_and_an_unknown_workflow_settle_the_run_failed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    executions: Counter[str] = Counter()
    errors = Errors()
    app = worker_app(executions)

    @app.step("nobody-serves-it")  # a step of that name: the turn reaches a worker without it
    async def same_token(_: Any) -> None:
        return None

    async with (
        dt.open_backend("memory://") as backend,
        open_worker(app, backend, on_error=errors),
        open_engine(engine_app(), backend) as engine,
    ):
        raising = await engine.start("explodes", None)
        unknown = await engine.start("nobody-serves-it", None)
        with pytest.raises(RunFailed) as failed:
            await engine.result(raising)
        assert failed.value.error["type"] == "ValueError"
        assert failed.value.error["message"] == "boom in the workflow"
        with pytest.raises(RunFailed) as missing:
            await engine.result(unknown)
        assert missing.value.error["type"] == "no_workflow"


async def test_t14_non_determinism_in_a_remote_workflow_blocks_the_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    v1, v2 = App("shop"), App("shop")
    release = trio.Event()

    @v1.step("slow")
    async def slow(_: Any) -> str:
        await release.wait()
        return "done"

    @v1.workflow("flow", remote=True)
    async def flow_v1(ctx: WorkflowContext, _: Any) -> str:
        return str(await ctx.step("slow"))

    @v2.step("slow")
    async def slow2(_: Any) -> str:
        return "done"

    @v2.workflow("flow", remote=True)
    async def flow_v2(ctx: WorkflowContext, _: Any) -> str:
        await ctx.sleep(1)  # deployed code now starts with a timer: history says a step
        return "v2"

    declared = App("shop")
    declared.remote_workflow("flow")
    async with dt.open_backend("memory://") as backend, open_engine(declared, backend) as engine:
        async with open_worker(v1, backend, workflows=["flow"]):
            run_id = await engine.start("flow")
            await trio.sleep(1)
            assert [r.name for r in await engine.history(run_id)] == ["slow"]
        release.set()
        async with open_worker(v2, backend):
            record = await wait_status(engine, run_id, RunStatus.BLOCKED)
    assert record.error["type"] == "NonDeterminismError"
    expected, found = record.error["expected"], record.error["found"]
    assert (expected, found) == ("ctx.step('slow')", "ctx.sleep(...)")
    assert isinstance(record.error["fingerprint"], str)


async def test_t14_a_lost_turn_is_sent_again_after_turn_timeout_and_steps_run_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    executions: Counter[str] = Counter()
    async with (
        dt.open_backend("memory://") as backend,
        open_engine(engine_app(), backend, turn_timeout=30.0) as engine,
    ):
        run_id = await engine.start("order", ORDER)
        await trio.sleep(65)  # no workflow worker yet: the turn is sent again at 30 and 60
        assert engine.statistics().turns_resent == 2
        async with open_worker(worker_app(executions), backend):
            output = await engine.result(run_id)
        stats = engine.statistics()
    assert output["receipt"] == "receipt-1"
    # Three copies of the first turn were decided. Each ran the local step (at least once,
    # like any step); the first outcome was kept, and the remote steps were dispatched once.
    assert executions == Counter({"stamp:1": 3, "reserve:a": 1, "reserve:b": 1, "charge:1": 1})
    assert output["stamp"] == "stamp-1"
    assert stats.runs_completed == 1


async def test_t14_a_long_turn_heartbeats_so_the_engine_does_not_send_it_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = App("shop")

    @app.workflow("slow", remote=True)
    async def slow(ctx: WorkflowContext, _: Any) -> str:
        async def crunch() -> str:
            await trio.sleep(100)  # a 100 s local step, on the workflow worker
            return "crunched"

        return await ctx.run("crunch", crunch)

    declared = App("shop")
    declared.remote_workflow("slow")
    async with (
        dt.open_backend("memory://") as backend,
        open_worker(app, backend),
        open_engine(declared, backend, turn_timeout=30.0) as engine,
    ):
        run_id = await engine.start("slow")
        assert await engine.result(run_id) == "crunched"
        assert trio.current_time() == 100.0
        # Beats every 10 s kept the 30 s turn_timeout from ever expiring.
        assert engine.statistics().turns_resent == 0
        assert engine.statistics().turns_dispatched == 1


async def test_t14_a_turn_that_awaits_something_else_fails_its_run_at_the_turn_limit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Workflow code must await only ctx calls; one that waits on anything else would hold its
    turn (heartbeating) forever. The worker's turn_limit bounds it: the run fails, loudly."""
    app = App("shop")

    @app.workflow("hangs", remote=True)
    async def hangs(ctx: WorkflowContext, _: Any) -> None:
        await trio.Event().wait()  # not a ctx call: the engine can never settle it

    declared = App("shop")
    declared.remote_workflow("hangs")
    async with (
        dt.open_backend("memory://") as backend,
        open_worker(app, backend, turn_limit=60.0),
        open_engine(declared, backend) as engine,
    ):
        run_id = await engine.start("hangs")
        with pytest.raises(RunFailed) as failed:
            await engine.result(run_id)
        assert trio.current_time() == 60.0
    assert failed.value.error["type"] == "TurnTimeout"
    assert "must await only ctx calls" in failed.value.error["message"]


async def test_t14_an_engine_restart_resumes_a_remote_run_from_its_history(
    autojump_clock: trio.testing.MockClock,
) -> None:
    executions: Counter[str] = Counter()
    async with dt.open_backend("memory://") as backend:
        async with open_worker(worker_app(executions), backend):
            async with open_engine(engine_app(), backend, engine_id="e1") as first:
                run_id = await first.start("order", ORDER)
                await trio.sleep(5)  # in the 10 s timer
            async with open_engine(engine_app(), backend, engine_id="e2") as second:
                output = await second.result(run_id)
                assert second.statistics().runs_resumed == 1
                assert trio.current_time() == 10.0
    assert output["stamp"] == "stamp-1"
    assert executions == Counter({"stamp:1": 1, "reserve:a": 1, "reserve:b": 1, "charge:1": 1})


async def test_t14_cancelling_a_remote_run(autojump_clock: trio.testing.MockClock) -> None:
    executions: Counter[str] = Counter()
    async with (
        dt.open_backend("memory://") as backend,
        open_worker(worker_app(executions), backend),
        open_engine(engine_app(), backend) as engine,
    ):
        run_id = await engine.start("order", ORDER)
        await trio.sleep(5)
        assert await engine.cancel(run_id)
        with pytest.raises(RunCancelled):
            await engine.result(run_id)
        await trio.sleep(20)  # nothing more happens to it
        assert (await engine.get(run_id)).status is RunStatus.CANCELLED


async def test_t16_a_step_event_and_the_decision_checkpoint_a_local_step_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    executions: Counter[str] = Counter()
    backend_ctx = dt.open_backend("memory://")
    async with backend_ctx as backend:
        async with open_engine(engine_app(), backend) as engine:
            # Two engines share the namespace: the step event is consumed by one of them.
            async with (
                open_engine(engine_app(), backend, reconcile=False),
                open_worker(worker_app(executions), backend),
            ):
                run_id = await engine.start("order", ORDER)
                await engine.result(run_id)
        history = await engine.history(run_id)
    stamps = [r for r in history if r.kind is StepKind.LOCAL]
    assert [(r.name, r.output) for r in stamps] == [("stamp", "stamp-1")]
    assert executions["stamp:1"] == 1


async def test_t15_a_malformed_decision_fails_the_run_loudly_and_a_foreign_one_is_ignored(
    autojump_clock: trio.testing.MockClock,
) -> None:
    errors = Errors()
    async with (
        dt.open_backend("memory://") as backend,
        open_engine(engine_app(), backend, on_error=errors) as engine,
    ):
        run_id = await engine.start("order", ORDER)  # no workflow worker: the turn waits
        await trio.sleep(1)
        transport = engine.transport
        decisions = transport.names.decisions
        for decision in (
            dt.WorkflowDecision("t-x", "no-such-run", dt.DecisionStatus.COMPLETED),
            dt.WorkflowDecision(
                "t-1", run_id, dt.DecisionStatus.CONTINUED, ({"type": "launch", "stepId": "1"},)
            ),
        ):
            await transport._producers.push(decisions, dt.JobKind.DECISION, decision)
        with pytest.raises(RunFailed) as failed:
            await engine.result(run_id)
        stats = engine.statistics()
    assert failed.value.error["type"] == "BadDecision"
    assert "unknown decision command type 'launch'" in failed.value.error["message"]
    assert any("launch" in message for message in errors.messages())
    assert stats.orphan_decisions == 1


class _DeafToDecisions:
    """Fault injection: the broker as one engine sees it, with its decisions queue always
    empty (so every decision goes to the OTHER engine of the namespace)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def pop_from(self, queue: str, *, worker: str = "") -> Any:
        if queue.endswith(":decisions"):
            await trio.lowlevel.checkpoint()
            return None
        return await self._inner.pop_from(queue, worker=worker)

    async def pop_many(self, queue: str, count: int, *, worker: str = "") -> Any:
        if queue.endswith(":decisions"):
            await trio.lowlevel.checkpoint()
            return []
        return await self._inner.pop_many(queue, count, worker=worker)

    async def wait_for_work(self, queue: str) -> None:
        if queue.endswith(":decisions"):
            await trio.sleep_forever()
        await self._inner.wait_for_work(queue)


async def test_t15_a_decision_applied_by_another_engine_moves_the_driving_engine_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Decisions are point-to-point: with two engines on a namespace, the one that takes a
    decision may not be the one driving the run. It applies it to the store all the same, and
    the driver sees it there (its watch), with no turn sent twice and no step run twice."""
    executions: Counter[str] = Counter()
    async with AsyncExitStack() as stack:
        backend = await stack.enter_async_context(dt.open_backend("memory://"))
        await stack.enter_async_context(open_worker(worker_app(executions), backend))
        other = await stack.enter_async_context(
            open_engine(engine_app(), backend, engine_id="other", reconcile=False)
        )
        deaf = dt.Backend("memory://", _DeafToDecisions(backend.broker), backend.keys)
        driver = await stack.enter_async_context(
            open_engine(engine_app(), deaf, store=other.store, engine_id="driver")
        )
        run_id = await driver.start("order", ORDER)
        output = await driver.result(run_id)
        ours, theirs = driver.statistics(), other.statistics()
    assert output["receipt"] == "receipt-1"
    assert (ours.decisions_applied, ours.turns_resent) == (0, 0)
    assert theirs.decisions_applied == ours.turns_dispatched
    assert executions == Counter({"stamp:1": 1, "reserve:a": 1, "reserve:b": 1, "charge:1": 1})


async def taken_over_by_an_engine_deaf_to_decisions(
    worker: App, declared: App, workflow: str, value: Any, *, bound: float
) -> tuple[Any, float, EngineStatistics, EngineStatistics]:
    """Engine ``first`` starts a run of ``workflow`` and leaves at t=5 (releasing it); engine
    ``driver`` (turn_timeout 30 s), deaf to decisions, takes it over, while engine ``other``
    applies every decision. Returns the run's output, when the driver saw it end, and the
    driver's and the other engine's statistics."""
    async with AsyncExitStack() as stack:
        backend = await stack.enter_async_context(dt.open_backend("memory://"))
        await stack.enter_async_context(open_worker(worker, backend))
        async with open_engine(declared, backend, engine_id="first") as first:
            run_id = await first.start(workflow, value)
            await trio.sleep(5)
        store = first.store
        other = await stack.enter_async_context(
            open_engine(declared, backend, store=store, engine_id="other", reconcile=False)
        )
        deaf = dt.Backend("memory://", _DeafToDecisions(backend.broker), backend.keys)
        driver = await stack.enter_async_context(
            open_engine(declared, deaf, store=store, engine_id="driver", turn_timeout=30.0)
        )
        with trio.fail_after(bound):
            output = await driver.result(run_id)
        return output, trio.current_time(), driver.statistics(), other.statistics()


async def test_t15_a_run_taken_over_moves_on_when_another_engine_applies_its_no_op_decision(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Found by the simulation harness with two engines: a run taken over while its workflow
    slept. The new driver's first turn replays up to the pending timer and decides nothing
    new; when another engine applies that decision, the store does not change, and the
    driver used to re-send the turn every turn_timeout, forever (the timer is the driver's to
    fire). Now, after turn_timeout, it moves on with what the history holds."""
    executions: Counter[str] = Counter()
    output, done_at, ours, theirs = await taken_over_by_an_engine_deaf_to_decisions(
        worker_app(executions), engine_app(), "order", ORDER, bound=300
    )
    assert output["receipt"] == "receipt-1"
    # taken over at 5; moved on at 5 + turn_timeout, the timer overdue: fired, the last turn
    # sent, its decision applied by the other engine, which rings the store's wakes: seen at
    # once (before the ring: at the driver's next poll, 1 s later)
    assert done_at == 35.0
    assert (ours.runs_resumed, ours.turns_moved_on, ours.turns_resent) == (1, 1, 0)
    assert theirs.decisions_applied == 2  # the no-op one, then the end
    assert executions == Counter({"stamp:1": 1, "reserve:a": 1, "reserve:b": 1, "charge:1": 1})


async def test_t15_a_driver_whose_turns_go_unanswered_keeps_turning_while_a_long_step_runs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The price of moving on (above), bounded: a driver that never sees its turns' decisions
    (here: another engine applies them, inserting nothing, while a 1000 s step runs) sends a
    fresh turn every 2 x turn_timeout instead of waiting for the step, so what a lost turn
    would have added does not wait for the slowest pending step."""
    worker = App("slow")

    @worker.step("slow")
    async def slow(n: int) -> int:
        await trio.sleep(1000)
        return n * 2

    @worker.workflow("waits", remote=True)
    async def waits(ctx: WorkflowContext, n: int) -> int:
        return int(await ctx.step("slow", n))

    declared = App("slow")
    declared.remote_workflow("waits")
    output, done_at, ours, _ = await taken_over_by_an_engine_deaf_to_decisions(
        worker, declared, "waits", 21, bound=2000
    )
    assert output == 42
    # taken over at 5: a turn every 60 s (30 s waiting for its decision, 30 s waiting for the
    # step) from 5 to 965, 17 of them moved on; the step done at 1000, the last turn then, its
    # decision applied by the other engine, which rings the store's wakes: seen at once
    # (before the ring: at the driver's next poll, one or two seconds later)
    assert (ours.turns_dispatched, ours.turns_moved_on, ours.turns_resent) == (18, 17, 0)
    assert done_at == 1000.0


# --------------------------------------------------------------------------- tenant pods


def pod_backend(backend: dt.Backend) -> dt.Backend:
    """A store-less pod: the shared broker, no key store of its own (never closed here)."""
    return dt.Backend(url="memory://pod", broker=backend.broker, keys=None)


async def test_t18_t23_a_pod_starts_watches_and_reads_its_runs_through_the_control_plane(
    autojump_clock: trio.testing.MockClock,
) -> None:
    executions: Counter[str] = Counter()
    seen: dict[str, list[tuple[str, str | None]]] = {"acme": [], "globex": []}
    async with AsyncExitStack() as stack:
        backend = await stack.enter_async_context(dt.open_backend("memory://"))
        await stack.enter_async_context(open_worker(worker_app(executions), backend))
        engine = await stack.enter_async_context(
            open_engine(engine_app(), backend, serve_tenants=True)
        )
        acme = await stack.enter_async_context(
            dt.open_tenant_client(pod_backend(backend), "acme", namespace="shop")
        )
        globex = await stack.enter_async_context(
            dt.open_tenant_client(pod_backend(backend), "globex", namespace="shop")
        )
        for pod in (acme, globex):

            def on_event(event: dt.TenantEvent, tenant: str = pod.tenant) -> None:
                seen[tenant].append((event.kind, event.run_id))

            pod.watch(on_event)
        await trio.sleep(1)  # the subscriptions are announced and recorded
        start = trio.current_time()
        run_id = await acme.start("order", ORDER, run_id="o-1")
        assert run_id == "o-1"
        assert trio.current_time() == start  # a round trip takes no virtual time
        view = await acme.status("o-1")
        assert (view.run_id, view.workflow, view.status) == ("o-1", "order", RunStatus.RUNNING)
        output = await acme.result("o-1")
        assert trio.current_time() - start == 10.0
        assert output["receipt"] == "receipt-1"
        assert [h["name"] for h in await acme.history("o-1")] == [
            "stamp", "reserve", "reserve", "charge", "sleep",
        ]  # fmt: skip
        # The control plane stores it inside the tenant's scope.
        assert (await engine.get("acme/o-1")).status is RunStatus.COMPLETED
        # T23: another tenant can neither read it nor cancel it, nor see its events.
        with pytest.raises(RunNotFound):
            await globex.status("o-1")
        with pytest.raises(RunNotFound):
            await globex.cancel("o-1")
        with pytest.raises(UnknownWorkflow):
            await globex.start("no-such-workflow")
        await trio.sleep(1)
    assert seen["acme"] == [("run.started", "o-1"), ("run.completed", "o-1")]
    assert seen["globex"] == []


async def test_t19_t21_a_pod_cancels_its_run_and_sees_the_event(
    autojump_clock: trio.testing.MockClock,
) -> None:
    executions: Counter[str] = Counter()
    kinds: list[str] = []
    async with AsyncExitStack() as stack:
        backend = await stack.enter_async_context(dt.open_backend("memory://"))
        await stack.enter_async_context(open_worker(worker_app(executions), backend))
        await stack.enter_async_context(open_engine(engine_app(), backend, serve_tenants=True))
        pod = await stack.enter_async_context(
            dt.open_tenant_client(pod_backend(backend), "acme", namespace="shop")
        )
        pod.watch(lambda e: kinds.append(e.kind))
        await trio.sleep(1)
        await pod.start("order", ORDER, run_id="o-2")
        await trio.sleep(5)
        assert await pod.cancel("o-2")
        assert not await pod.cancel("o-2")
        with pytest.raises(RunCancelled):
            await pod.result("o-2")
        await trio.sleep(1)
    assert kinds == ["run.started", "run.cancelled"]


async def test_t19_t23_two_tenants_start_the_same_run_id_at_once_and_each_gets_its_own(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Regression: the start-run reply route was keyed by the run id alone, so two pods
    starting "basket-0" at once shared one route and one of them never got its reply."""
    executions: Counter[str] = Counter()
    outputs: dict[str, Any] = {}
    async with AsyncExitStack() as stack:
        backend = await stack.enter_async_context(dt.open_backend("memory://"))
        await stack.enter_async_context(open_worker(worker_app(executions), backend))
        await stack.enter_async_context(open_engine(engine_app(), backend, serve_tenants=True))
        pods = [
            await stack.enter_async_context(
                dt.open_tenant_client(
                    pod_backend(backend), tenant, namespace="shop", request_timeout=5.0
                )
            )
            for tenant in ("acme", "globex")
        ]

        async def checkout(n: int, pod: dt.TenantClient) -> None:
            order = {"id": n, "items": [], "wait": 1}
            await pod.start("order", order, run_id="basket-0")
            outputs[pod.tenant] = await pod.result("basket-0")

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for n, pod in enumerate(pods):
                nursery.start_soon(checkout, n, pod)
        assert trio.current_time() - start == 1.0
    assert outputs["acme"]["receipt"] == "receipt-0"
    assert outputs["globex"]["receipt"] == "receipt-1"


async def test_t22_a_worker_in_a_store_less_pod_is_seen_by_the_control_plane(
    autojump_clock: trio.testing.MockClock,
) -> None:
    executions: Counter[str] = Counter()
    async with (
        dt.open_backend("memory://") as backend,
        open_engine(engine_app(), backend, serve_tenants=True) as engine,
    ):
        async with open_worker(
            worker_app(executions), pod_backend(backend), tenant_pod=True, instance_id="pod-w"
        ):
            await trio.sleep(1)
            health = await engine.transport.health.group_health("charge")
            assert health is not None
            assert [w.instance for w in health.live_workers] == ["pod-w"]
        await trio.sleep(1)
        health = await engine.transport.health.group_health("charge")
        assert health is not None
        assert health.live_workers == ()  # withdrawn through the control plane on close


async def test_t18_a_pod_with_no_control_plane_times_out_at_exactly_its_request_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with (
        dt.open_backend("memory://") as backend,
        dt.open_tenant_client(
            pod_backend(backend), "acme", namespace="shop", request_timeout=7.0
        ) as pod,
    ):
        start = trio.current_time()
        with pytest.raises(dt.EngineError, match=r"no reply from the control plane within 7\.0 s"):
            await pod.status("x")
        assert trio.current_time() - start == 7.0


async def test_t23_bad_tenant_names_are_refused_before_anything_is_sent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with dt.open_backend("memory://") as backend:
        with pytest.raises(dt.ConfigError):
            async with dt.open_tenant_client(pod_backend(backend), "a/b", namespace="shop"):
                pass


# --------------------------------------------------------------------------- on Redis


@pytest.fixture(params=["redis", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def shared_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """A backend URL several backends in this process can open and share."""
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    if request.param == "postgres":
        return str(request.getfixturevalue("postgres_schema_url"))
    return f"sqlite:///{tmp_path}/shared.db"


async def test_remote_workflow_and_tenant_pods_on_the_real_stores(shared_url: str) -> None:
    """The same round trips against a real (private) redis-server, a private PostgreSQL server
    and a real SQLite file, in real time; engine and worker on one connection, the pods on
    another (store-less)."""
    executions: Counter[str] = Counter()
    events: list[str] = []
    async with AsyncExitStack() as stack:
        backend = await stack.enter_async_context(dt.open_backend(shared_url))
        await stack.enter_async_context(open_worker(worker_app(executions), backend))
        await stack.enter_async_context(open_engine(engine_app(), backend, serve_tenants=True))
        pod_side = await stack.enter_async_context(dt.open_backend(shared_url))
        pod = await stack.enter_async_context(
            dt.open_tenant_client(
                dt.Backend(url=pod_side.url, broker=pod_side.broker, keys=None),
                "acme",
                namespace="shop",
                result_poll=0.2,
            )
        )
        other = await stack.enter_async_context(
            dt.open_tenant_client(
                dt.Backend(url=pod_side.url, broker=pod_side.broker, keys=None),
                "globex",
                namespace="shop",
            )
        )
        four = trio.Event()

        def on_event(event: dt.TenantEvent) -> None:
            events.append(f"{event.kind}:{event.run_id}")
            if len(events) == 4:
                four.set()

        pod.watch(on_event)
        await trio.sleep(0.2)  # the subscription's announcement is on its queue
        with trio.fail_after(20):
            await pod.start("order", {"id": 7, "items": ["a"], "wait": 0.1}, run_id="good")
            output = await pod.result("good")
            await pod.start("explodes", None, run_id="bad")
            with pytest.raises(RunFailed):
                await pod.result("bad")
            with pytest.raises(RunNotFound):
                await other.status("bad")
            await four.wait()
    assert output == {"receipt": "receipt-7", "items": ["reserved-a"], "stamp": "stamp-7"}
    assert executions == Counter({"stamp:7": 1, "reserve:a": 1, "charge:7": 1, "reserve:x": 1})
    assert events == ["run.started:good", "run.completed:good", "run.started:bad", "run.failed:bad"]
