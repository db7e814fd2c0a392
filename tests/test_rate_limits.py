"""Rate limits (issue 33, item 3) through the engine and workers, on the memory broker under a
virtual clock: exact start times across workers, no slot held while a step waits on its rate,
the visibility of the current window, and the refusals."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio import open_engine, open_worker
from durable_trio.brokers.memory import MemoryBroker
from durable_trio.keys.memory import MemoryKeyStore
from helpers import CountingBroker, Errors, two_workers_and_an_engine

if TYPE_CHECKING:
    from pathlib import Path


def most_in_any_window(starts: list[float], per: float) -> int:
    """The most starts in any window ``[s, s + per)`` (a window's worst start is one of them)."""
    return max((sum(1 for t in starts if s <= t < s + per) for s in starts), default=0)


def rated_app(starts: list[float], rate: dt.Rate, *, seconds: float = 0.0) -> dt.App:
    app = dt.App("rates")

    @app.step("call-api", rate_limit=rate)
    async def call_api(n: int) -> int:
        starts.append(trio.current_time())
        await trio.sleep(seconds)
        return n

    @app.step("other")
    async def other(n: int) -> int:
        starts.append(-1000.0 - trio.current_time())  # (told apart: negative)
        await trio.sleep(1.0)
        return n

    @app.workflow("one")
    async def one(ctx: dt.WorkflowContext, n: int) -> int:
        return int(await ctx.step("call-api", n))

    @app.workflow("two")
    async def two(ctx: dt.WorkflowContext, n: int) -> int:
        return int(await ctx.step("other", n))

    return app


async def test_no_window_starts_more_than_the_rate_across_workers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    starts: list[float] = []
    app = rated_app(starts, dt.Rate(2, per=1.0), seconds=0.25)
    errors = Errors()
    async with dt.open_backend("memory://") as backend:
        async with two_workers_and_an_engine(app, backend, concurrency=8, errors=errors) as engine:
            ids = [await engine.start("one", n) for n in range(10)]
            assert [await engine.result(run_id) for run_id in ids] == list(range(10))
            async with dt.open_operations(backend, namespace="rates") as ops:
                (view,) = [v for v in await ops.queues() if v.group == "call-api"]
    assert starts == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0]
    assert most_in_any_window(starts, 1.0) == 2
    # Read at 4.25: the window [3.25, 4.25] holds the two starts of 4.
    assert (view.rate, view.rate_per, view.window) == (2, 1.0, 2)
    assert view.rate_text == "2/2 per 1s"
    assert view.to_json()["rate"] == 2
    assert errors.seen == []


async def test_a_step_waiting_on_its_rate_holds_no_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    starts: list[float] = []
    app = rated_app(starts, dt.Rate(1, per=10.0))
    errors = Errors()
    async with dt.open_backend("memory://") as backend:
        async with (
            open_worker(app, backend, concurrency=1, on_error=errors),
            open_engine(app, backend, on_error=errors) as engine,
        ):
            rated = [await engine.start("one", n) for n in range(3)]
            await trio.sleep(0.5)  # the first rated attempt ran; two wait on the rate
            others = [await engine.start("two", n) for n in range(2)]
            for run_id in rated + others:
                await engine.result(run_id)
            stats = await backend.broker.queue_stats("rates:tasks:call-api")  # type: ignore[attr-defined]
    # The rated step starts at 0, 10 and 20; the worker's one slot is free meanwhile: the
    # other step's attempts (1 s each) run at 0.5 and 1.5, not after 20.
    assert sorted(t for t in starts if t >= 0) == [0.0, 10.0, 20.0]
    assert sorted(-1000.0 - t for t in starts if t < 0) == [0.5, 1.5]
    assert (stats.rate, stats.window, stats.ready, stats.claimed) == (1, 1, 0, 0)
    assert errors.seen == []


def test_app_step_checks_its_rate() -> None:
    app = dt.App("a")
    for bad in (0, 2.5, True, 10**9):
        with pytest.raises(dt.ConfigError, match="count"):
            dt.Rate(bad)  # type: ignore[arg-type]
    for per in (0, -1, float("inf"), float("nan"), 10**9, "1"):
        with pytest.raises(dt.ConfigError, match="per"):
            dt.Rate(1, per=per)  # type: ignore[arg-type]
    with pytest.raises(dt.ConfigError, match=r"must be a dt\.Rate"):
        app.step("x", rate_limit=(2, 1.0))  # type: ignore[arg-type]
    with pytest.raises(dt.ConfigError, match=r"key must be a function"):
        app.step("x", rate_limit=dt.Rate(2, per=1.0, key="account"))  # type: ignore[arg-type]
    with pytest.raises(dt.ConfigError, match=r"rate_limit's key and concurrency_key differ"):
        app.step(
            "x",
            max_concurrency=1,
            concurrency_key=lambda v: v,
            rate_limit=dt.Rate(2, per=1.0, key=lambda v: v),
        )
    assert "x" not in app.steps
    app.step("y", rate_limit=dt.Rate(100, per=1.0))(lambda n: n)
    assert app.steps["y"].rate_limit == dt.Rate(100, per=1.0)


async def test_a_broker_without_rates_refuses_a_rated_step(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = rated_app([], dt.Rate(2))
    backend = dt.Backend(url="test://", broker=CountingBroker(), keys=MemoryKeyStore())
    with pytest.raises(dt.ConfigError, match=r"'call-api'.*CountingBroker broker cannot keep"):
        async with open_worker(app, backend):
            pass


async def test_a_worker_stores_its_steps_rates_and_clears_a_removed_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = MemoryBroker()
    backend = dt.Backend(url="test://", broker=broker, keys=MemoryKeyStore())
    async with open_worker(rated_app([], dt.Rate(5, per=2.0)), backend):
        stats = await broker.queue_stats("rates:tasks:call-api")
        assert (stats.rate, stats.rate_per) == (5, 2.0)
    plain = dt.App("rates")
    plain.step("call-api")(lambda n: n)
    async with open_worker(plain, backend):
        stats = await broker.queue_stats("rates:tasks:call-api")
        assert (stats.rate, stats.rate_per) == (None, None)


def test_most_in_any_window_counts_a_window_s_starts() -> None:
    assert most_in_any_window([0.0, 0.5, 0.99, 1.0], 1.0) == 3


async def test_the_rates_are_visible_to_operators(
    autojump_clock: trio.testing.MockClock, capsys: pytest.CaptureFixture[str]
) -> None:
    """``queues`` (its JSON, and a ``rate (window)`` column once a queue has one), the
    console's queue table and health's metrics show each rate and its current window."""
    import argparse

    from durable_trio.cli._health import prometheus_text
    from durable_trio.cli._operations import _queues
    from durable_trio.console._fleet_view import render_queues

    broker = MemoryBroker()
    backend = dt.Backend(url="test://", broker=broker, keys=MemoryKeyStore())
    await broker.set_queue_rate("rates:tasks:api", 5, 2.0)
    await broker.push_on("rates:tasks:api", dt.brokers.Job("j", b"{}"))
    await broker.push_on("rates:tasks:other", dt.brokers.Job("k", b"{}"))
    assert (await broker.take_starts("rates:tasks:api", 3)).granted == 3
    await trio.sleep(1.5)
    assert (await broker.take_starts("rates:tasks:api", 1)).granted == 1
    await trio.sleep(1.0)  # now 2.5: the three starts of 0 left the window
    async with dt.open_operations(backend, namespace="rates") as ops:
        views = await ops.queues()
        api = next(v for v in views if v.group == "api")
        other = next(v for v in views if v.group == "other")
        assert (api.rate, api.rate_per, api.window) == (5, 2.0, 1)
        assert (api.to_json()["rate"], api.to_json()["ratePer"]) == (5, 2.0)
        assert api.to_json()["rateWindow"] == 1
        assert (other.rate, other.rate_text) == (None, "—")
        await _queues(ops, argparse.Namespace(json=False))
    printed = capsys.readouterr().out
    assert "rate (window)" in printed.splitlines()[0]
    assert "1/5 per 2s" in printed
    html = str(render_queues(views, None, allow_actions=False))
    assert '<th class="num">rate (window)</th>' in html
    assert "1/5 per 2s" in html
    metrics = prometheus_text([], namespace="rates", queues=views)
    assert 'durable_trio_queue_rate{queue="rates:tasks:api"} 5' in metrics
    assert 'durable_trio_queue_rate_per_seconds{queue="rates:tasks:api"} 2' in metrics
    assert 'durable_trio_queue_rate_window_starts{queue="rates:tasks:api"} 1' in metrics
    assert "rates:tasks:other" not in "".join(
        line for line in metrics.splitlines() if "queue_rate" in line
    )


async def test_a_rate_holds_across_workers_on_sqlite(tmp_path: Path) -> None:
    """On the real clock, through the SQLite broker (the brokers' own clocks are covered by
    tests/test_broker_rates.py): no window of ``per`` seconds, less a margin for the time from
    a grant to its handler's start, holds more starts than the rate."""
    starts: list[float] = []
    app = rated_app(starts, dt.Rate(2, per=0.4))
    errors = Errors()
    async with dt.open_backend(f"sqlite:///{tmp_path}/rates.db") as backend:
        async with two_workers_and_an_engine(app, backend, concurrency=4, errors=errors) as engine:
            ids = [await engine.start("one", n) for n in range(6)]
            with trio.fail_after(10):
                assert [await engine.result(run_id) for run_id in ids] == list(range(6))
    assert len(starts) == 6
    assert most_in_any_window(starts, 0.4 - 0.05) <= 2
    assert max(starts) - min(starts) >= 2 * 0.4 - 0.05  # (three windows' worth: 2, 2, 2)
    assert errors.seen == []


async def test_a_rate_given_after_the_queue_s_loop_started_applies_to_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A loop already consuming the queue (a handler registered before, or a workflow turn of
    the same routing token) takes starts from its next claim on."""
    broker = MemoryBroker()
    backend = dt.Backend(url="test://", broker=broker, keys=MemoryKeyStore())

    async def handler(task: Any) -> None:
        await trio.lowlevel.checkpoint()

    async with dt.open_queue_transport(backend, namespace="rates") as transport:
        transport.handle("api", handler)
        (loop,) = transport._consumers.loops_of("rates:tasks:api")
        assert loop.rate is None
        transport.handle("api", handler, rate=broker)
        assert loop.rate is broker


async def test_a_per_key_window_is_visible_and_health_shows_flow_control(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A worker stores a per-key rate as per key; ``queues``, the console and health (its
    text, JSON and metrics) show the busiest key's window and the keys with an open one, and
    health shows each limited step's limit, slots in use and jobs waiting."""
    from durable_trio.cli._health import health_json, prometheus_text, render_text
    from durable_trio.console._fleet_view import render_queues

    broker = MemoryBroker()
    backend = dt.Backend(url="test://", broker=broker, keys=MemoryKeyStore())
    app = dt.App("rates")

    @app.step("charge", rate_limit=dt.Rate(2, per=1.0, key=lambda order: order["account"]))
    async def charge(order: dict[str, str]) -> str:
        return order["account"]

    @app.step("slow", max_concurrency=1)
    async def slow(n: int) -> int:
        await trio.sleep(10)
        return n

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, order: dict[str, str]) -> str:
        return str(await ctx.step("charge", order))

    @app.workflow("crawl")
    async def crawl(ctx: dt.WorkflowContext, n: int) -> int:
        return int(await ctx.step("slow", n))

    async with open_worker(app, backend, concurrency=4), open_engine(app, backend) as engine:
        ids = [await engine.start("order", {"account": a}) for a in ("a", "a", "a", "b")]
        for n in range(3):
            await engine.start("crawl", n)
        await trio.sleep_until(0.5)  # "a": 2 starts at 0 (its third waits), "b": 1
        assert len(ids) == 4
        async with dt.open_operations(backend, namespace="rates") as ops:
            views = await ops.queues()
        health = render_text([], "rates", queues=views)
        found = health_json([], "rates", queues=views)
    charge_view = next(v for v in views if v.group == "charge")
    assert (charge_view.rate_per_key, charge_view.window, charge_view.window_keys) == (
        True, 2, 2,
    )  # fmt: skip
    assert charge_view.rate_text == "2/2 per 1s per key, 2 keys"
    assert charge_view.to_json()["ratePerKey"] is True
    assert charge_view.to_json()["rateWindowKeys"] == 2
    assert "2/2 per 1s per key, 2 keys" in str(render_queues(views, None, allow_actions=False))
    lines = health.splitlines()
    assert "flow control" in lines
    header = lines[lines.index("flow control") + 1].split()
    assert header[:4] == ["queue", "limit", "in", "use"]
    slow_row = next(line for line in lines if line.startswith("rates:tasks:slow"))
    assert slow_row.split() == ["rates:tasks:slow", "1", "1", "2", "—"]  # 1 in use, 2 waiting
    charge_row = next(line for line in lines if line.startswith("rates:tasks:charge"))
    assert "2/2 per 1s per key, 2 keys" in charge_row
    flow = {q["group"]: q for q in found["flowControl"]}
    assert (flow["slow"]["limit"], flow["slow"]["claimed"], flow["slow"]["ready"]) == (1, 1, 2)
    assert flow["charge"]["rateWindowKeys"] == 2
    metrics = prometheus_text([], namespace="rates", queues=views)
    assert 'durable_trio_queue_rate_window_keys{queue="rates:tasks:charge"} 2' in metrics
