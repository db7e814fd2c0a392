# mypy: ignore-errors
"""arq: ``create_pool`` + ``ArqRedis.enqueue_job``; ``Worker(functions, max_jobs=10)``.

The poll delay is arq's default (0.5 s) unless ``BENCH_ARQ_POLL_DELAY`` (seconds) is set: the
harness runs a second, clearly named variant with 0.05 s. Run with the arq virtualenv's python;
see ``_common.py`` for the arguments and the output.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import random
from typing import Any

import _common as c
from arq import Worker, create_pool
from arq.connections import ArqRedis, RedisSettings
from arq.worker import func


async def noop(ctx: dict[str, Any], n: int) -> None:
    c.job_done(n)


def _poll_delay() -> float | None:
    value = os.environ.get("BENCH_ARQ_POLL_DELAY")
    return float(value) if value else None


class Arq:
    name = "arq"

    def version(self) -> str:
        return importlib.metadata.version("arq")

    # ---------------------------------------------------------------- worker process

    def worker(self, args: c.Args) -> None:
        asyncio.run(self._worker(args))

    async def _worker(self, args: c.Args) -> None:
        settings = RedisSettings.from_dsn(args.redis)
        extra = {} if _poll_delay() is None else {"poll_delay": _poll_delay()}
        workers = [
            Worker(
                functions=[func(noop, name="noop")],
                queue_name=name,
                redis_settings=settings,
                max_jobs=args.concurrency,
                handle_signals=False,  # several workers in one process: one handler, below
                **extra,
            )
            for name in args.queue_names
        ]
        stopping = c.install_async_stop(asyncio.get_running_loop())
        c.worker_started()
        tasks = [asyncio.create_task(worker.async_run()) for worker in workers]
        await stopping.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for worker in workers:
            await worker.close()

    # ---------------------------------------------------------------- producer

    async def _pool(self, ctx: c.Context) -> ArqRedis:
        return await create_pool(
            RedisSettings.from_dsn(ctx.args.redis), default_queue_name=ctx.args.queue_names[0]
        )

    def prefill(self, ctx: c.Context, n: int) -> str:
        async def fill() -> None:
            redis = await self._pool(ctx)
            # no bulk API: concurrent enqueue_job calls, 50 at a time
            for start in range(0, n, 50):
                await asyncio.gather(
                    *(redis.enqueue_job("noop", i) for i in range(start, min(n, start + 50)))
                )
            await redis.aclose()

        asyncio.run(fill())
        return "asyncio.gather of enqueue_job, 50 at a time"

    def enqueue_timed(self, ctx: c.Context, n: int) -> list[dict[str, Any]]:
        async def run() -> float:
            redis = await self._pool(ctx)
            await redis.enqueue_job("noop", -1)  # connection, untimed
            seconds = await c.timed_async(lambda i: redis.enqueue_job("noop", i), n)
            await redis.aclose()
            return seconds

        seconds = asyncio.run(run())
        return [
            c.result("one-by-one", n / seconds, "jobs/s", "await redis.enqueue_job('noop', i)"),
            c.result("bulk", None, "jobs/s", "n/a: arq has no bulk enqueue"),
        ]

    def latencies(self, ctx: c.Context, probe: c.Probe) -> list[float]:
        # arq polls: a job enqueued right after the previous one completed would always wait a
        # whole poll (phase-locked). A random pause first makes enqueues land at random phases.
        delay = _poll_delay() or 0.5

        def gap() -> float:
            return random.uniform(0.0, delay)

        ctx.notes.append(f"random 0..{delay} s pause before each timed job (poll phase)")

        async def run() -> list[float]:
            redis = await self._pool(ctx)
            try:
                return await c.latency_loop_async(
                    ctx.args, probe, lambda i: redis.enqueue_job("noop", i), gap=gap
                )
            finally:
                await redis.aclose()

        return asyncio.run(run())


if __name__ == "__main__":
    raise SystemExit(c.main(Arq(), __file__))
