"""The app of the supervisor tests (tests/test_supervisor.py), served by ``durable-trio worker
tests/_supervised_app.py:app --processes N``.

Step "work" sleeps ``input`` seconds and returns its process's pid; each start and end is
logged as ``START|END {step_id} {pid} {unix time}`` to ``$SUPERVISOR_TEST_LOG`` (line-buffered,
so the test sees them while the processes run). Steps "blocking" (a ``def``: a thread) and
"crunch" (``cpu=True``: a ``trio-parallel`` process) are the sync steps of
tests/test_sync_steps.py.
"""

from __future__ import annotations

import os
import time

import trio

import durable_trio as dt

app = dt.App("supervised")


def _log(line: str) -> None:
    path = os.environ.get("SUPERVISOR_TEST_LOG")
    if path:
        with open(path, "a", buffering=1) as log:
            log.write(f"{line} {os.getpid()} {time.time():.6f}\n")


@app.step("work")
async def work(seconds: float) -> int:
    step = dt.step_info().step_id
    _log(f"START {step}")
    await trio.sleep(seconds)
    _log(f"END {step}")
    return os.getpid()


@app.step("blocking")
def blocking(seconds: float) -> dict[str, object]:
    time.sleep(seconds)
    return {"step": dt.step_info().step_id, "pid": os.getpid()}


@app.step("crunch", cpu=True)
def crunch(n: int) -> dict[str, int]:
    return {"sum": sum(i * i for i in range(n)), "pid": os.getpid()}
