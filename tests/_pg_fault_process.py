"""An engine or a worker process for the PostgreSQL fault tests (tests/test_postgres_faults.py).

    python tests/_pg_fault_process.py engine|worker URL

It serves the app below on namespace ``faults`` until killed, and prints ``ready`` once open.
Errors its loops report are logged to stderr (the test shows them when it fails). Short
leases and sweeps: a claim or run left behind by a cut connection comes back in seconds.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import trio

import durable_trio as dt
from durable_trio._engine import App, WorkflowContext, open_engine, open_worker

NAMESPACE = "faults"
STEPS = 3

app = App("pg-faults")


@app.step("work")
async def work(n: int) -> int:
    await trio.sleep(0.02)
    return n + 1


@app.workflow("chain")
async def chain(ctx: WorkflowContext, n: int) -> int:
    for _ in range(STEPS):
        n = await ctx.step("work", n)
    return n


def expected(n: int) -> int:
    return n + STEPS


#: The transport's sweep: a claim whose worker lost its connection mid-step comes back soon.
TRANSPORT: dict[str, Any] = {"stalled_threshold": 2.0, "stalled_check_interval": 0.5}


async def main(role: str, url: str) -> None:
    async with dt.open_backend(url) as backend:
        if role == "engine":
            async with open_engine(
                app, backend, namespace=NAMESPACE, engine_id="E", run_lease=2.0,
                reconcile_interval=0.5, watch_interval=0.5, **TRANSPORT,
            ):  # fmt: skip
                print("ready", flush=True)
                await trio.sleep_forever()
        async with open_worker(app, backend, namespace=NAMESPACE, concurrency=16, **TRANSPORT):
            print("ready", flush=True)
            await trio.sleep_forever()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    trio.run(main, sys.argv[1], sys.argv[2])
