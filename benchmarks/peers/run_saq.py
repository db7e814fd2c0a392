# mypy: ignore-errors
"""SAQ (Redis): ``Queue.from_url`` + ``Worker(queue, functions, concurrency=10)``.

Run with the SAQ virtualenv's python; see ``_common.py`` for the arguments and the output.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from typing import Any

import _common as c
from saq import Queue, Worker


async def noop(ctx: dict[str, Any], *, n: int) -> None:
    c.job_done(n)


class Saq:
    name = "saq"

    def version(self) -> str:
        return importlib.metadata.version("saq")

    # ---------------------------------------------------------------- worker process

    def worker(self, args: c.Args) -> None:
        asyncio.run(self._worker(args))

    async def _worker(self, args: c.Args) -> None:
        queues = [Queue.from_url(args.redis, name=name) for name in args.queue_names]
        workers = []
        for queue in queues:
            await queue.connect()
            worker = Worker(queue, functions=[noop], concurrency=args.concurrency)
            worker.SIGNALS = []  # one handler below stops every worker of this process
            workers.append(worker)

        def stop() -> None:
            for worker in workers:
                worker.event.set()

        loop = asyncio.get_running_loop()
        c.worker_started(ready=False)
        tasks = [asyncio.create_task(worker.start()) for worker in workers]
        await asyncio.sleep(0)  # let each start() make its event before a signal can come
        stopping = c.install_async_stop(loop)
        await asyncio.sleep(0.1)  # start(): upkeep tasks, then `concurrency` dequeue tasks each
        c.worker_ready()
        await stopping.wait()
        stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        for queue in queues:
            await queue.disconnect()

    # ---------------------------------------------------------------- producer

    def prefill(self, ctx: c.Context, n: int) -> str:
        async def fill() -> None:
            queue = Queue.from_url(ctx.args.redis, name=ctx.args.queue_names[0])
            await queue.connect()
            # no bulk API: concurrent enqueues (SAQ caps them at max_concurrent_ops=20)
            await asyncio.gather(*(queue.enqueue("noop", n=i) for i in range(n)))
            await queue.disconnect()

        asyncio.run(fill())
        return "asyncio.gather of Queue.enqueue"

    def enqueue_timed(self, ctx: c.Context, n: int) -> list[dict[str, Any]]:
        async def run() -> float:
            queue = Queue.from_url(ctx.args.redis, name=ctx.args.queue_names[0])
            await queue.connect()
            await queue.enqueue("noop", n=-1)  # connection + script load, untimed
            seconds = await c.timed_async(lambda i: queue.enqueue("noop", n=i), n)
            await queue.disconnect()
            return seconds

        seconds = asyncio.run(run())
        return [
            c.result("one-by-one", n / seconds, "jobs/s", "await queue.enqueue('noop', n=i)"),
            c.result("bulk", None, "jobs/s", "n/a: SAQ has no bulk enqueue"),
        ]

    def latencies(self, ctx: c.Context, probe: c.Probe) -> list[float]:
        async def run() -> list[float]:
            queue = Queue.from_url(ctx.args.redis, name=ctx.args.queue_names[0])
            await queue.connect()
            try:
                return await c.latency_loop_async(
                    ctx.args, probe, lambda i: queue.enqueue("noop", n=i)
                )
            finally:
                await queue.disconnect()

        return asyncio.run(run())


if __name__ == "__main__":
    raise SystemExit(c.main(Saq(), __file__))
