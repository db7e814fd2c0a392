"""Issue 3, faults: the Redis server is killed in the middle of a run and started again.

Every loop reports, backs off, reconnects and carries on; no loop dies; nothing acknowledged is
lost (appendonly with fsync on every write, so an acknowledged write survives SIGKILL).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import trio

import durable_trio as dt
from _redis_server import *  # noqa: F403
from durable_trio._redis import open_redis
from helpers import Errors

if TYPE_CHECKING:
    from _redis_server import RedisServer

TASKS = 300


@pytest.mark.chaos
async def test_redis_killed_mid_run_and_restarted_loses_nothing_acknowledged(
    redis_url: str, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    async with open_redis(redis_url) as admin:
        await admin.execute("CONFIG", "SET", "appendfsync", "always")
    errors = Errors()
    acknowledged: list[str] = []
    refused = 0
    results: dict[str, dt.StepResult] = {}
    all_in = trio.Event()
    dispatched_all = trio.Event()
    after_done = trio.Event()
    try:
        async with dt.open_backend(redis_url) as backend:
            async with (
                dt.open_queue_transport(
                    backend,
                    namespace="faults",
                    on_error=errors,
                    result_concurrency=16,
                    poll_interval=0.05,
                    # A pop whose reply the kill cut off ran on the server all the same (the
                    # AOF keeps it): that claim comes back through this side's own sweep,
                    # after its threshold, like the worker's.
                    stalled_threshold=2.0,
                    stalled_check_interval=0.5,
                ) as engine,
                dt.open_queue_transport(
                    backend,
                    namespace="faults",
                    on_error=errors,
                    concurrency=16,
                    stalled_threshold=2.0,
                    stalled_check_interval=0.5,
                    poll_interval=0.05,
                ) as worker,
            ):

                async def work(task: dt.RemoteTask) -> str:
                    await trio.sleep(0.01)
                    return task.step_id

                async def on_result(result: dt.StepResult) -> None:
                    results.setdefault(result.step_id, result)
                    if result.step_id == "after":
                        after_done.set()
                    if dispatched_all.is_set() and set(acknowledged) <= set(results):
                        all_in.set()

                worker.handle("work", work)
                engine.on_result(on_result)

                outage_over = trio.Event()

                async def outage() -> None:
                    redis_server.stop(kill=True)
                    await trio.sleep(1.0)
                    await trio.to_thread.run_sync(redis_server.start)
                    outage_over.set()

                async def dispatch_all() -> None:
                    nonlocal refused
                    for n in range(TASKS):
                        if n == TASKS // 3:
                            nursery.start_soon(outage)
                        task = dt.RemoteTask(run_id="r", step_id=f"s{n}", attempt=1, name="work")
                        try:
                            await engine.dispatch(task)
                        except dt.BrokerError:
                            refused += 1  # never acknowledged: the caller knows it failed
                            await trio.sleep(0.05)  # and backs off, as a producer would
                            continue
                        acknowledged.append(task.step_id)
                        await trio.sleep(0.005)
                    await outage_over.wait()
                    dispatched_all.set()
                    if set(acknowledged) <= set(results):
                        all_in.set()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(dispatch_all)
                    with trio.fail_after(60):
                        await all_in.wait()
                # the loops are alive: a task dispatched now still comes back
                results.clear()
                await engine.dispatch(
                    dt.RemoteTask(run_id="r", step_id="after", attempt=1, name="work")
                )
                with trio.fail_after(10):
                    await after_done.wait()
    finally:
        async with open_redis(redis_url) as admin:
            await admin.execute("CONFIG", "SET", "appendfsync", "everysec")
    assert len(acknowledged) >= TASKS // 2
    assert refused > 0, "some dispatches met the outage"
    assert any(isinstance(e, dt.BrokerError) for e in errors.seen), "the outage was reported"
    with capsys.disabled():
        print(
            f"\n[redis fault] dispatched {TASKS}, acknowledged {len(acknowledged)}, refused during "
            f"the outage {refused}, lost 0, errors reported {len(errors.seen)}"
        )
