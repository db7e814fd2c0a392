# mypy: ignore-errors
"""Celery with the Redis broker and ``task_acks_late=True``: ``@app.task`` + ``task.delay``; the
worker is ``app.worker_main(["worker", ...])`` (what the ``celery worker`` command runs): its
default prefork pool with ``--concurrency 10``, no result backend. Run with the Celery
virtualenv's python; see ``_common.py`` for the arguments and the output.
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any

import _common as c
from celery import Celery
from celery.signals import worker_ready


def _redis_url() -> str:
    argv = sys.argv
    return argv[argv.index("--redis") + 1] if "--redis" in argv else "redis://127.0.0.1:1/0"


app = Celery("bench", broker=_redis_url())
app.conf.update(
    task_acks_late=True,
    task_default_queue="bench0",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(name="noop")
def noop(n: int) -> None:
    c.job_done(n)


class CeleryPeer:
    name = "celery"

    def version(self) -> str:
        return importlib.metadata.version("celery")

    # ---------------------------------------------------------------- worker process

    def worker(self, args: c.Args) -> None:
        argv = [
            "worker",
            "--concurrency", str(args.concurrency),
            "--queues", ",".join(args.queue_names),
            "--loglevel", "WARNING",
        ]  # fmt: skip
        worker_ready.connect(lambda **_: c.worker_ready(), weak=False)
        c.worker_started(ready=False)  # ready: Celery's worker_ready signal (after mingle)
        app.worker_main(argv)  # handles SIGTERM itself (warm shutdown)

    # ---------------------------------------------------------------- producer

    def prefill(self, ctx: c.Context, n: int) -> str:
        with app.producer_or_acquire() as producer:
            for i in range(n):
                noop.apply_async((i,), producer=producer)
        return "apply_async with one pooled producer (no bulk API)"

    def enqueue_timed(self, ctx: c.Context, n: int) -> list[dict[str, Any]]:
        noop.delay(-1)  # connection, untimed
        seconds = c.timed_sync(noop.delay, n)
        return [
            c.result("one-by-one", n / seconds, "jobs/s", "noop.delay(i)"),
            c.result("bulk", None, "jobs/s", "n/a: Celery has no bulk enqueue"),
        ]

    def latencies(self, ctx: c.Context, probe: c.Probe) -> list[float]:
        return c.latency_loop_sync(ctx.args, probe, noop.delay)


if __name__ == "__main__":
    raise SystemExit(c.main(CeleryPeer(), __file__))
