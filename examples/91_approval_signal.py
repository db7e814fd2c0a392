"""Approval by signal: a workflow waits for ``approve``, sent from another process by the CLI.

The engine lives in this process. The workflow publishes its progress with ``ctx.set_event``
(read here with ``engine.get_event``), then waits for the signal ``approve``. Another process,
``durable-trio runs signal RUN approve '{"by": "alice"}'``, stores the signal; the engine finds
it and the run completes with the approver's name. A second, impatient approval times out and
the workflow catches ``SignalTimeout``.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from urllib.parse import urlsplit

import trio

import durable_trio as dt
from durable_trio import App, SignalTimeout, WorkflowContext, open_engine

app = App("approvals")


@app.workflow("expense")
async def expense(ctx: WorkflowContext, amount: int) -> dict[str, object]:
    await ctx.set_event("stage", "waiting for approval")
    decision = await ctx.wait_signal("approve", timeout=120)
    await ctx.set_event("stage", "approved")
    try:
        await ctx.wait_signal("second-opinion", timeout=0.5)
        second = True
    except SignalTimeout:
        second = False  # nobody gave one: caught, the run goes on
    return {"amount": amount, "approved_by": decision["by"], "second_opinion": second}


async def main(backend_url: str) -> None:
    namespace = f"approval-{uuid.uuid4().hex[:8]}"
    shared = urlsplit(backend_url).scheme != "memory"
    async with (
        dt.open_backend(backend_url) as backend,
        open_engine(app, backend, namespace=namespace) as engine,
    ):
        run_id = await engine.start("expense", 420)
        stage = await engine.get_event(run_id, "stage", timeout=30)
        print(f"  run {run_id}: {stage}")
        if shared:
            command = [sys.executable, "-m", "durable_trio", "runs", "signal", run_id, "approve",
                       json.dumps({"by": "alice"}), "--namespace", namespace]  # fmt: skip
            env = {**os.environ, "DURABLE_TRIO_BACKEND": backend_url}
            done = await trio.run_process(command, env=env, capture_stdout=True)
            print(f"  another process: {done.stdout.decode().strip()}")
        else:
            print("  (memory:// lives in this process only: the signal is sent in-process)")
            await engine.signal(run_id, "approve", {"by": "alice"})
        with trio.fail_after(60):
            result = await engine.result(run_id)
        print(f"  stage: {await engine.get_event(run_id, 'stage')}; result: {result}")
        if result != {"amount": 420, "approved_by": "alice", "second_opinion": False}:
            raise SystemExit("the approval did not complete as it should")


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else "sqlite:///.durable/demo.db")
