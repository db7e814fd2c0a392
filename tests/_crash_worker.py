"""A worker process for the crash tests: serves step "work", logging each execution start.

    python tests/_crash_worker.py URL NAMESPACE INSTANCE LOGFILE

Each execution appends ``{step_id} {instance} {unix start}`` to LOGFILE (line-buffered), and each
claim (a job popped under a lease, run at once or prefetched) ``CLAIM {step_id} {instance} {unix
time}``, so the test can tell which steps ran where and when, and which worker held a step when it
was killed, even after this process is killed with SIGKILL.
"""

from __future__ import annotations

import random
import sys
import time
from typing import TYPE_CHECKING, TextIO

import orjson
import trio

import durable_trio as dt
from _claim_log import observe_claims

if TYPE_CHECKING:
    from durable_trio.brokers import ClaimedJob

THRESHOLD = 2.0
CHECK_INTERVAL = 0.5


async def main(url: str, namespace: str, instance: str, log: TextIO) -> None:
    async with dt.open_backend(url) as backend:
        def log_claims(queue: str, jobs: list[ClaimedJob], by_finalize: bool) -> None:
            # the claims the worker holds, prefetched ones included
            at = time.time()
            for job in jobs:
                step = orjson.loads(job.data)["payload"]["stepId"]
                log.write(f"CLAIM {step} {instance} {at:.6f}\n")

        observe_claims(backend.broker, log_claims)
        async with dt.open_queue_transport(
            backend,
            namespace=namespace,
            instance_id=instance,
            concurrency=8,
            stalled_threshold=THRESHOLD,
            stalled_check_interval=CHECK_INTERVAL,
            # A lost lease (T8, docs/spec.md) is the one legitimate double run besides a kill:
            # say so in the log, so the test can tell it from a bug.
            on_error=lambda exc: (
                log.write(f"LEASE-LOST {instance} {time.time():.6f}\n")
                if isinstance(exc, dt.LeaseLost)
                else None
            ),
        ) as transport:

            async def work(task: dt.RemoteTask) -> str:
                log.write(f"{task.step_id} {instance} {time.time():.6f}\n")
                await trio.sleep(random.uniform(0.02, 0.2))
                return instance

            transport.handle("work", work)
            print("ready", flush=True)
            await trio.sleep_forever()


if __name__ == "__main__":
    url, namespace, instance, logfile = sys.argv[1:5]
    with open(logfile, "a", buffering=1) as log_file:  # line-buffered: survives SIGKILL
        trio.run(main, url, namespace, instance, log_file)
