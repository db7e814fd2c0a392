"""Issue 36, item 1: a Redis out of memory (``maxmemory`` reached, ``noeviction``) refuses a
worker's result push; the acknowledgement of its task must be refused with it (both or neither),
the refusal reported as what it is, and the work must resume once memory is back.

The private server is made "full" with ``CONFIG SET maxmemory 1`` (any used memory is over it:
every write is refused, reads and deletes are not, as at a real ``maxmemory``), and freed with
``CONFIG SET maxmemory 0``. The real clock throughout, with short thresholds.
"""

from __future__ import annotations

from contextlib import contextmanager
from itertools import count
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from _redis_server import *  # noqa: F403
from durable_trio import App, WorkflowContext, open_engine, open_worker
from durable_trio._redis import RedisOutOfMemory, key_slot, open_redis, open_redis_cluster
from durable_trio.brokers import Job
from durable_trio.brokers.redis import RedisBroker, RedisClusterBroker
from helpers import Errors

if TYPE_CHECKING:
    from collections.abc import Iterator

    from _redis_cluster import RedisCluster
    from _redis_server import RedisServer

_names = count()


@contextmanager
def full(*servers: RedisServer) -> Iterator[None]:
    """Every one of ``servers`` at ``maxmemory`` (noeviction) inside the block; freed after."""
    try:
        for server in servers:
            server.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
            server.command("CONFIG", "SET", "maxmemory", "1")
        yield
    finally:
        for server in servers:
            server.command("CONFIG", "SET", "maxmemory", "0")


def free(*servers: RedisServer) -> None:
    for server in servers:
        server.command("CONFIG", "SET", "maxmemory", "0")


async def census(client: Any, queue: str) -> dict[str, int]:
    """The jobs of ``queue``: waiting (ready) and claimed (active)."""
    ready = await client.execute("ZCARD", f"{{{queue}}}:ready")
    active = await client.execute("ZCARD", f"{{{queue}}}:active")
    return {"ready": int(ready), "active": int(active)}


async def test_a_refused_result_push_leaves_its_task_claimed(
    redis_url: str, redis_server: RedisServer
) -> None:
    """Single server: the push and the complete are one script, refused whole."""
    async with open_redis(redis_url) as client, RedisBroker(client) as broker:
        await broker.push_on("tasks", Job("t1", b"task 1"))
        await broker.push_on("tasks", Job("t2", b"task 2"))
        first, second = await broker.pop_many("tasks", 2)
        with full(redis_server):
            with pytest.raises(RedisOutOfMemory) as refused:
                await broker.push_and_complete_many(
                    "results", [Job("r1", b"result 1")], "tasks", [first.lease]
                )
            with pytest.raises(RedisOutOfMemory):
                await broker.finish_and_claim(
                    "results", [Job("r2", b"result 2")], "tasks", [second.lease], 1
                )
            # Nothing acknowledged, nothing pushed: both tasks are still claimed.
            assert await census(client, "tasks") == {"ready": 0, "active": 2}
            assert await census(client, "results") == {"ready": 0, "active": 0}
        # Reported as what it is, not as a broken connection (and transient: tried again).
        assert isinstance(refused.value, dt.BrokerUnavailable)
        assert "out of memory" in str(refused.value)
        assert "maxmemory" in str(refused.value)
        # Memory back: the same finalizes land, each result with its acknowledgement.
        assert await broker.push_and_complete_many(
            "results", [Job("r1", b"result 1")], "tasks", [first.lease]
        ) == [True]
        done, _ = await broker.finish_and_claim(
            "results", [Job("r2", b"result 2")], "tasks", [second.lease], 1
        )
        assert done == [True]
        assert await census(client, "tasks") == {"ready": 0, "active": 0}
        got = await broker.pop_many("results", 10)
        assert sorted(job.data for job in got) == [b"result 1", b"result 2"]


def _queue_on_other_master(cluster: RedisCluster, than: str) -> str:
    """A queue name whose slot's master is not the one of ``than``."""
    owner = cluster.owner(key_slot(f"{{{than}}}:seq")).address
    for n in range(1000):
        name = f"results-{n}"
        if cluster.owner(key_slot(f"{{{name}}}:seq")).address != owner:
            return name
    raise AssertionError("no queue on another master")


async def test_on_a_cluster_the_complete_waits_for_the_push_to_land(
    redis_cluster: RedisCluster,
) -> None:
    """Cluster: the results queue's master is full, the task queue's is not. The push is sent
    first and refused; the tasks are not completed (the old single pipeline completed them
    on the other master all the same)."""
    redis_cluster.reset()
    tasks = f"tasks-{next(_names)}"
    results = _queue_on_other_master(redis_cluster, tasks)
    results_master = redis_cluster.owner(key_slot(f"{{{results}}}:seq"))
    async with (
        open_redis_cluster(redis_cluster.url) as client,
        RedisClusterBroker(client) as broker,
    ):
        for n in range(2):
            await broker.push_on(tasks, Job(f"t{n}", b"task"))
        first, second = await broker.pop_many(tasks, 2)
        with full(results_master):
            with pytest.raises(RedisOutOfMemory):
                await broker.push_and_complete_many(
                    results, [Job("r1", b"result 1")], tasks, [first.lease]
                )
            with pytest.raises(RedisOutOfMemory):
                await broker.finish_and_claim(
                    results, [Job("r2", b"result 2")], tasks, [second.lease], 1
                )
            assert await census(client, tasks) == {"ready": 0, "active": 2}
        assert await broker.push_and_complete_many(
            results, [Job("r1", b"result 1")], tasks, [first.lease]
        ) == [True]
        done, _ = await broker.finish_and_claim(
            results, [Job("r2", b"result 2")], tasks, [second.lease], 1
        )
        assert done == [True]
        assert await census(client, tasks) == {"ready": 0, "active": 0}
        assert len(await broker.pop_many(results, 10)) == 2


class OutOfMemorySeen(Errors):
    """Keeps the errors, and sets ``out_of_memory`` at the first that says so."""

    def __init__(self) -> None:
        super().__init__()
        self.out_of_memory = trio.Event()

    def __call__(self, exc: BaseException) -> None:
        super().__call__(exc)
        if "out of memory" in str(exc):
            self.out_of_memory.set()


RUNS = 6


def _app(ran: list[int], started: trio.Event, go: trio.Event) -> App:
    app = App("oom")

    @app.step("work")
    async def work(x: int) -> int:
        ran.append(x)
        if len(ran) == RUNS:
            started.set()
        await go.wait()
        return x * 2

    @app.workflow("one")
    async def one(ctx: WorkflowContext, x: int) -> Any:
        return await ctx.step("work", x)

    return app


async def test_runs_whose_steps_end_in_an_oom_complete_once_memory_is_back(
    redis_url: str, redis_server: RedisServer
) -> None:
    """The steps end together while Redis is full: their finalizes (one coalesced call: a
    leader and followers) are refused, reported as out of memory, and tried again, every one of
    them; once memory is back their results land, the runs complete, and each step ran once (no
    reclaim, no loss audit)."""
    ran: list[int] = []
    started, go = trio.Event(), trio.Event()
    errors = OutOfMemorySeen()
    options: dict[str, Any] = {"stalled_threshold": 8.0, "stalled_check_interval": 0.5}
    async with dt.open_backend(redis_url) as backend:
        app = _app(ran, started, go)
        async with open_engine(app, backend, on_error=Errors(), **options) as engine:
            for n in range(RUNS):
                await engine.start("one", n, run_id=f"r{n}")
            async with open_worker(app, backend, on_error=errors, concurrency=RUNS, **options):
                with trio.fail_after(10):
                    await started.wait()
                with full(redis_server):
                    go.set()
                    with trio.fail_after(10):
                        await errors.out_of_memory.wait()
                    await trio.sleep(1.0)  # a second of refusals (and tries again)
                with trio.fail_after(5):  # (well within the stalled threshold: no reclaim)
                    for n in range(RUNS):
                        assert await engine.result(f"r{n}") == n * 2
            stats = engine.statistics()
    assert sorted(ran) == list(range(RUNS)), "each step ran once"
    assert stats.duplicate_results == 0
    # No task was acknowledged while its result was refused (a finalize tried again after
    # that would find its lease gone), and no finalize gave up.
    assert not [e for e in errors.seen if isinstance(e, dt.LeaseLost)]
    messages = errors.messages()
    assert not [m for m in messages if "finalizing failed:" in m], messages
    assert any("finalizing failed (trying again" in m and "out of memory" in m for m in messages)
