"""Per-key rates (issue 33, item 3): ``dt.Rate(count, per, key=fn)`` through the engine and
workers, on the memory broker under a virtual clock: each key value starts at most ``count``
per window, keys independent (a busy key never delays another), a job past its key's rate
waits in the broker (handed back, not an attempt) and a key function that raises fails the
step, not retryable."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio import RunStatus, open_engine, open_worker
from helpers import Errors, two_workers_and_an_engine


def most_in_any_window(starts: list[float], per: float) -> int:
    return max((sum(1 for t in starts if s <= t < s + per) for s in starts), default=0)


def account(order: Any) -> str:
    return order["account"]  # type: ignore[no-any-return]


def keyed_app(starts: dict[str, list[float]], rate: dt.Rate, **step: Any) -> dt.App:
    app = dt.App("keyrates")

    @app.step("charge", rate_limit=rate, **step)
    async def charge(order: dict[str, Any]) -> int:
        starts.setdefault(order["account"], []).append(trio.current_time())
        await trio.sleep(0.25)
        return int(order["n"])

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, order: dict[str, Any]) -> int:
        return int(await ctx.step("charge", order))

    return app


async def test_each_key_starts_at_most_its_rate_and_keys_are_independent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Rate(2, per=1.0, key=account): 8 jobs of "a" queued first, then 2 of "b": "a" starts 2
    per second (0, 0, 1, 1, 2, 2, 3, 3), "b" starts both at 0, never behind "a"'s backlog;
    the jobs handed back are not attempts."""
    starts: dict[str, list[float]] = {}
    app = keyed_app(starts, dt.Rate(2, per=1.0, key=account))
    errors = Errors()
    async with dt.open_backend("memory://") as backend:
        async with two_workers_and_an_engine(app, backend, concurrency=4, errors=errors) as engine:
            a = [await engine.start("order", {"account": "a", "n": n}) for n in range(8)]
            b = [await engine.start("order", {"account": "b", "n": n}) for n in range(2)]
            assert [await engine.result(run_id) for run_id in a] == list(range(8))
            assert [await engine.result(run_id) for run_id in b] == list(range(2))
            for run_id in a:
                (step,) = await engine.history(run_id)
                assert step.attempt == 1
    assert sorted(starts["a"]) == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert starts["b"] == [0.0, 0.0]
    assert most_in_any_window(starts["a"], 1.0) == 2
    assert errors.seen == []


async def test_a_busy_key_holds_no_slot(autojump_clock: trio.testing.MockClock) -> None:
    """One slot, Rate(1, per=10.0, key=account): "a"'s jobs past its rate wait in the broker,
    so "b" and "c" start at once, not after "a"'s backlog."""
    starts: dict[str, list[float]] = {}
    app = keyed_app(starts, dt.Rate(1, per=10.0, key=account))
    errors = Errors()
    async with dt.open_backend("memory://") as backend:
        async with (
            open_worker(app, backend, concurrency=1, on_error=errors),
            open_engine(app, backend, on_error=errors) as engine,
        ):
            ids = [await engine.start("order", {"account": "a", "n": n}) for n in range(3)]
            await trio.sleep(0.5)
            ids += [await engine.start("order", {"account": k, "n": 9}) for k in "bc"]
            for run_id in ids:
                await engine.result(run_id)
    assert starts["a"] == [0.0, 10.0, 20.0]
    assert starts["b"][0] < 2.0
    assert starts["c"][0] < 2.0
    assert errors.seen == []


async def test_one_key_for_both_limit_and_rate(autojump_clock: trio.testing.MockClock) -> None:
    """The same function as concurrency_key and the rate's key: both hold per account."""
    starts: dict[str, list[float]] = {}
    app = keyed_app(
        starts,
        dt.Rate(2, per=1.0, key=account),
        max_concurrency=1,
        concurrency_key=account,
    )
    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend, concurrency=4), open_engine(app, backend) as engine:
            ids = [await engine.start("order", {"account": k, "n": 1}) for k in "aaab"]
            for run_id in ids:
                await engine.result(run_id)
    # One at a time per account (0.25 s each) and at most 2 per second: "a" at 0, 0.25, 1.
    assert starts["a"] == [0.0, 0.25, 1.0]
    assert starts["b"] == [0.0]


async def test_a_failing_rate_key_fails_its_step_not_retryable(
    autojump_clock: trio.testing.MockClock,
) -> None:
    starts: dict[str, list[float]] = {}
    app = keyed_app(starts, dt.Rate(1, per=1.0, key=account))
    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend), open_engine(app, backend) as engine:
            missing = await engine.start("order", {"n": 1})
            wrong = await engine.start("order", {"account": 7, "n": 1})
            good = await engine.start("order", {"account": "a", "n": 1})
            assert await engine.result(good) == 1
            for run_id, said in ((missing, "raised KeyError"), (wrong, "must return a str")):
                with pytest.raises(dt.RunFailed):
                    await engine.result(run_id)
                assert await engine.status(run_id) is RunStatus.FAILED
                (step,) = await engine.history(run_id)
                assert step.error["code"] == "concurrency_key"
                assert step.error["retryable"] is False
                assert said in step.error["message"]
                assert "rate key" in step.error["message"]
    assert starts == {"a": [0.0]}


def test_app_step_takes_a_keyed_rate() -> None:
    app = dt.App("a")
    app.step("x", rate_limit=dt.Rate(3, per=2.0, key=account))(lambda o: o)
    assert app.steps["x"].rate_per_key
    assert app.steps["x"].key_for({"account": "z"}) == "z"
    app.step("y", rate_limit=dt.Rate(3))(lambda o: o)
    assert not app.steps["y"].rate_per_key
    assert app.steps["y"].key_for({"account": "z"}) is None


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_a_per_key_rate_holds_across_workers_on_a_real_broker(
    kind: str, tmp_path: Any, request: pytest.FixtureRequest
) -> None:
    """On the real clock, SQLite and Redis (a broker that claims ahead: the handback of a
    claim marked started), two workers: no window of ``per`` (less a margin for the time from
    a grant to its handler's start) holds more than the rate of one key; the other key starts
    at once; no attempt is spent on a handback."""
    url = (
        f"sqlite:///{tmp_path}/keyrates.db"
        if kind == "sqlite"
        else request.getfixturevalue("redis_url")
    )
    starts: dict[str, list[float]] = {}
    app = keyed_app(starts, dt.Rate(2, per=0.4, key=account))
    errors = Errors()
    async with dt.open_backend(url) as backend:
        async with two_workers_and_an_engine(app, backend, concurrency=4, errors=errors) as engine:
            t0 = trio.current_time()
            a = [await engine.start("order", {"account": "a", "n": n}) for n in range(6)]
            b = await engine.start("order", {"account": "b", "n": 9})
            with trio.fail_after(15):
                assert [await engine.result(run_id) for run_id in a] == list(range(6))
                assert await engine.result(b) == 9
            for run_id in a:
                (step,) = await engine.history(run_id)
                assert step.attempt == 1
    assert len(starts["a"]) == 6
    assert most_in_any_window(starts["a"], 0.4 - 0.05) <= 2
    assert max(starts["a"]) - min(starts["a"]) >= 2 * 0.4 - 0.05  # (three windows: 2, 2, 2)
    assert starts["b"][0] - t0 < 0.4
    assert errors.seen == []
