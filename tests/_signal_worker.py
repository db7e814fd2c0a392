"""The app and the worker process of the signal tests (tests/test_signal_processes.py).

    python tests/_signal_worker.py URL NAMESPACE INSTANCE LOGFILE CLOSE_TIMEOUT

serves ``app``'s step "work" through the public API and :func:`durable_trio.close_on_signals`,
as an embedding user would, and exits with the helper's exit status. ``durable-trio worker
tests/_signal_worker.py:app`` and ``durable-trio engine ...`` load the same ``app``.

Each claim is logged as ``CLAIM {step_id} {instance} {attempts} {stalled_count} {unix time}``
and each step's start, end or cancellation as ``START|END|CANCELLED {step_id} {instance} {unix
time}`` to LOGFILE (``$SIGNAL_TEST_LOG`` under the CLI), line-buffered, so the test sees them
while the process runs.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

import orjson
import trio

import durable_trio as dt

if TYPE_CHECKING:
    from durable_trio.brokers import ClaimedJob

app = dt.App("signals")
_instance = os.environ.get("SIGNAL_TEST_INSTANCE", "cli")


def _log(line: str) -> None:
    path = os.environ.get("SIGNAL_TEST_LOG")
    if path:
        with open(path, "a", buffering=1) as log:
            log.write(f"{line} {time.time():.6f}\n")


@app.step("work")
async def work(seconds: float) -> str:
    step = dt.step_info().step_id
    _log(f"START {step} {_instance}")
    try:
        await trio.sleep(seconds)
    except trio.Cancelled:
        _log(f"CANCELLED {step} {_instance}")
        raise
    _log(f"END {step} {_instance}")
    return _instance


@app.workflow("nap")
async def nap(ctx: dt.WorkflowContext, _: Any) -> float:
    await ctx.sleep(60)
    return 60.0


async def main(url: str, namespace: str, close_timeout: float) -> int:
    async with dt.open_backend(url) as backend:
        pop_many = backend.broker.pop_many  # type: ignore[attr-defined]

        async def logged_pop_many(queue: str, count: int, *, worker: str = "") -> list[ClaimedJob]:
            # Observation only (no fault): every claim with its broker-side counts.
            jobs: list[ClaimedJob] = await pop_many(queue, count, worker=worker)
            for job in jobs:
                step = orjson.loads(job.data)["payload"]["stepId"]
                _log(f"CLAIM {step} {_instance} {job.attempts} {job.stalled_count}")
            return jobs

        backend.broker.pop_many = logged_pop_many  # type: ignore[attr-defined]
        finish_and_claim = backend.broker.finish_and_claim  # type: ignore[attr-defined]

        async def logged_finish_and_claim(*args: Any, **kwargs: Any) -> Any:
            # The claims a finalize makes for the next jobs (SupportsFinishAndClaim), logged
            # as the pops' are.
            answers, jobs = await finish_and_claim(*args, **kwargs)
            for job in jobs:
                step = orjson.loads(job.data)["payload"]["stepId"]
                _log(f"CLAIM {step} {_instance} {job.attempts} {job.stalled_count}")
            return answers, jobs

        backend.broker.finish_and_claim = logged_finish_and_claim  # type: ignore[attr-defined]
        async with dt.close_on_signals() as stop:
            async with dt.open_worker(
                app,
                backend,
                namespace=namespace,
                instance_id=_instance,
                close_timeout=close_timeout,
                # no sweep in this process: a quick redelivery can only be the handback
                stalled_check_interval=0,
            ):
                print("ready", flush=True)
                await stop.wait()
    _log(f"CLOSED - {_instance}")
    return stop.exit_status


if __name__ == "__main__":
    url, namespace, _instance, logfile, close_timeout = sys.argv[1:6]
    os.environ["SIGNAL_TEST_LOG"] = logfile
    sys.exit(trio.run(main, url, namespace, float(close_timeout)))
