"""The app ``durable-trio worker benchmarks/_bench_app.py:app`` serves in the S1 drain with
``--processes`` (``benchmarks/processes.py``): one no-op step, ``noop-0``, as
``benchmarks/_redis_worker.py`` serves it."""

from __future__ import annotations

import durable_trio as dt

app = dt.App("bench")


@app.step("noop-0")
async def noop(_: object) -> None:
    return None
