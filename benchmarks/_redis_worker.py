"""A durable_trio worker process for the Redis race (run by ``benchmarks/redis.py``).

    python benchmarks/_redis_worker.py URL NAMESPACE CONCURRENCY QUEUES

Serves no-op steps ``noop-0`` .. ``noop-{QUEUES-1}`` (one routing queue each), prints ``ready``
once its consumers run, and serves until killed.
"""

from __future__ import annotations

import sys

import trio

import durable_trio as dt


async def main(url: str, namespace: str, concurrency: int, queues: int) -> None:
    async with dt.open_backend(url) as backend:
        async with dt.open_queue_transport(
            backend, namespace=namespace, concurrency=concurrency
        ) as transport:

            async def noop(task: dt.RemoteTask) -> None:
                return None

            for n in range(queues):
                transport.handle(f"noop-{n}", noop)
            print("ready", flush=True)
            await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
