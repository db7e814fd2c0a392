"""``close_on_signals`` in one process, under a virtual clock (memory backend): the first signal
ends the body and starts the graceful close, the second cancels everything inside at once."""

from __future__ import annotations

import signal
from typing import Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio._engine import App, RunStatus, WorkflowContext, open_engine, open_worker


def at(seconds: float, signum: int = signal.SIGTERM) -> Any:
    """A task that sends this process ``signum`` at virtual time ``seconds``."""

    async def send() -> None:
        await trio.sleep_until(seconds)
        signal.raise_signal(signum)

    return send


async def dispatch_and_collect(
    backend: dt.Backend, nursery: trio.Nursery, seconds: float
) -> tuple[list[tuple[float, dt.StepResult]], str]:
    """Dispatch one "work" step of ``seconds`` from an engine-side transport (in ``nursery``,
    so it outlives the worker); the results (with their arrival times) and the task queue."""
    results: list[tuple[float, dt.StepResult]] = []
    queue: list[str] = []
    ready = trio.Event()

    async def engine_side() -> None:
        async with dt.open_queue_transport(backend, namespace="sig") as transport:

            async def on_result(result: dt.StepResult) -> None:
                results.append((trio.current_time(), result))

            transport.on_result(on_result)
            await transport.dispatch(
                dt.RemoteTask(run_id="r", step_id="s", attempt=1, name="work", input=seconds)
            )
            queue.append(transport.names.task_queue("work"))
            ready.set()
            await trio.sleep_forever()

    nursery.start_soon(engine_side)
    await ready.wait()
    return results, queue[0]


def work_app() -> tuple[App, list[tuple[str, float]]]:
    app = App("sig")
    log: list[tuple[str, float]] = []

    @app.step("work")
    async def work(seconds: float) -> float:
        log.append(("start", trio.current_time()))
        try:
            await trio.sleep(seconds)
        except trio.Cancelled:
            log.append(("cancelled", trio.current_time()))
            raise
        log.append(("end", trio.current_time()))
        return trio.current_time()

    return app, log


async def test_the_first_signal_lets_a_running_step_finish_within_close_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, log = work_app()
    async with dt.open_backend("memory://") as backend, trio.open_nursery() as nursery:
        results, _ = await dispatch_and_collect(backend, nursery, 2.0)
        nursery.start_soon(at(1.0))
        async with dt.close_on_signals(announce=lambda _: None) as stop:
            async with open_worker(app, backend, close_timeout=5.0):
                await stop.wait()
                assert trio.current_time() == 1.0
        # the close waited for the step (done at 2 s), not for close_timeout
        assert trio.current_time() == 2.0
        assert (stop.received, stop.forced, stop.exit_status) == ([signal.SIGTERM], False, 0)
        await trio.testing.wait_all_tasks_blocked()
        assert [(t, r.output) for t, r in results] == [(2.0, 2.0)]
        assert log == [("start", 0.0), ("end", 2.0)]
        nursery.cancel_scope.cancel()


async def test_a_second_signal_cancels_the_running_step_at_once_and_hands_it_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, log = work_app()
    async with dt.open_backend("memory://") as backend, trio.open_nursery() as nursery:
        _, queue = await dispatch_and_collect(backend, nursery, 60.0)
        nursery.start_soon(at(1.0))
        nursery.start_soon(at(1.5, signal.SIGINT))
        async with dt.close_on_signals(announce=lambda _: None) as stop:
            async with open_worker(app, backend, close_timeout=5.0):
                await stop.wait()
        assert trio.current_time() == 1.5  # not 1 + close_timeout
        assert (stop.received, stop.forced) == ([signal.SIGTERM, signal.SIGINT], True)
        assert stop.exit_status == 130
        assert log == [("start", 0.0), ("cancelled", 1.5)]
        # handed back attempt-neutrally: the next worker gets it at once, nothing counted
        claimed = await backend.broker.pop_from(queue)
        assert claimed is not None
        assert (claimed.attempts, claimed.stalled_count) == (0, 0)
        nursery.cancel_scope.cancel()


async def test_body_scopes_are_cancelled_by_the_first_signal_and_errors_leave_bare(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(at(3.0, signal.SIGINT))
        async with dt.close_on_signals(announce=lambda _: None) as stop:
            with stop.body() as body:
                await trio.sleep(10)
            assert body.cancelled_caught
            assert trio.current_time() == 3.0
            assert stop.body().cancel_called  # after the signal: cancelled from the start
            assert stop.signum == signal.SIGINT
    with pytest.raises(ValueError, match="boom"):
        async with dt.close_on_signals():
            raise ValueError("boom")
    # an outer cancel is not swallowed by the block
    with trio.move_on_after(1) as outer:
        async with dt.close_on_signals():
            await trio.sleep_forever()
    assert outer.cancelled_caught


async def test_a_signalled_engine_releases_its_runs_for_another_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = App("sig")

    @app.workflow("nap")
    async def nap(ctx: WorkflowContext, _: Any) -> float:
        await ctx.sleep(60)
        return trio.current_time()

    async with dt.open_backend("memory://") as backend, trio.open_nursery() as nursery:
        nursery.start_soon(at(2.0, signal.SIGINT))
        async with dt.close_on_signals(announce=lambda _: None) as stop:
            async with open_engine(app, backend, engine_id="first") as first:
                await first.start("nap", run_id="n")
                await stop.wait()
        assert trio.current_time() == 2.0
        record = await first.get("n")
        assert (record.status, record.owner) == (RunStatus.PENDING, None)
        async with open_engine(app, backend, engine_id="second") as second:
            assert second.statistics().runs_resumed == 1
            assert await second.result("n") == 60.0
