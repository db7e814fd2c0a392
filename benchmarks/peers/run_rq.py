# mypy: ignore-errors
"""rq: ``Queue.enqueue`` / ``Queue.enqueue_many``; the default ``Worker`` (forks a work horse per
job, as ``rq worker`` does). Run with the rq virtualenv's python; see ``_common.py``.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import _common as c
from redis import Redis
from rq import Queue, Worker

JOB = c.job_done  # a plain function: rq imports it by name ("_common.job_done") in the horse


class Rq:
    name = "rq"

    def version(self) -> str:
        return importlib.metadata.version("rq")

    # ---------------------------------------------------------------- worker process

    def worker(self, args: c.Args) -> None:
        redis = Redis.from_url(args.redis)
        queues = [Queue(name, connection=redis) for name in args.queue_names]
        worker = Worker(queues, connection=redis)  # forking worker, rq's default
        c.worker_started()
        worker.work()  # handles SIGTERM itself (warm shutdown)

    # ---------------------------------------------------------------- producer

    def _queue(self, ctx: c.Context) -> Queue:
        return Queue(ctx.args.queue_names[0], connection=Redis.from_url(ctx.args.redis))

    def prefill(self, ctx: c.Context, n: int) -> str:
        queue = self._queue(ctx)
        queue.enqueue_many([Queue.prepare_data(JOB, (i,)) for i in range(n)])
        return "Queue.enqueue_many"

    def enqueue_timed(self, ctx: c.Context, n: int) -> list[dict[str, Any]]:
        queue = self._queue(ctx)
        queue.enqueue(JOB, -1)  # connection, untimed
        one = c.timed_sync(lambda i: queue.enqueue(JOB, i), n)

        def bulk(_: int) -> None:
            queue.enqueue_many([Queue.prepare_data(JOB, (i,)) for i in range(n)])

        many = c.timed_sync(bulk, 1)
        return [
            c.result("one-by-one", n / one, "jobs/s", "queue.enqueue(fn, i)"),
            c.result("bulk", n / many, "jobs/s", f"queue.enqueue_many of {n} Queue.prepare_data"),
        ]

    def latencies(self, ctx: c.Context, probe: c.Probe) -> list[float]:
        queue = self._queue(ctx)
        return c.latency_loop_sync(ctx.args, probe, lambda i: queue.enqueue(JOB, i))


if __name__ == "__main__":
    raise SystemExit(c.main(Rq(), __file__))
