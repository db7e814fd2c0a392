# mypy: ignore-errors
"""Dramatiq with its Redis broker: ``RedisBroker`` + ``@dramatiq.actor`` + ``actor.send``; one
``dramatiq.Worker(broker, worker_threads=10)`` in the worker process (the ``dramatiq`` command would
fork one such process per CPU). Run with the Dramatiq virtualenv's python; see ``_common.py``.
"""

from __future__ import annotations

import importlib.metadata
import sys
import threading
from typing import Any

import _common as c
import dramatiq
from dramatiq.brokers.redis import RedisBroker


def _redis_url() -> str:
    # the broker must exist before the actor is declared (module import time)
    argv = sys.argv
    return argv[argv.index("--redis") + 1] if "--redis" in argv else "redis://127.0.0.1:1/0"


broker = RedisBroker(url=_redis_url())
dramatiq.set_broker(broker)


@dramatiq.actor(actor_name="noop", queue_name="bench0")
def noop(n: int) -> None:
    c.job_done(n)


class Dramatiq:
    name = "dramatiq"

    def version(self) -> str:
        return importlib.metadata.version("dramatiq")

    # ---------------------------------------------------------------- worker process

    def worker(self, args: c.Args) -> None:
        for name in args.queue_names[1:]:
            broker.declare_queue(name)
        worker = dramatiq.Worker(broker, worker_threads=args.concurrency)
        stopping = threading.Event()
        c.stop_on_sigterm(stopping.set)
        c.worker_started()
        worker.start()
        while not stopping.wait(0.5):
            pass
        worker.stop()
        broker.close()

    # ---------------------------------------------------------------- producer

    def prefill(self, ctx: c.Context, n: int) -> str:
        for i in range(n):
            noop.send(i)
        return "actor.send, one by one (no bulk API)"

    def enqueue_timed(self, ctx: c.Context, n: int) -> list[dict[str, Any]]:
        noop.send(-1)  # connection + script load, untimed
        seconds = c.timed_sync(noop.send, n)
        return [
            c.result("one-by-one", n / seconds, "jobs/s", "noop.send(i)"),
            c.result("bulk", None, "jobs/s", "n/a: Dramatiq has no bulk enqueue"),
        ]

    def latencies(self, ctx: c.Context, probe: c.Probe) -> list[float]:
        return c.latency_loop_sync(ctx.args, probe, noop.send)


if __name__ == "__main__":
    raise SystemExit(c.main(Dramatiq(), __file__))
