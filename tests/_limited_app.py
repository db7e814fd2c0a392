"""The app of the fleet-wide limits chaos test (tests/test_limits_chaos.py), served by
``durable-trio worker tests/_limited_app.py:app``.

Step "limited" (``max_concurrency=2``, fleet-wide) sleeps ``input`` seconds; each start is
logged as ``START {step_id} {pid}`` to ``$LIMITS_TEST_LOG`` (line-buffered, so the test sees
them while the process runs).
"""

from __future__ import annotations

import os

import trio

import durable_trio as dt

app = dt.App("limited")

#: The step's fleet-wide limit (the test's in-process worker serves it with the same).
LIMIT = 2


def _log(line: str) -> None:
    path = os.environ.get("LIMITS_TEST_LOG")
    if path:
        with open(path, "a", buffering=1) as log:
            log.write(f"{line} {os.getpid()}\n")


@app.step("limited", max_concurrency=LIMIT)
async def limited(seconds: float) -> int:
    _log(f"START {dt.step_info().step_id}")
    await trio.sleep(seconds)
    return os.getpid()
