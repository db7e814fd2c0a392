# mypy: ignore-errors
"""taskiq with taskiq-redis: ``ListQueueBroker(...).with_result_backend(RedisAsyncResultBackend)``,
``@broker.task`` + ``task.kiq``; the worker process runs ``taskiq.api.run_receiver_task`` (the
receiver the ``taskiq worker`` command runs, without its process supervisor) with
``max_async_tasks=10``. Run with the taskiq virtualenv's python; see ``_common.py``.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from typing import Any

import _common as c
from taskiq.api import run_receiver_task
from taskiq_redis import ListQueueBroker, RedisAsyncResultBackend


def make_broker(url: str, queue_name: str) -> tuple[Any, Any]:
    broker = ListQueueBroker(url, queue_name=queue_name).with_result_backend(
        RedisAsyncResultBackend(url)
    )

    @broker.task(task_name="noop")
    async def noop(n: int) -> None:
        c.job_done(n)

    return broker, noop


class Taskiq:
    name = "taskiq"

    def version(self) -> str:
        return importlib.metadata.version("taskiq")

    # ---------------------------------------------------------------- worker process

    def worker(self, args: c.Args) -> None:
        asyncio.run(self._worker(args))

    async def _worker(self, args: c.Args) -> None:
        brokers = [make_broker(args.redis, name)[0] for name in args.queue_names]
        for broker in brokers:
            await broker.startup()
        stopping = c.install_async_stop(asyncio.get_running_loop())
        c.worker_started()
        tasks = [
            asyncio.create_task(run_receiver_task(broker, max_async_tasks=args.concurrency))
            for broker in brokers
        ]
        await stopping.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for broker in brokers:
            await broker.shutdown()

    # ---------------------------------------------------------------- producer

    def prefill(self, ctx: c.Context, n: int) -> str:
        async def fill() -> None:
            broker, noop = make_broker(ctx.args.redis, ctx.args.queue_names[0])
            await broker.startup()
            # no bulk API: concurrent kiq calls, 50 at a time
            for start in range(0, n, 50):
                await asyncio.gather(*(noop.kiq(i) for i in range(start, min(n, start + 50))))
            await broker.shutdown()

        asyncio.run(fill())
        return "asyncio.gather of task.kiq, 50 at a time"

    def enqueue_timed(self, ctx: c.Context, n: int) -> list[dict[str, Any]]:
        async def run() -> float:
            broker, noop = make_broker(ctx.args.redis, ctx.args.queue_names[0])
            await broker.startup()
            await noop.kiq(-1)  # connection, untimed
            seconds = await c.timed_async(noop.kiq, n)
            await broker.shutdown()
            return seconds

        seconds = asyncio.run(run())
        return [
            c.result("one-by-one", n / seconds, "jobs/s", "await noop.kiq(i)"),
            c.result("bulk", None, "jobs/s", "n/a: taskiq has no bulk enqueue"),
        ]

    def latencies(self, ctx: c.Context, probe: c.Probe) -> list[float]:
        async def run() -> list[float]:
            broker, noop = make_broker(ctx.args.redis, ctx.args.queue_names[0])
            await broker.startup()
            try:
                return await c.latency_loop_async(ctx.args, probe, noop.kiq)
            finally:
                await broker.shutdown()

        return asyncio.run(run())


if __name__ == "__main__":
    raise SystemExit(c.main(Taskiq(), __file__))
