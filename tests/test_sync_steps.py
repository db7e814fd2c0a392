"""Plain ``def`` steps (run in threads under ``open_worker(threads=...)``) and ``cpu=True``
steps (run in a ``trio-parallel`` worker process), through a real worker and engine on the
in-memory backend.

Virtual time, frozen (``autojump_threshold = inf``): a thread works in real time, and an
autojumping clock would leap over timers while the event loop waits for it. Frozen, the clock
moves only when a test jumps it, so ``trio.current_time()`` is exact; the tests wait for the
threads with a real-time poll that does not touch it (:func:`until`). The process-pool test
runs on the wall clock.
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from _supervised_app import app as supervised
from durable_trio import App, Retry, RunFailed, WorkflowContext, open_engine, open_worker

if TYPE_CHECKING:
    from collections.abc import Callable


@pytest.fixture
def clock(autojump_clock: trio.testing.MockClock) -> trio.testing.MockClock:
    autojump_clock.autojump_threshold = math.inf
    return autojump_clock


async def until(predicate: Callable[[], object]) -> None:
    """Poll ``predicate`` in real time (threads work in real time), the virtual clock frozen."""
    for _ in range(2000):  # 10 s of real time at most (a frozen clock never times out)
        if predicate():
            return
        await trio.to_thread.run_sync(time.sleep, 0.005)
    raise AssertionError("not within 10 s")


def sync_app(gate: threading.Event | None = None) -> tuple[App, dict[str, Any]]:
    app = App("sync")
    seen: dict[str, Any] = {"running": 0, "most": 0, "threads": set(), "ended": 0}
    lock = threading.Lock()

    @app.step("blocking")
    def blocking(value: int) -> dict[str, Any]:
        with lock:
            seen["running"] += 1
            seen["most"] = max(seen["most"], seen["running"])
            seen["threads"].add(threading.get_ident())
        try:
            if gate is not None:
                gate.wait(30)
            return {"value": value * 2, "step": dt.step_info().step_id}
        finally:
            with lock:
                seen["running"] -= 1
                seen["ended"] += 1

    @app.step("refuse", retry=Retry(non_retryable=(ValueError,)))
    def refuse(value: int) -> None:
        raise ValueError(f"no {value}")

    @app.workflow("fan")
    async def fan(ctx: WorkflowContext, count: int) -> list[Any]:
        return await ctx.gather(*[ctx.step("blocking", n) for n in range(count)])

    @app.workflow("refused")
    async def refused(ctx: WorkflowContext, value: int) -> None:
        await ctx.step("refuse", value)

    return app, seen


async def test_a_def_step_runs_in_a_thread_and_sees_its_step_info(
    clock: trio.testing.MockClock,
) -> None:
    app, seen = sync_app()
    async with (
        dt.open_backend("memory://") as backend,
        open_worker(app, backend),
        open_engine(app, backend) as engine,
    ):
        assert await engine.result(await engine.start("fan", 3)) == [
            {"value": 0, "step": "1"},
            {"value": 2, "step": "2"},
            {"value": 4, "step": "3"},
        ]
    assert trio.current_time() == 0.0
    assert threading.get_ident() not in seen["threads"]


async def test_threads_bounds_the_def_steps_running_at_once(
    clock: trio.testing.MockClock,
) -> None:
    gate = threading.Event()
    app, seen = sync_app(gate)
    async with (
        dt.open_backend("memory://") as backend,
        open_worker(app, backend, concurrency=8, threads=2) as worker,
        open_engine(app, backend) as engine,
    ):
        run_id = await engine.start("fan", 5)
        # the two threads are blocked in the gate (both inside the step: a token borrowed is
        # not yet a thread in the function): nothing for the clock to wait on but a poll
        await until(
            lambda: worker.threads.statistics().tasks_waiting == 3 and seen["running"] == 2
        )
        assert worker.threads.borrowed_tokens == 2
        gate.set()
        assert [r["value"] for r in await engine.result(run_id)] == [0, 2, 4, 6, 8]
    assert seen["most"] == 2


async def test_a_def_step_failure_is_classified_as_an_async_one(
    clock: trio.testing.MockClock,
) -> None:
    app, _ = sync_app()
    async with (
        dt.open_backend("memory://") as backend,
        open_worker(app, backend),
        open_engine(app, backend) as engine,
    ):
        with pytest.raises(RunFailed) as failed:
            await engine.result(await engine.start("refused", 7))
    assert failed.value.error["attempts"] == 1  # non-retryable, as for an async step
    assert failed.value.error["error"]["code"] == "ValueError"
    assert "no 7" in failed.value.error["error"]["message"]
    assert trio.current_time() == 0.0  # non-retryable: no backoff waited


async def test_a_cancelled_def_step_is_abandoned_at_once_and_its_thread_ends_on_its_own(
    clock: trio.testing.MockClock,
) -> None:
    gate = threading.Event()
    app, seen = sync_app(gate)
    async with (
        dt.open_backend("memory://") as backend,
        open_worker(app, backend) as worker,
        open_engine(app, backend) as engine,
    ):
        run_id = await engine.start("fan", 1)
        await until(lambda: seen["running"] == 1)
        clock.jump(1.0)
        await engine.cancel(run_id)
        await until(lambda: worker.statistics().cancelled == 1)
        # the handler is done at once, the thread is not (a thread cannot be cancelled)
        assert trio.current_time() == 1.0
        assert (worker.statistics().running, seen["running"]) == (0, 1)
        # the abandoned thread keeps its token: ``threads`` bounds the threads really running
        assert worker.threads.borrowed_tokens == 1
        assert await engine.status(run_id) is dt.RunStatus.CANCELLED
        gate.set()
        await until(lambda: seen["ended"] == 1)  # the abandoned thread ends on its own
        await until(lambda: worker.threads.borrowed_tokens == 0)


def test_step_registration_checks_what_it_is_given() -> None:
    app = App("checks")
    with pytest.raises(dt.ConfigError, match="cpu=True runs a plain `def`"):

        @app.step("a", cpu=True)
        async def a(_: Any) -> None: ...

    with pytest.raises(dt.ConfigError, match="an `async def` or a plain `def`"):

        @app.step("g")
        def g(_: Any) -> Any:
            yield 1

    @app.step("plain")
    def plain(_: Any) -> None: ...

    assert (app.steps["plain"].runs_in, supervised.steps["crunch"].runs_in) == (
        "thread",
        "process",
    )


async def test_threads_must_be_positive() -> None:
    async with dt.open_backend("memory://") as backend:
        for bad in (0, -1, 1.5, True):
            with pytest.raises(dt.ConfigError, match="threads"):
                async with open_worker(App("x"), backend, threads=bad):  # type: ignore[arg-type]
                    pass


@pytest.mark.chaos
async def test_a_cpu_step_runs_in_another_process() -> None:
    app = App(supervised.name)
    app.step("crunch", cpu=True)(supervised.steps["crunch"].fn)

    @app.workflow("crunch-twice")
    async def twice(ctx: WorkflowContext, n: int) -> list[Any]:
        return [await ctx.step("crunch", n), await ctx.step("crunch", n + 1)]

    with trio.fail_after(60):
        async with (
            dt.open_backend("memory://") as backend,
            open_worker(app, backend) as worker,
            open_engine(app, backend) as engine,
        ):
            first, second = await engine.result(await engine.start("crunch-twice", 1000))
            assert worker.cpu_processes.total_tokens == (os.cpu_count() or 1)
    assert first["sum"] == sum(i * i for i in range(1000))
    assert second["sum"] == sum(i * i for i in range(1001))
    assert os.getpid() not in (first["pid"], second["pid"])
