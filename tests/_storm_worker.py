"""A worker process for the kill-storm test (tests/test_kill_storm.py): serves step "work".

    python tests/_storm_worker.py URL NAMESPACE INSTANCE PREFETCH LOGFILE

``PREFETCH`` is ``default`` (the transport's default claim policy) or a number (the transport
option ``prefetch=N``). A step's input is the seconds it sleeps, or ``"poison"``: that step
kills its own worker with SIGKILL. Each handler start is logged as ``START {step_id}
{instance}``, and each lost lease the transport reports as ``LEASE-LOST - {instance}``, to
LOGFILE (line-buffered: it survives the SIGKILL); every other error the transport reports goes
to stderr, which the test shows when it fails.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import TextIO

import trio

import durable_trio as dt

CONCURRENCY = 8
THRESHOLD = 2.0
CHECK_INTERVAL = 0.5


async def main(url: str, namespace: str, instance: str, prefetch: str, log: TextIO) -> None:
    def on_error(exc: BaseException) -> None:
        if isinstance(exc, dt.LeaseLost):
            log.write(f"LEASE-LOST - {instance}\n")
        print(f"{instance}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    policy = {} if prefetch == "default" else {"prefetch": int(prefetch)}
    async with (
        dt.open_backend(url) as backend,
        dt.open_queue_transport(
            backend,
            namespace=namespace,
            instance_id=instance,
            concurrency=CONCURRENCY,
            stalled_threshold=THRESHOLD,
            stalled_check_interval=CHECK_INTERVAL,
            on_error=on_error,
            **policy,
        ) as transport,
    ):

        async def work(task: dt.RemoteTask) -> str:
            log.write(f"START {task.step_id} {instance}\n")
            if task.input == "poison":
                os.kill(os.getpid(), signal.SIGKILL)
            assert isinstance(task.input, float)
            await trio.sleep(task.input)
            return instance

        transport.handle("work", work)
        print("ready", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    url, namespace, instance, prefetch, logfile = sys.argv[1:6]
    with open(logfile, "a", buffering=1) as log_file:  # line-buffered: survives SIGKILL
        trio.run(main, url, namespace, instance, prefetch, log_file)
