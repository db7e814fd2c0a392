"""A remote workflow: its code runs on a workflow worker; the engine holds only its history."""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import trio

import durable_trio as dt
from durable_trio import App, WorkflowContext, open_engine, open_worker

#: Executions of every step, by what it did (a remote step never runs twice here).
EXECUTIONS: Counter[str] = Counter()


def worker_app(name: str) -> App:
    """What the workflow worker deploys: the workflow's code and its steps."""
    app = App(name)

    @app.step("reserve")
    async def reserve(item: str) -> str:
        EXECUTIONS[f"reserve {item}"] += 1
        return f"shelf-{item}"

    @app.step("charge")
    async def charge(order: dict[str, Any]) -> str:
        EXECUTIONS[f"charge {order['id']}"] += 1
        return f"receipt-{order['id']}"

    @app.workflow("fulfil", remote=True)
    async def fulfil(ctx: WorkflowContext, order: dict[str, Any]) -> dict[str, Any]:
        # A local step: runs on the workflow worker, its outcome checkpointed by the engine.
        warehouse = await ctx.run("pick-warehouse", lambda: f"wh-{len(order['items']) % 3}")
        shelves = await ctx.gather(*(ctx.step("reserve", item) for item in order["items"]))
        receipt = await ctx.step("charge", order)
        await ctx.sleep(0.2)  # a durable timer: the engine fires it, the next turn goes on
        return {"warehouse": warehouse, "shelves": shelves, "receipt": receipt}

    return app


def engine_app(name: str) -> App:
    """What the engine knows: that ``fulfil`` exists and runs elsewhere. No code."""
    app = App(name)
    app.remote_workflow("fulfil")
    return app


async def main(backend_url: str) -> None:
    name = f"remote-{uuid.uuid4().hex[:8]}"  # a fresh namespace in a reused demo database
    order = {"id": 42, "items": ["lamp", "desk", "chair"]}
    # One process here, but the engine and the worker meet through the broker only: run them
    # as `durable-trio engine` and `durable-trio worker` on a shared backend and nothing changes.
    async with (
        dt.open_backend(backend_url) as backend,
        open_worker(worker_app(name), backend),
        open_engine(engine_app(name), backend) as engine,
    ):
        run_id = await engine.start("fulfil", order)
        with trio.fail_after(30):
            output = await engine.result(run_id)
        history = await engine.history(run_id)
        stats = engine.statistics()
    print(f"  run {run_id[:8]} of remote workflow 'fulfil' -> {output}")
    print(f"  {stats.turns_dispatched} turns sent to the workflow worker, each with the history so")
    print(f"  far; {stats.decisions_applied} decisions applied; {stats.step_events} step events")
    print("  history, as the engine's run store holds it:")
    for record in history:
        shown = record.output if record.kind is not dt.StepKind.TIMER else "(fired)"
        print(f"    {record.step_id}. {record.kind.value:<6} {record.name:<15} -> {shown}")
    twice = [what for what, n in EXECUTIONS.items() if n > 1]
    print(f"  remote steps executed twice: {len(twice)}")
    if twice or output["receipt"] != "receipt-42" or len(history) != 6:
        raise SystemExit(f"unexpected outcome: {output}, {twice}, {len(history)} checkpoints")


if __name__ == "__main__":
    trio.run(main, "memory://")
