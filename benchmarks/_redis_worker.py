"""A durable_trio worker process for the Redis race (run by ``benchmarks/redis.py``).

    python benchmarks/_redis_worker.py URL NAMESPACE CONCURRENCY QUEUES [UDP_PORT]

Serves no-op steps ``noop-0`` .. ``noop-{QUEUES-1}`` (one routing queue each; or, when QUEUES is
a comma-separated list of step names, those steps), prints ``ready``
once its consumers run, and serves until killed. With ``UDP_PORT``, each step's body ends by
sending its step id to 127.0.0.1:UDP_PORT (how S3 times "enqueue -> job done", as the peers').
With ``BENCH_DONE_FILE``, each step's body appends ``(step number, time.time())`` to that file,
as the peers' S1 jobs do. The environment variable ``BENCH_PREFETCH`` sets the worker's
``prefetch`` (an integer, or ``limit`` for the loop's concurrency; default: the transport's
default, 0). ``BENCH_QUEUE_LIMIT`` (an integer) stores a fleet-wide limit on each served step's
queue before it serves (``set_queue_limit``, as ``open_worker`` does for ``max_concurrency``).
"""

from __future__ import annotations

import os
import struct
import sys
import time
from typing import Any

import trio

import durable_trio as dt

#: One S1 done signal, as the peers' runners write it (benchmarks/peers/_common.py).
DONE = struct.Struct("<qd")


async def main(
    url: str, namespace: str, concurrency: int, queues: list[str], udp_port: int
) -> None:
    udp = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    async with dt.open_backend(url) as backend:
        prefetch = os.environ.get("BENCH_PREFETCH")
        extra: dict[str, int | None] = {}
        if prefetch is not None:
            extra["prefetch"] = None if prefetch == "limit" else int(prefetch)
        async with dt.open_queue_transport(
            backend, namespace=namespace, concurrency=concurrency, **extra
        ) as transport:

            done_file = os.environ.get("BENCH_DONE_FILE")
            done_fd = (
                os.open(done_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                if done_file
                else None
            )

            async def noop(task: dt.RemoteTask) -> None:
                if udp_port:
                    await udp.sendto(task.step_id.encode(), ("127.0.0.1", udp_port))
                if done_fd is not None:  # the peers' S1 done signal: (n, when), 16 bytes
                    os.write(done_fd, DONE.pack(int(task.step_id), time.time()))

            # "start": the moment the worker enters its run loop, imports and connecting done
            # (how the peers' S1 is timed too)
            # (and the CPU seconds this process has used so far, for benchmarks that say where
            # the CPU went)
            print(f"start {time.time():.6f} {time.process_time():.6f}", flush=True)
            limit = os.environ.get("BENCH_QUEUE_LIMIT")
            for step in queues:
                if limit is not None:  # (what open_worker does for a step's max_concurrency)
                    broker: Any = backend.broker
                    await broker.set_queue_limit(transport.names.task_queue(step), int(limit))
                transport.handle(step, noop)
            print("ready", flush=True)
            await trio.sleep_forever()


if __name__ == "__main__":
    udp_port = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    queues = sys.argv[4]
    steps = [f"noop-{n}" for n in range(int(queues))] if queues.isdigit() else queues.split(",")
    trio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]), steps, udp_port)
