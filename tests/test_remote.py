"""Remote workflow turns (T14, docs/spec.md), decisions (T15), step events (T16), and the
store-less tenant protocol (T18-T23), under a virtual clock with exact times."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import pytest
import trio
import trio.lowlevel
import trio.testing
from hypothesis import given

import durable_trio as dt
from durable_trio.brokers.memory import MemoryBroker
from durable_trio.keys.memory import MemoryKeyStore
from helpers import Errors


def shared_backend(broker: MemoryBroker, keys: MemoryKeyStore | None) -> dt.Backend:
    return dt.Backend(url="test://", broker=broker, keys=keys)


def turn_task(workflow: str = "order", n: int = 1) -> dt.WorkflowTask:
    return dt.WorkflowTask(
        task_id=f"t{n}", run_id=f"run-{n}", workflow=workflow, group=workflow, input={"n": n}
    )


async def ignore_request(request: dt.RunRequest) -> None:
    return None


# --------------------------------------------------------------------------- T14


async def test_t14_a_turn_shares_the_step_loop_and_yields_a_decision(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with dt.open_backend("memory://") as backend:
        decisions: list[dt.WorkflowDecision] = []
        steps: list[str] = []
        async with dt.open_queue_transport(backend) as transport:

            async def turn(task: dt.WorkflowTask) -> dt.WorkflowDecision:
                return dt.WorkflowDecision(
                    task.task_id,
                    task.run_id,
                    dt.DecisionStatus.COMPLETED,
                    commands=({"schedule": "charge"},),
                    output=task.input["n"] * 10,
                )

            async def step(task: dt.RemoteTask) -> str:
                steps.append(task.step_id)
                return "stepped"

            async def on_decision(decision: dt.WorkflowDecision) -> None:
                decisions.append(decision)

            transport.remote.handle_workflow("order", turn)
            transport.handle("order", step)  # a step of the same name: same token, same loop
            transport.remote.on_decision(on_decision)
            await transport.remote.dispatch_workflow_task(turn_task())
            await transport.dispatch(
                dt.RemoteTask(run_id="r", step_id="s", attempt=1, name="order")
            )
            await trio.sleep(1)
            assert transport.statistics().queues.count("durable:tasks:order") == 1
    (decision,) = decisions
    assert (decision.status, decision.output, decision.commands) == (
        dt.DecisionStatus.COMPLETED,
        10,
        ({"schedule": "charge"},),
    )
    assert steps == ["s"]


async def test_t14_unknown_workflow_and_raising_turn_give_failed_decisions(
    autojump_clock: trio.testing.MockClock,
) -> None:
    errors = Errors()
    async with dt.open_backend("memory://") as backend:
        decisions: list[dt.WorkflowDecision] = []
        async with dt.open_queue_transport(backend, on_error=errors) as transport:

            async def broken(task: dt.WorkflowTask) -> dt.WorkflowDecision:
                raise RuntimeError("replay diverged")

            async def on_decision(decision: dt.WorkflowDecision) -> None:
                decisions.append(decision)

            transport.remote.handle_workflow("broken", broken)
            transport.remote.on_decision(on_decision)
            await transport.remote.dispatch_workflow_task(turn_task("broken", 1))
            # "ghost" routes to the broken token's queue but names no registered workflow
            await transport.remote.dispatch_workflow_task(
                dt.WorkflowTask("t2", "run-2", "ghost", "broken")
            )
            await trio.sleep(1)
    by_run = {d.run_id: d for d in decisions}
    assert by_run["run-1"].status is dt.DecisionStatus.FAILED
    assert by_run["run-1"].error is not None
    assert "replay diverged" in by_run["run-1"].error.message
    assert by_run["run-2"].error is not None
    assert by_run["run-2"].error.code == "no_workflow"
    assert any("raised" in m for m in errors.messages())


async def test_t14_a_running_turn_heartbeats(autojump_clock: trio.testing.MockClock) -> None:
    async with dt.open_backend("memory://") as backend:
        beats: list[tuple[float, str]] = []
        async with dt.open_queue_transport(backend, turn_heartbeat_interval=10.0) as transport:

            async def slow_turn(task: dt.WorkflowTask) -> dt.WorkflowDecision:
                await trio.sleep(35)
                return dt.WorkflowDecision(task.task_id, task.run_id, dt.DecisionStatus.COMPLETED)

            async def on_beat(beat: dt.StepHeartbeat) -> None:
                beats.append((trio.current_time(), beat.step_id))

            transport.remote.handle_workflow("order", slow_turn)
            transport.remote.on_heartbeat(on_beat)
            await transport.remote.dispatch_workflow_task(turn_task())
            await trio.sleep(60)
    assert [at for at, _ in beats] == [10.0, 20.0, 30.0]
    assert {step for _, step in beats} == {"turn:t1"}


async def test_t14_a_failed_decision_push_redelivers_the_turn(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class FlakyBroker(MemoryBroker):
        failures = 1

        async def push_on(self, queue: str, job: Any, **kw: Any) -> None:
            if queue.endswith(":decisions") and self.failures:
                self.failures -= 1
                raise dt.BrokerUnavailable("broker blinked")
            await super().push_on(queue, job, **kw)

    turns: list[float] = []
    decisions: list[dt.WorkflowDecision] = []
    async with dt.open_queue_transport(
        shared_backend(FlakyBroker(), MemoryKeyStore()), on_error=Errors()
    ) as transport:

        async def turn(task: dt.WorkflowTask) -> dt.WorkflowDecision:
            turns.append(trio.current_time())
            return dt.WorkflowDecision(task.task_id, task.run_id, dt.DecisionStatus.COMPLETED)

        async def on_decision(decision: dt.WorkflowDecision) -> None:
            decisions.append(decision)

        transport.remote.handle_workflow("order", turn)
        transport.remote.on_decision(on_decision)
        await transport.remote.dispatch_workflow_task(turn_task())
        await trio.sleep(5)
    # A broker error is not the turn's fault: the job comes back after 1 s, attempt-neutral.
    assert turns == [0.0, 1.0]
    assert len(decisions) == 1


# --------------------------------------------------------------------------- T15, T16


async def test_t15_every_handler_sees_every_decision_and_all_settle_before_a_redelivery(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen: list[tuple[str, float]] = []
    calls = {"flaky": 0}
    async with dt.open_backend("memory://") as backend:
        async with dt.open_queue_transport(backend, on_error=Errors()) as transport:

            async def slow(decision: dt.WorkflowDecision) -> None:
                await trio.sleep(5)
                seen.append(("slow", trio.current_time()))

            async def flaky(decision: dt.WorkflowDecision) -> None:
                calls["flaky"] += 1
                seen.append(("flaky", trio.current_time()))
                if calls["flaky"] == 1:
                    raise RuntimeError("first time fails")

            transport.remote.on_decision(slow)
            transport.remote.on_decision(flaky)
            assert len(transport.statistics().queues) == 1  # one loop for both
            await transport._producers.push(
                transport.names.decisions,
                dt.JobKind.DECISION,
                dt.WorkflowDecision("t", "r", dt.DecisionStatus.COMPLETED),
            )
            await trio.sleep(20)
    # both ran at once (0), the slow one settled at 5, THEN the redelivery ran both again
    assert sorted(seen) == [("flaky", 0.0), ("flaky", 5.0), ("slow", 5.0), ("slow", 10.0)]


async def test_t16_step_events_are_point_to_point(autojump_clock: trio.testing.MockClock) -> None:
    async with dt.open_backend("memory://") as backend:
        got: list[tuple[str, str]] = []
        async with (
            dt.open_queue_transport(backend, instance_id="e1") as e1,
            dt.open_queue_transport(backend, instance_id="e2") as e2,
        ):
            for engine in (e1, e2):

                async def on_event(event: dt.StepEvent, me: str = engine.instance_id) -> None:
                    got.append((me, event.step_id))

                engine.remote.on_step_event(on_event)
            for n in range(10):
                await e1.remote.dispatch_step_event(
                    dt.StepEvent("run", f"s{n}", dt.StepEventKind.COMPLETED, 1, 0.0)
                )
            await trio.sleep(1)
    assert sorted(step for _, step in got) == sorted(f"s{n}" for n in range(10))


# --------------------------------------------------------------------------- T18-T20


async def test_t18_t19_t20_run_requests_are_answered_into_the_requesters_inbox(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker, keys = MemoryBroker(), MemoryKeyStore()
    replies: dict[str, list[dt.RunReply]] = {"pod-a": [], "pod-b": []}
    async with (
        dt.open_queue_transport(shared_backend(broker, keys), instance_id="control") as control,
        dt.open_queue_transport(shared_backend(broker, None), instance_id="pod-a") as pod_a,
        dt.open_queue_transport(shared_backend(broker, None), instance_id="pod-b") as pod_b,
    ):

        async def answer(request: dt.RunRequest) -> None:
            assert request.reply_to in ("pod-a", "pod-b")  # T18: stamped with the sender
            await control.remote.publish_run_reply(
                dt.RunReply(request.request_id, True, {"for": request.run_id})
            )

        async def start(message: dt.StartRunMessage) -> None:
            await control.remote.publish_run_reply(dt.RunReply(message.run_id, True, "started"))

        control.remote.on_run_request(answer)
        control.remote.on_start_run(start)
        for pod in (pod_a, pod_b):
            pod.defer_consumers()  # T20: the reply inbox is never deferred

            def on_reply(reply: dt.RunReply, me: str = pod.instance_id) -> None:
                replies[me].append(reply)

            pod.remote.on_run_reply(on_reply)
        await pod_a.remote.dispatch_run_request(dt.RunRequest("req-1", "status", run_id="run-a"))
        await pod_b.remote.dispatch_run_request(dt.RunRequest("req-2", "status", run_id="run-b"))
        await pod_a.remote.dispatch_start_run(dt.StartRunMessage("run-a2", "order", {}))
        await trio.sleep(1)
        assert trio.current_time() == 1.0
    assert [(r.request_id, r.data) for r in replies["pod-a"]] == [
        ("req-1", {"for": "run-a"}),
        ("run-a2", "started"),
    ] or [(r.request_id, r.data) for r in replies["pod-a"]] == [
        ("run-a2", "started"),
        ("req-1", {"for": "run-a"}),
    ]
    assert [(r.request_id, r.data) for r in replies["pod-b"]] == [("req-2", {"for": "run-b"})]


async def test_t19_two_requesters_sharing_a_correlation_id_each_get_their_own_reply(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two tenants' pods start run "same" at once: both requests are in the control plane's
    hands together under one correlation id, and each reply still reaches its own requester
    (the route is held in the handler's context, not only in a table keyed by the id)."""
    broker, keys = MemoryBroker(), MemoryKeyStore()
    got: dict[str, list[Any]] = {"pod-a": [], "pod-b": []}
    async with (
        dt.open_queue_transport(
            shared_backend(broker, keys), instance_id="control", result_concurrency=2
        ) as control,
        dt.open_queue_transport(shared_backend(broker, None), instance_id="pod-a") as pod_a,
        dt.open_queue_transport(shared_backend(broker, None), instance_id="pod-b") as pod_b,
    ):
        both = trio.Event()
        held = 0

        async def on_start(message: dt.StartRunMessage) -> None:
            nonlocal held
            held += 1
            if held == 2:
                both.set()
            await both.wait()
            reply = dt.RunReply(message.run_id, True, message.tenant)
            await control.remote.publish_run_reply(reply)

        control.remote.on_start_run(on_start)
        for pod in (pod_a, pod_b):

            def on_reply(reply: dt.RunReply, me: str = pod.instance_id) -> None:
                got[me].append(reply.data)

            pod.remote.on_run_reply(on_reply)
        await pod_a.remote.dispatch_start_run(dt.StartRunMessage("same", "wf", None, "acme"))
        await pod_b.remote.dispatch_start_run(dt.StartRunMessage("same", "wf", None, "globex"))
        await trio.sleep(1)
    assert got == {"pod-a": ["acme"], "pod-b": ["globex"]}


async def test_t19_a_reply_with_no_known_requester_is_dropped_and_reported(
    autojump_clock: trio.testing.MockClock,
) -> None:
    errors = Errors()
    async with dt.open_backend("memory://") as backend:
        async with dt.open_queue_transport(backend, on_error=errors) as control:
            await control.remote.publish_run_reply(dt.RunReply("nobody-asked", True))
    assert any("no requester is known" in m for m in errors.messages())


async def test_t20_a_throwing_reply_listener_never_redelivers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    errors = Errors()
    calls = 0
    async with dt.open_backend("memory://") as backend:
        async with (
            dt.open_queue_transport(backend, instance_id="control") as control,
            dt.open_queue_transport(backend, instance_id="pod", on_error=errors) as pod,
        ):

            async def answer(request: dt.RunRequest) -> None:
                await control.remote.publish_run_reply(dt.RunReply(request.request_id, True))

            def on_reply(reply: dt.RunReply) -> None:
                nonlocal calls
                calls += 1
                raise RuntimeError("listener bug")

            control.remote.on_run_request(answer)
            pod.remote.on_run_reply(on_reply)
            await pod.remote.dispatch_run_request(dt.RunRequest("req-1", "status"))
            await trio.sleep(5)
    assert calls == 1
    assert any("listener bug" in m for m in errors.messages())


# --------------------------------------------------------------------------- T21-T23


async def test_t21_t23_events_reach_only_live_subscribers_of_their_tenant(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker, keys = MemoryBroker(), MemoryKeyStore()
    got: dict[str, list[tuple[str, str | None]]] = {"pod-a": [], "pod-b": []}
    async with (
        dt.open_queue_transport(shared_backend(broker, keys), instance_id="control") as control,
        dt.open_queue_transport(shared_backend(broker, None), instance_id="pod-a") as pod_a,
        dt.open_queue_transport(shared_backend(broker, None), instance_id="pod-b") as pod_b,
    ):
        for pod, tenant in ((pod_a, "acme"), (pod_b, "globex")):

            def on_event(event: dt.TenantEvent, me: str = pod.instance_id) -> None:
                got[me].append((event.tenant, event.run_id))

            pod.remote.on_tenant_event(tenant, on_event)
        await trio.sleep(1)  # the registrations are recorded
        for n in range(3):
            await control.remote.publish_tenant_event(dt.TenantEvent("acme", "progress", f"a{n}"))
            await control.remote.publish_tenant_event(dt.TenantEvent("globex", "progress", f"g{n}"))
        await control.remote.publish_tenant_event(dt.TenantEvent("initech", "progress", "nobody"))
        await trio.sleep(1)
        # T23: pod-b cannot read acme's events, even by popping pod-a's inbox name itself?
        # It has no handler for acme: an acme event pushed into ITS inbox reaches nobody.
        await pod_b._producers.push(
            pod_b.names.tenant_events("pod-b"),
            dt.JobKind.TENANT_EVENT,
            dt.TenantEvent("acme", "forged", "x"),
        )
        await trio.sleep(1)
    assert got["pod-a"] == [("acme", "a0"), ("acme", "a1"), ("acme", "a2")]
    assert got["pod-b"] == [("globex", "g0"), ("globex", "g1"), ("globex", "g2")]


async def test_t21_a_newer_subscription_is_never_overwritten_by_an_older_announcement(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Regression: the reply inbox's activation (tenants=()) and a subscription made at once
    were announced as snapshots by two tasks that may start in either order, so the older one
    could land last and withdraw the subscription (found by the engine's tenant-pod tests in
    about 1 run of 3). Each announcement now carries the state at the time it leaves."""
    for attempt in range(12):
        broker, keys = MemoryBroker(), MemoryKeyStore()
        async with (
            dt.open_queue_transport(shared_backend(broker, keys)) as control,
            dt.open_queue_transport(shared_backend(broker, None)) as pod,
        ):
            control.remote.on_run_request(ignore_request)
            await pod.remote.dispatch_run_request(dt.RunRequest(f"r{attempt}", "status"))
            pod.remote.on_tenant_event("acme", lambda event: None)
            await trio.sleep(1)
            assert await control.remote._registry.subscribers_of("acme") == [pod.instance_id]


async def test_t21_the_last_unsubscribe_withdraws_and_the_inbox_still_drains(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker, keys = MemoryBroker(), MemoryKeyStore()
    got: list[str | None] = []
    async with (
        dt.open_queue_transport(
            shared_backend(broker, keys), instance_id="control", tenant_subscribers_cache=0
        ) as control,
        dt.open_queue_transport(shared_backend(broker, None), instance_id="pod") as pod,
    ):

        def first(event: dt.TenantEvent) -> None:
            got.append(event.run_id)

        def second(event: dt.TenantEvent) -> None:
            got.append(f"2:{event.run_id}")

        off_first = pod.remote.on_tenant_event("acme", first)
        off_second = pod.remote.on_tenant_event("acme", second)
        await trio.sleep(1)
        await control.remote.publish_tenant_event(dt.TenantEvent("acme", "k", "r1"))
        await trio.sleep(1)
        off_first()
        await control.remote.publish_tenant_event(dt.TenantEvent("acme", "k", "r2"))
        await trio.sleep(1)
        off_second()  # the last one: the subscription is withdrawn
        await trio.sleep(1)
        assert await control.remote._registry.subscribers_of("acme") == []
        await control.remote.publish_tenant_event(dt.TenantEvent("acme", "k", "r3"))
        await trio.sleep(1)
    assert sorted(map(str, got)) == sorted(["r1", "2:r1", "2:r2"])


async def test_t21_subscriptions_are_reannounced_every_third_of_the_ttl(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker, keys = MemoryBroker(), MemoryKeyStore()
    async with (
        dt.open_queue_transport(
            shared_backend(broker, keys), instance_id="control", tenant_subscribers_cache=0
        ) as control,
        dt.open_queue_transport(
            shared_backend(broker, None), instance_id="pod", inbox_ttl=30
        ) as pod,
    ):
        control.remote.on_run_request(ignore_request)
        pod.remote.on_tenant_event("acme", lambda event: None)
        await trio.sleep(100)  # far past one ttl: still subscribed thanks to re-announcing
        assert await control.remote._registry.subscribers_of("acme") == ["pod"]
    # the pod closed: its registration was withdrawn at once
    async with dt.open_queue_transport(
        shared_backend(broker, keys), tenant_subscribers_cache=0
    ) as later:
        later.remote._ensure_registrations_loop()
        await trio.sleep(1)
        assert await later.remote._registry.subscribers_of("acme") == []


async def test_t22_the_janitor_drains_the_inbox_of_an_instance_that_went_away(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker, keys = MemoryBroker(), MemoryKeyStore()
    async with dt.open_queue_transport(
        shared_backend(broker, keys),
        instance_id="control",
        inbox_sweep_interval=30,
        tenant_subscribers_cache=0,
    ) as control:
        async with dt.open_queue_transport(
            shared_backend(broker, None), instance_id="pod", inbox_ttl=15
        ) as pod:
            pod.remote.on_tenant_event("acme", lambda event: None)
            await trio.sleep(1)
            pod.remote._registry.active = False  # the pod "crashes": it stops announcing
            for loop in pod._consumers.loops:  # ... and its inbox loops stop consuming
                if loop.inbox and loop.pop_scope is not None:
                    loop.pop_scope.cancel()
            await trio.lowlevel.checkpoint()
            for n in range(5):
                await control.remote.publish_tenant_event(dt.TenantEvent("acme", "k", f"r{n}"))
            assert await broker.size_of(control.names.tenant_events("pod")) == 5
            await trio.sleep(40)  # the registration expired at 16; the sweep at 30 drained it
            assert await broker.size_of(control.names.tenant_events("pod")) == 0


async def test_t22_a_store_less_pod_forwards_its_worker_advertisements(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker, keys = MemoryBroker(), MemoryKeyStore()
    async with dt.open_queue_transport(
        shared_backend(broker, keys), instance_id="control"
    ) as control:
        control.remote.on_run_request(ignore_request)
        async with dt.open_queue_transport(shared_backend(broker, None), instance_id="pod") as pod:
            pod.remote.use_tenant_role()

            async def step(task: dt.RemoteTask) -> None:
                return None

            pod.handle("resize", step)
            await trio.sleep(1)
            health = await control.health.group_health("resize")
            assert health is not None
            assert [w.instance for w in health.live_workers] == ["pod"]
        await trio.sleep(1)
        health = await control.health.group_health("resize")
        assert health is not None
        assert health.live_workers == ()  # withdrawn through the control plane on close


@pytest.mark.parametrize("seed", range(3))
async def test_t24_close_drains_the_instances_own_inboxes(
    autojump_clock: trio.testing.MockClock, seed: int
) -> None:
    broker = MemoryBroker()
    async with dt.open_queue_transport(shared_backend(broker, None), instance_id="pod") as pod:
        pod.remote.on_run_reply(lambda reply: None)
        await trio.lowlevel.checkpoint()
    for n in range(seed + 2):
        await broker.push_on(pod.names.run_replies("pod"), dt.brokers.Job(f"j{n}", b"{}"))
    async with dt.open_queue_transport(shared_backend(broker, None), instance_id="pod") as pod:
        pod.remote.on_run_reply(lambda reply: None)
        await trio.lowlevel.checkpoint()
    assert await broker.size_of(pod.names.run_replies("pod")) == 0


@given(
    interleaving=st.lists(st.sampled_from(["a", "b", "sleep"]), min_size=1, max_size=30),
)
def test_t21_one_publishers_events_arrive_in_order_under_any_interleaving(
    interleaving: list[str],
) -> None:
    """Two publishing tasks of one control plane, interleaved at random: each subscriber sees
    each task's events in the order that task published them."""

    async def main() -> None:
        broker, keys = MemoryBroker(), MemoryKeyStore()
        got: list[str] = []
        async with (
            dt.open_queue_transport(
                shared_backend(broker, keys), instance_id="control", tenant_subscribers_cache=0
            ) as control,
            dt.open_queue_transport(shared_backend(broker, None), instance_id="pod") as pod,
        ):
            pod.remote.on_tenant_event("acme", lambda e: got.append(str(e.run_id)))
            await trio.sleep(1)
            counters = {"a": 0, "b": 0}
            async with trio.open_nursery() as nursery:
                for step in interleaving:
                    if step == "sleep":
                        await trio.sleep(0.001)
                        continue
                    counters[step] += 1
                    nursery.start_soon(
                        control.remote.publish_tenant_event,
                        dt.TenantEvent("acme", "k", f"{step}{counters[step]}"),
                    )
                    await trio.lowlevel.checkpoint()
            await trio.sleep(1)
        for publisher in "ab":
            mine = [g for g in got if g.startswith(publisher)]
            assert mine == [f"{publisher}{n}" for n in range(1, counters[publisher] + 1)]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def test_a_handler_meeting_a_closing_transport_hands_its_job_back_attempt_neutral(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A handler that meets ``TransportClosed`` (an engine answering a pod's request while it
    closes raises it) is not at fault: its job comes back after 1 s with no attempt counted,
    even where one failed attempt would fail it for good."""
    seen: list[float] = []
    async with dt.open_backend("memory://") as backend:
        async with dt.open_queue_transport(
            backend, on_error=Errors(), max_job_attempts=1
        ) as transport:

            async def turn(task: dt.WorkflowTask) -> dt.WorkflowDecision:
                return dt.WorkflowDecision(task.task_id, task.run_id, dt.DecisionStatus.COMPLETED)

            async def on_decision(decision: dt.WorkflowDecision) -> None:
                seen.append(trio.current_time())
                if len(seen) == 1:
                    raise dt.TransportClosed("closing under the handler")

            transport.remote.handle_workflow("order", turn)
            transport.remote.on_decision(on_decision)
            await transport.remote.dispatch_workflow_task(turn_task())
            await trio.sleep(5)
    assert seen == [0.0, 1.0]
