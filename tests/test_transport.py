"""The queue transport's core behaviours: T1-T5, T10, T17 (docs/spec.md), deferred consumers,
bad input."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio._codec import encode_envelope
from durable_trio.brokers import Job
from durable_trio.brokers.memory import MemoryBroker
from durable_trio.keys.memory import MemoryKeyStore
from helpers import CountingBroker, DefectiveBroker, Errors


def task(name: str, n: int = 0, **kw: Any) -> dt.RemoteTask:
    return dt.RemoteTask(run_id=f"run-{n}", step_id=f"step-{n}", attempt=1, name=name, **kw)


def backend_with(broker: Any) -> dt.Backend:
    return dt.Backend(url="test://", broker=broker, keys=MemoryKeyStore())


async def test_round_trip_dispatch_handler_result(autojump_clock: trio.testing.MockClock) -> None:
    async with dt.open_backend("memory://") as backend:
        async with dt.open_queue_transport(backend, namespace="shop") as transport:
            results: list[dt.StepResult] = []
            got = trio.Event()

            async def charge(t: dt.RemoteTask) -> Any:
                return {"charged": t.input["amount"], "key": t.idempotency_key}

            async def on_result(result: dt.StepResult) -> None:
                results.append(result)
                got.set()

            transport.handle("charge-card", charge)
            transport.on_result(on_result)
            sent = task("charge-card", 1, input={"amount": 5})
            await transport.dispatch(sent)
            await got.wait()
    (result,) = results
    assert result.status is dt.StepStatus.COMPLETED
    assert result.output == {"charged": 5, "key": "run-1:step-1"}
    assert (result.run_id, result.step_id, result.attempt, result.task_id) == (
        "run-1",
        "step-1",
        1,
        sent.task_id,
    )


async def test_t1_tasks_route_to_prefix_tasks_token(autojump_clock: trio.testing.MockClock) -> None:
    """T1: `{prefix}:tasks:{token}`, token = tenant-group(sanitized name or group, partition)."""
    broker = MemoryBroker()
    async with dt.open_queue_transport(backend_with(broker), namespace="shop") as transport:
        await transport.dispatch(task("charge-card"))
        await transport.dispatch(task("anything", group="billing"))
        await transport.dispatch(task("evil:name}{*"))
        assert await broker.size_of("shop:tasks:charge-card") == 1
        assert await broker.size_of("shop:tasks:billing") == 1
        evil = transport.names.task_queue("evil:name}{*")
        assert evil.startswith("shop:tasks:evil_name___+")
        assert await broker.size_of(evil) == 1
    async with dt.open_queue_transport(
        backend_with(broker), namespace="shop", partition="tenant-7"
    ) as transport:
        await transport.dispatch(task("charge-card"))
        assert await broker.size_of("shop:tasks:charge-card@tenant-7") == 1


async def test_t2_every_queue_carries_the_namespace(autojump_clock: trio.testing.MockClock) -> None:
    """T2: explicit namespace or the default; every key of an instance carries it."""
    async with dt.open_backend("memory://") as backend:
        async with dt.open_queue_transport(backend) as default:
            names = default.names
            assert names.prefix == "durable"
        async with dt.open_queue_transport(backend, namespace="billing") as transport:

            async def noop(t: dt.RemoteTask) -> None:
                return None

            async def ignore(_: Any) -> None:
                return None

            transport.handle("a", noop)
            transport.on_result(ignore)
            transport.remote.on_heartbeat(ignore)
            transport.remote.on_control(ignore)
            queues = transport.statistics().queues
            assert len(queues) == 4
            assert all(q.startswith("billing:") for q in queues)
            assert transport.names.worker_heartbeat("a", "i-1").startswith("billing-")


async def test_t3_priorities_lower_first_fifo_within(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """T3 through the transport: the worker runs lower priority numbers first, FIFO within."""
    async with dt.open_backend("memory://") as backend:
        async with dt.open_queue_transport(backend, concurrency=1) as transport:
            order: list[str] = []

            async def record(t: dt.RemoteTask) -> None:
                order.append(t.step_id)

            transport.defer_consumers()
            transport.handle("job", record)
            for n, priority in enumerate([5, None, 1, 5, 1, -2]):
                await transport.dispatch(
                    dt.RemoteTask(
                        run_id="r", step_id=f"s{n}", attempt=1, name="job", priority=priority
                    )
                )
            transport.start_consumers()
            await trio.sleep(1)
    assert order == ["s5", "s1", "s2", "s4", "s0", "s3"]


async def test_t3_delayed_dispatch_is_promoted_without_a_pop(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with dt.open_backend("memory://") as backend:
        async with dt.open_queue_transport(backend) as transport:
            ran_at: list[float] = []

            async def record(t: dt.RemoteTask) -> None:
                ran_at.append(trio.current_time())

            transport.handle("job", record)
            start = trio.current_time()
            await transport.dispatch(task("job"), delay=30.0)
            await trio.sleep(60)
    assert ran_at == [start + 30.0]


async def test_t4_idle_backoff_doubles_to_the_cap_and_a_job_resets_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """T4 on a broker without a wake-up signal: 200, 400, 800, 800 ms ... reset by a job."""
    broker = CountingBroker(wakeup=False)
    async with dt.open_queue_transport(backend_with(broker), namespace="t4") as transport:

        async def noop(t: dt.RemoteTask) -> None:
            return None

        start = trio.current_time()
        transport.handle("job", noop)
        await trio.sleep(3.01)
        times = [round(t - start, 3) for t, q in broker.pops if q == "t4:tasks:job"]
        assert times == [0.0, 0.2, 0.6, 1.4, 2.2, 3.0]
        await transport.dispatch(task("job"))
        await trio.sleep(3.01)
        times = [round(t - start, 3) for t, q in broker.pops if q == "t4:tasks:job"]
        # found at 3.8 (a pop that takes a job polls again at once), then 200 ms again
        assert times[6:] == [3.8, 3.8, 4.0, 4.4, 5.2, 6.0]


async def test_t4_results_loop_never_backs_off(autojump_clock: trio.testing.MockClock) -> None:
    broker = CountingBroker(wakeup=False)
    async with dt.open_queue_transport(backend_with(broker), namespace="t4") as transport:

        async def ignore(_: Any) -> None:
            return None

        start = trio.current_time()
        transport.on_result(ignore)
        await trio.sleep(1.01)
        times = [round(t - start, 3) for t, q in broker.pops if q == "t4:results"]
        assert times == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]


async def test_t4_an_idle_transport_with_a_wakeup_signal_makes_no_periodic_polls(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """T4 beyond polling: 10 step names, one pop each at start, then nothing for an hour."""
    broker = CountingBroker(wakeup=True)
    async with dt.open_queue_transport(backend_with(broker)) as transport:

        async def noop(t: dt.RemoteTask) -> None:
            return None

        for n in range(10):
            transport.handle(f"step-{n}", noop)
        await trio.sleep(3600)
        assert len(broker.pops) == 10
        start = trio.current_time()
        await transport.dispatch(task("step-3"))
        await trio.sleep(1)
        # one pop takes the job (it asks for the one free slot only, so it cannot tell the
        # queue drained: docs/concepts.md, "Claims and stalls"); the next, once the handler
        # freed its slot, finds the queue empty and waits: no periodic poll
        assert [t - start for t, _ in broker.pops[10:]] == [0.0, 0.0]


async def test_t5_n_slots_cost_one_poll_loop(autojump_clock: trio.testing.MockClock) -> None:
    """T5: concurrency 4, ten 1-second steps: 4 at a time, done at exactly 3 s."""
    async with dt.open_backend("memory://") as backend:
        async with dt.open_queue_transport(backend, concurrency=4) as transport:
            running = 0
            peak = 0
            finished: list[float] = []

            async def slow(t: dt.RemoteTask) -> None:
                nonlocal running, peak
                running += 1
                peak = max(peak, running)
                await trio.sleep(1)
                running -= 1
                finished.append(trio.current_time())

            transport.defer_consumers()
            transport.handle("slow", slow)
            for n in range(10):
                await transport.dispatch(task("slow", n))
            start = trio.current_time()
            transport.start_consumers()
            await trio.sleep(10)
            assert len(transport.statistics().queues) == 1
    assert peak == 4
    assert [t - start for t in finished] == [1.0] * 4 + [2.0] * 4 + [3.0] * 2


async def test_t5_the_limit_is_shared_by_every_step_name(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with dt.open_backend("memory://") as backend:
        async with dt.open_queue_transport(backend, concurrency=3) as transport:
            running = 0
            peak = 0

            async def slow(t: dt.RemoteTask) -> None:
                nonlocal running, peak
                running += 1
                peak = max(peak, running)
                await trio.sleep(1)
                running -= 1

            for name in ("a", "b", "c", "d"):
                transport.handle(name, slow)
                for n in range(3):
                    await transport.dispatch(task(name, n))
            await trio.sleep(10)
    assert peak == 3


async def test_t10_a_raising_result_handler_redelivers_then_fails_for_good(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """T10: hand back for redelivery with the error reported; nothing redelivered forever."""
    errors = Errors()
    broker = MemoryBroker()
    async with dt.open_queue_transport(
        backend_with(broker), on_error=errors, max_job_attempts=3
    ) as transport:
        calls = 0

        async def flaky(result: dt.StepResult) -> None:
            nonlocal calls
            calls += 1
            raise RuntimeError(f"engine down #{calls}")

        transport.on_result(flaky)
        await transport.publish_result(dt.StepResult("r", "s", 1, dt.StepStatus.COMPLETED))
        await trio.sleep(5)
        (failed,) = await broker.failed_jobs(transport.names.results)
    assert calls == 3
    assert "handler failed 3 times" in failed.error
    assert "engine down #3" in failed.error
    messages = errors.messages()
    assert sum("job handed back" in m for m in messages) == 2
    assert any("job failed" in m for m in messages)
    assert all(isinstance(e, dt.JobError) and e.queue == "durable:results" for e in errors.seen)


async def test_t10_a_finalize_answering_lease_lost_is_reported_not_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    errors = Errors()
    broker = CountingBroker()
    async with dt.open_queue_transport(backend_with(broker), on_error=errors) as transport:
        release = trio.Event()

        async def stuck(t: dt.RemoteTask) -> None:
            await release.wait()

        transport.handle("job", stuck)
        await transport.dispatch(task("job"))
        await trio.sleep(1)
        # someone else's sweep takes the claim back behind our back
        await broker.inner.recover_stalled_jobs(transport.names.task_queue("job"), 0.5, 3)
        release.set()
        await trio.sleep(1)
    assert any("lease lost" in m for m in errors.messages())
    assert broker.handbacks == []


async def test_t17_control_is_point_to_point(autojump_clock: trio.testing.MockClock) -> None:
    """T17: best-effort, point-to-point: two consumers, each message taken by exactly one."""
    async with dt.open_backend("memory://") as backend:
        seen: list[tuple[str, str | None]] = []

        async with (
            dt.open_queue_transport(backend, instance_id="a") as a,
            dt.open_queue_transport(backend, instance_id="b") as b,
        ):
            for transport in (a, b):

                async def on_control(m: dt.ControlMessage, me: str = transport.instance_id) -> None:
                    seen.append((me, m.run_id))

                transport.remote.on_control(on_control)
            for n in range(20):
                await a.remote.send_control(dt.ControlMessage(action="cancel", run_id=f"r{n}"))
            await trio.sleep(5)
    assert sorted(str(run) for _, run in seen) == sorted(f"r{n}" for n in range(20))


async def test_deferred_consumers_take_nothing_until_started(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = CountingBroker()
    async with dt.open_queue_transport(backend_with(broker)) as transport:

        async def noop(t: dt.RemoteTask) -> None:
            return None

        transport.defer_consumers()
        transport.handle("job", noop)
        await transport.dispatch(task("job"))  # producers are never deferred
        await trio.sleep(10)
        assert broker.pops == []
        assert await broker.size_of(transport.names.task_queue("job")) == 1
        transport.start_consumers()
        await trio.sleep(1)
        assert await broker.size_of(transport.names.task_queue("job")) == 0


async def test_dispatch_refuses_an_oversized_payload(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with dt.open_backend("memory://") as backend:
        async with dt.open_queue_transport(backend, max_payload_bytes=2048) as transport:
            with pytest.raises(dt.PayloadTooLarge, match="over max_payload_bytes=2048"):
                await transport.dispatch(task("job", input="x" * 4096))


async def test_options_are_validated() -> None:
    async with dt.open_backend("memory://") as backend:
        with pytest.raises(dt.ConfigError, match="close_timeout"):
            async with dt.open_queue_transport(backend, close_timeout=-1):
                pass
        with pytest.raises(dt.ConfigError, match="concurrency"):
            async with dt.open_queue_transport(backend, concurrency=0):
                pass
        with pytest.raises(dt.ConfigError, match="unexpected keyword"):
            async with dt.open_queue_transport(backend, concurency=3):
                pass


async def test_a_closed_transport_refuses_work(autojump_clock: trio.testing.MockClock) -> None:
    async with dt.open_backend("memory://") as backend:
        async with dt.open_queue_transport(backend) as transport:
            await transport.aclose()
            with pytest.raises(dt.TransportClosed):
                await transport.dispatch(task("job"))
            with pytest.raises(dt.TransportClosed):
                transport.handle("job", lambda t: None)  # type: ignore[arg-type,return-value]


# --- bad input: each reported with queue and job id, failed and inspectable, loop carries on ---


class BadInputWorld:
    def __init__(self, transport: dt.QueueTransport, broker: MemoryBroker, errors: Errors) -> None:
        self.transport = transport
        self.broker = broker
        self.errors = errors
        self.results: list[dt.StepResult] = []
        self.ran: list[str] = []

    async def push_raw(self, data: bytes, job_id: str = "bad-1") -> None:
        await self.broker.push_on(self.transport.names.task_queue("job"), Job(job_id, data))

    async def good_job_still_runs(self) -> None:
        await self.transport.dispatch(task("job", 99))
        await trio.sleep(1)
        assert "step-99" in self.ran

    async def failed(self) -> list[Any]:
        return await self.broker.failed_jobs(self.transport.names.task_queue("job"))


@pytest.fixture
async def bad_world(autojump_clock: trio.testing.MockClock) -> Any:
    errors = Errors()
    broker = MemoryBroker()
    async with dt.open_queue_transport(backend_with(broker), on_error=errors) as transport:
        world = BadInputWorld(transport, broker, errors)

        async def job(t: dt.RemoteTask) -> Any:
            world.ran.append(t.step_id)
            if t.input == "raise":
                raise ValueError("card declined")
            if t.input == "unserialisable":
                return {1, 2, 3}
            return "ok"

        async def on_result(r: dt.StepResult) -> None:
            world.results.append(r)

        transport.handle("job", job)
        transport.on_result(on_result)
        yield world


def _only_error(world: BadInputWorld) -> dt.JobError:
    job_errors = [e for e in world.errors.seen if isinstance(e, dt.JobError)]
    assert len(job_errors) == 1, world.errors.messages()
    return job_errors[0]


async def test_bad_input_not_json(
    bad_world: BadInputWorld, autojump_clock: trio.testing.MockClock
) -> None:
    await bad_world.push_raw(b"\x00\x01 definitely not json")
    await trio.sleep(1)
    error = _only_error(bad_world)
    assert (error.queue, error.job_id) == ("durable:tasks:job", "bad-1")
    assert "not JSON" in str(error)
    (failed,) = await bad_world.failed()
    assert failed.id == "bad-1"
    assert "bad input" in failed.error
    await bad_world.good_job_still_runs()


async def test_bad_input_wrong_shape_names_the_field_and_fails_the_step(
    bad_world: BadInputWorld, autojump_clock: trio.testing.MockClock
) -> None:
    payload = {"runId": "r", "stepId": "s", "attempt": 1, "name": 7, "taskId": "t"}
    await bad_world.push_raw(orjson.dumps({"id": "bad-1", "kind": "task", "payload": payload}))
    await trio.sleep(1)
    error = _only_error(bad_world)
    assert "$.name" in str(error)
    (failed,) = await bad_world.failed()
    assert failed.id == "bad-1"
    # it named its run and step, so the run is told instead of waiting forever
    (result,) = bad_world.results
    assert (result.run_id, result.step_id, result.status) == ("r", "s", dt.StepStatus.FAILED)
    assert result.error is not None
    assert (result.error.code, result.error.retryable) == ("bad_input", False)
    await bad_world.good_job_still_runs()


async def test_bad_input_unknown_job_kind(
    bad_world: BadInputWorld, autojump_clock: trio.testing.MockClock
) -> None:
    await bad_world.push_raw(orjson.dumps({"id": "bad-1", "kind": "rm -rf", "payload": {}}))
    await trio.sleep(1)
    assert "unknown job kind" in str(_only_error(bad_world))
    assert [f.id for f in await bad_world.failed()] == ["bad-1"]
    await bad_world.good_job_still_runs()


async def test_bad_input_a_kind_that_does_not_belong(
    bad_world: BadInputWorld, autojump_clock: trio.testing.MockClock
) -> None:
    result = dt.StepResult("r", "s", 1, dt.StepStatus.COMPLETED)
    await bad_world.push_raw(encode_envelope("bad-1", dt.JobKind.RESULT, result))
    await trio.sleep(1)
    assert "does not belong on a task queue" in str(_only_error(bad_world))
    assert [f.id for f in await bad_world.failed()] == ["bad-1"]
    # A result sent to the wrong queue is set aside; the run it names is not failed for it.
    assert bad_world.results == []


async def test_bad_input_oversized_job_on_a_queue_is_failed_unparsed(
    bad_world: BadInputWorld, autojump_clock: trio.testing.MockClock
) -> None:
    await bad_world.push_raw(b"[" + b"1," * 600_000 + b"1]")
    await trio.sleep(1)
    assert "over max_payload_bytes" in str(_only_error(bad_world))
    assert [f.id for f in await bad_world.failed()] == ["bad-1"]
    await bad_world.good_job_still_runs()


async def test_a_raising_handler_gives_a_failed_retryable_result(
    bad_world: BadInputWorld, autojump_clock: trio.testing.MockClock
) -> None:
    await bad_world.transport.dispatch(task("job", 1, input="raise"))
    await trio.sleep(1)
    error = _only_error(bad_world)
    assert "card declined" in str(error)
    assert error.queue == "durable:tasks:job"
    (result,) = bad_world.results
    assert result.status is dt.StepStatus.FAILED
    assert result.error == dt.StepError("ValueError: card declined", retryable=True)
    assert await bad_world.failed() == []  # the job itself completed: its outcome is the result
    await bad_world.good_job_still_runs()


async def test_an_unserialisable_output_gives_a_failed_result(
    bad_world: BadInputWorld, autojump_clock: trio.testing.MockClock
) -> None:
    await bad_world.transport.dispatch(task("job", 1, input="unserialisable"))
    await trio.sleep(1)
    assert "cannot be sent" in str(_only_error(bad_world))
    (result,) = bad_world.results
    assert result.error is not None
    assert (result.error.code, result.error.retryable) == ("bad_output", False)
    await bad_world.good_job_still_runs()


async def test_an_unknown_step_name_gives_a_failed_result(
    bad_world: BadInputWorld, autojump_clock: trio.testing.MockClock
) -> None:
    await bad_world.transport.dispatch(task("nobody-serves-this", group="job"))
    await trio.sleep(1)
    assert "no handler" in str(_only_error(bad_world))
    (result,) = bad_world.results
    assert result.error is not None
    assert result.error.code == "no_handler"


async def test_a_raising_error_hook_does_not_kill_the_loop(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_hook(exc: BaseException) -> None:
        raise RuntimeError("hook is broken")

    broker = MemoryBroker()
    async with dt.open_queue_transport(backend_with(broker), on_error=broken_hook) as transport:
        ran: list[str] = []

        async def job(t: dt.RemoteTask) -> None:
            ran.append(t.step_id)

        transport.handle("job", job)
        await broker.push_on(transport.names.task_queue("job"), Job("bad", b"nope"))
        await transport.dispatch(task("job", 5))
        await trio.sleep(1)
    assert ran == ["step-5"]
    assert "on_error hook raised" in caplog.text


# --------------------------------------------------------------------------- leaving the block


class Mine(Exception):
    """The body's own exception."""


async def _sleeping_step(t: dt.RemoteTask) -> None:
    await trio.sleep(1.0)


async def test_the_body_exception_leaves_bare_when_a_loop_fails_at_the_same_instant(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The body raises the instant a job worker meets a broker defect: the caller gets its own
    exception, bare, the defect attached as its context and named in a note."""
    broker = DefectiveBroker()

    async def body() -> None:
        async with dt.open_queue_transport(backend_with(broker)) as transport:
            transport.handle("job", _sleeping_step)
            await transport.dispatch(task("job", 1))
            await broker.raised.wait()
            raise Mine("mine")

    with pytest.raises(Mine, match="mine") as caught:
        await body()
    assert trio.current_time() == 1.0
    error = caught.value
    assert isinstance(error.__context__, TypeError)
    assert str(error.__context__) == "a broker defect"
    assert error.__notes__ == [
        "durable_trio: the queue transport also raised TypeError('a broker defect') at the "
        "same time (attached as __context__)"
    ]


async def test_a_loop_failing_during_the_close_of_a_raising_body_is_attached_to_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The body raises at 0.5 s; the handler ends at 1 s inside close's drain and its finalize
    meets the defect: the body's exception leaves, its own context kept beside the defect."""
    broker = DefectiveBroker()

    async def body() -> None:
        async with dt.open_queue_transport(backend_with(broker), close_timeout=5.0) as transport:
            transport.handle("job", _sleeping_step)
            await transport.dispatch(task("job", 1))
            await trio.sleep(0.5)
            try:
                raise KeyError("what the body was handling")
            except KeyError:
                raise Mine("mine")  # noqa: B904 (its context is the point)

    with pytest.raises(Mine) as caught:
        await body()
    assert trio.current_time() == 1.0
    context = caught.value.__context__
    assert isinstance(context, BaseExceptionGroup)
    defect, handled = context.exceptions
    assert (type(defect), str(defect)) == (TypeError, "a broker defect")
    assert isinstance(handled, KeyError)


async def test_a_lone_loop_failure_leaves_bare_not_in_nested_groups(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """No body exception: the loop's failure itself, unwrapped from the nurseries' groups."""
    broker = DefectiveBroker()

    async def body() -> None:
        async with dt.open_queue_transport(backend_with(broker)) as transport:
            transport.handle("job", _sleeping_step)
            await transport.dispatch(task("job", 1))
            await trio.sleep_forever()

    with pytest.raises(TypeError, match="a broker defect") as caught:
        await body()
    assert trio.current_time() == 1.0
    assert not hasattr(caught.value, "__notes__")
