"""Fleet-wide concurrency limits (issue 33, items 1 and 2) through the engine and workers, on
the memory broker under a virtual clock: exact times for the limit across workers, per-key
independence, a slot held by a dead worker coming back at the reclaim, and the refusals."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio import open_engine, open_worker
from durable_trio._engine import RunStatus
from durable_trio.brokers.memory import MemoryBroker
from durable_trio.keys.memory import MemoryKeyStore
from helpers import CountingBroker, Errors, two_workers_and_an_engine


class Meter:
    """Records each attempt's start time, and the most attempts running at once (per key)."""

    def __init__(self) -> None:
        self.starts: list[tuple[float, Any]] = []
        self.running: dict[Any, int] = {}
        self.peak: dict[Any, int] = {}

    async def run(self, key: Any, seconds: float) -> None:
        self.starts.append((trio.current_time(), key))
        self.running[key] = self.running.get(key, 0) + 1
        self.peak[key] = max(self.peak.get(key, 0), self.running[key])
        try:
            await trio.sleep(seconds)
        finally:
            self.running[key] -= 1


def limited_app(meter: Meter, *, per_key: bool, limit: int) -> dt.App:
    app = dt.App("limits")
    key_fn = (lambda order: order["account"]) if per_key else None

    @app.step("charge", max_concurrency=limit, concurrency_key=key_fn)
    async def charge(order: dict[str, Any]) -> str:
        await meter.run(order["account"] if per_key else "all", order["seconds"])
        return str(order["account"])

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, order: dict[str, Any]) -> str:
        return str(await ctx.step("charge", order))

    return app


async def test_max_concurrency_holds_across_every_worker(
    autojump_clock: trio.testing.MockClock,
) -> None:
    meter = Meter()
    app = limited_app(meter, per_key=False, limit=3)
    errors = Errors()
    async with dt.open_backend("memory://") as backend:
        async with two_workers_and_an_engine(app, backend, concurrency=8, errors=errors) as engine:
            ids = [
                await engine.start("order", {"account": f"a{n}", "seconds": 10.0})
                for n in range(9)
            ]
            for run_id in ids:
                await engine.result(run_id)
            stats = await backend.broker.queue_stats("limits:tasks:charge")  # type: ignore[attr-defined]
    assert [t for t, _ in meter.starts] == [0.0] * 3 + [10.0] * 3 + [20.0] * 3
    assert meter.peak == {"all": 3}
    assert trio.current_time() == 30.0
    assert (stats.limit, stats.per_key, stats.claimed, stats.ready) == (3, False, 0, 0)
    assert errors.seen == []


async def test_a_hot_key_never_holds_back_the_other_keys(
    autojump_clock: trio.testing.MockClock,
) -> None:
    meter = Meter()
    app = limited_app(meter, per_key=True, limit=1)
    errors = Errors()
    async with dt.open_backend("memory://") as backend:
        async with two_workers_and_an_engine(app, backend, concurrency=2, errors=errors) as engine:
            accounts = ["hot", "hot", "hot", "b", "c", "hot", "d"]
            ids = [
                await engine.start("order", {"account": a, "seconds": 10.0}) for a in accounts
            ]
            assert [await engine.result(run_id) for run_id in ids] == accounts
    # One "hot" at a time, while b, c and d (behind the hot key's jobs) start at once: 4
    # slots in the fleet, the 4 keys each use one.
    assert sorted(meter.starts) == [
        (0.0, "b"), (0.0, "c"), (0.0, "d"), (0.0, "hot"),
        (10.0, "hot"), (20.0, "hot"), (30.0, "hot"),
    ]  # fmt: skip
    assert meter.peak == {"hot": 1, "b": 1, "c": 1, "d": 1}
    assert errors.seen == []


async def test_slots_held_by_a_dead_worker_come_back_when_its_claims_are_reclaimed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    meter = Meter()
    app = limited_app(meter, per_key=False, limit=2)
    broker = MemoryBroker()
    backend = dt.Backend(url="test://", broker=broker, keys=MemoryKeyStore())
    queue = "limits:tasks:charge"
    async with open_engine(app, backend) as engine:
        ids = [
            await engine.start("order", {"account": f"a{n}", "seconds": 1.0}) for n in range(4)
        ]
        await trio.testing.wait_all_tasks_blocked()
        await broker.set_queue_limit(queue, 2)
        # A worker claims both slots and dies: nobody renews, nobody finishes.
        ghost = await broker.pop_many(queue, 8, worker="ghost")
        assert len(ghost) == 2
        async with open_worker(
            app,
            backend,
            concurrency=8,
            stalled_threshold=10.0,
            stalled_check_interval=5.0,
            isolate_suspects=False,
        ):
            for run_id in ids:
                await engine.result(run_id)
    # Nothing runs until the sweep at 15 s (the claims are then 15 s old, past 10 s) takes
    # them back: the two reclaimed jobs first (they keep their place), then the other two.
    assert [t for t, _ in meter.starts] == [15.0, 15.0, 16.0, 16.0]
    assert meter.peak == {"all": 2}
    stats = await broker.queue_stats(queue)
    assert (stats.claimed, stats.ready) == (0, 0)


async def test_a_failing_key_function_fails_its_step_not_the_engine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = dt.App("keys")

    def key_of(order: Any) -> Any:
        return order["account"]  # KeyError without one; an int is not a str

    @app.step("charge", max_concurrency=1, concurrency_key=key_of)
    async def charge(order: Any) -> str:
        return "ok"

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, order: Any) -> Any:
        return await ctx.step("charge", order)

    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend), open_engine(app, backend) as engine:
            missing = await engine.start("order", {})
            wrong = await engine.start("order", {"account": 7})
            good = await engine.start("order", {"account": "a"})
            assert await engine.result(good) == "ok"
            for run_id, said in ((missing, "raised KeyError"), (wrong, "must return a str")):
                with pytest.raises(dt.RunFailed):
                    await engine.result(run_id)
                assert await engine.status(run_id) is RunStatus.FAILED
                (step,) = await engine.history(run_id)
                assert step.error["code"] == "concurrency_key"
                assert step.error["retryable"] is False
                assert said in step.error["message"]
                assert "'charge'" in step.error["message"]


def test_app_step_checks_its_limit_and_key() -> None:
    app = dt.App("checks")
    for bad in (0, -2, 1.5, True, "3"):
        with pytest.raises(dt.ConfigError, match="max_concurrency"):
            app.step("s", max_concurrency=bad)  # type: ignore[arg-type]
    with pytest.raises(dt.ConfigError, match="needs max_concurrency"):
        app.step("s", concurrency_key=lambda i: "k")
    with pytest.raises(dt.ConfigError, match="must be a function"):
        app.step("s", max_concurrency=1, concurrency_key="account")  # type: ignore[arg-type]

    @app.step("ok", max_concurrency=2, concurrency_key=lambda i: i["k"])
    async def ok(i: Any) -> None: ...

    assert app.steps["ok"].max_concurrency == 2
    assert app.steps["ok"].key_for({"k": "x"}) == "x"


async def test_a_broker_without_limits_refuses_a_limited_step(
    autojump_clock: trio.testing.MockClock,
) -> None:
    meter = Meter()
    app = limited_app(meter, per_key=False, limit=2)
    backend = dt.Backend(url="test://", broker=CountingBroker(), keys=MemoryKeyStore())
    with pytest.raises(dt.ConfigError, match=r"'charge'.*CountingBroker broker cannot enforce"):
        async with open_worker(app, backend):
            pass  # pragma: no cover
    # Without a limit it serves as before (serving only a step with none).
    plain = dt.App("limits")

    @plain.step("free")
    async def free(i: Any) -> None: ...

    async with open_worker(plain, backend):
        pass


async def test_a_worker_stores_its_steps_limits_and_clears_a_removed_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = MemoryBroker()
    backend = dt.Backend(url="test://", broker=broker, keys=MemoryKeyStore())
    app = limited_app(Meter(), per_key=True, limit=4)
    async with open_worker(app, backend):
        stats = await broker.queue_stats("limits:tasks:charge")
        assert (stats.limit, stats.per_key) == (4, True)
    later = dt.App("limits")  # a new release: the step lost its limit

    @later.step("charge")
    async def charge(order: Any) -> None: ...

    async with open_worker(later, backend):
        stats = await broker.queue_stats("limits:tasks:charge")
        assert (stats.limit, stats.per_key) == (None, False)


class PopCounting(MemoryBroker):
    """Counts the claims asked for: a worker at the limit must wait, not poll."""

    pops = 0

    async def pop_many(self, queue: str, count: int, *, worker: str = "") -> Any:
        self.pops += 1
        return await super().pop_many(queue, count, worker=worker)

    async def pop_from(self, queue: str, *, worker: str = "") -> Any:
        self.pops += 1
        return await super().pop_from(queue, worker=worker)

    async def pop_ahead(self, queue: str, count: int, ahead: int, *, worker: str = "") -> Any:
        self.pops += 1
        return await super().pop_ahead(queue, count, ahead, worker=worker)


async def test_a_worker_at_the_limit_waits_for_a_freed_slot_without_polling(
    autojump_clock: trio.testing.MockClock,
) -> None:
    meter = Meter()
    app = limited_app(meter, per_key=False, limit=1)
    broker = PopCounting()
    backend = dt.Backend(url="test://", broker=broker, keys=MemoryKeyStore())
    async with (
        open_worker(app, backend, concurrency=4),
        open_worker(app, backend, concurrency=4),
        open_engine(app, backend) as engine,
    ):
        ids = [
            await engine.start("order", {"account": f"a{n}", "seconds": 100.0}) for n in range(3)
        ]
        for run_id in ids:
            await engine.result(run_id)
    assert [t for t, _ in meter.starts] == [0.0, 100.0, 200.0]
    # A few pops per freed slot (each of the two workers wakes), never one per poll interval
    # over the 300 s the queue sat at its limit.
    assert broker.pops <= 20, broker.pops


async def test_the_limits_are_visible_to_operators(
    autojump_clock: trio.testing.MockClock, capsys: pytest.CaptureFixture[str]
) -> None:
    """``queues`` (its JSON, and a ``limit`` column once a queue has one), the console's queue
    table and health's metrics show each step's limit; in use is ``claimed``, waiting ``ready``."""
    import argparse

    from durable_trio.cli._health import prometheus_text
    from durable_trio.cli._operations import _queues
    from durable_trio.console._fleet_view import render_queues

    broker = MemoryBroker()
    backend = dt.Backend(url="test://", broker=broker, keys=MemoryKeyStore())
    await broker.set_queue_limit("limits:tasks:charge", 1, per_key=True)
    await broker.set_queue_limit("limits:tasks:other", 2)
    for n in range(3):
        await broker.push_on("limits:tasks:charge", dt.brokers.Job(f"j{n}", b"{}", "k"))
    await broker.pop_many("limits:tasks:charge", 3)
    async with dt.open_operations(backend, namespace="limits") as ops:
        views = await ops.queues()
        charge = next(v for v in views if v.group == "charge")
        assert (charge.limit, charge.per_key, charge.claimed, charge.ready) == (1, True, 1, 2)
        assert charge.to_json()["limit"] == 1
        assert charge.to_json()["perKey"] is True
        await _queues(ops, argparse.Namespace(json=False))
    printed = capsys.readouterr().out
    assert "limit" in printed.splitlines()[0]
    assert "1 per key" in printed
    html = str(render_queues(views, None, allow_actions=False))
    assert "<th class=\"num\">limit</th>" in html
    assert "1 per key" in html
    metrics = prometheus_text([], namespace="limits", queues=views)
    assert 'durable_trio_queue_limit{queue="limits:tasks:charge"} 1' in metrics


async def test_a_key_function_failing_at_a_retry_fails_the_step(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = dt.App("flaky-key")
    calls: list[int] = []

    def key_of(order: Any) -> str:
        calls.append(1)
        if len(calls) > 1:
            raise ValueError("no key today")
        return "k"

    @app.step("charge", max_concurrency=1, concurrency_key=key_of, retry=dt.Retry(max_attempts=3))
    async def charge(order: Any) -> str:
        raise RuntimeError("try again")

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, order: Any) -> Any:
        return await ctx.step("charge", order)

    async with dt.open_backend("memory://") as backend:
        async with (
            open_worker(app, backend, on_error=Errors()),
            open_engine(app, backend) as engine,
        ):
            run_id = await engine.start("order", {})
            with pytest.raises(dt.RunFailed):
                await engine.result(run_id)
            (step,) = await engine.history(run_id)
    assert step.error["code"] == "concurrency_key"
    assert "no key today" in step.error["message"]
    assert step.attempt == 2
