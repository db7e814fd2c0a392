"""A nightly batch: fan out over accounts, a DURABLE sleep (0.5 s here), then a report."""

from __future__ import annotations

import time
import uuid
from typing import Any

import trio

import durable_trio as dt
from durable_trio import App, StepKind, WorkflowContext, open_engine, open_worker

app = App("nightly")

#: How long the batch waits for late transactions before it reports. A real batch would sleep
#: hours (``ctx.sleep(6 * 3600)``); the demo keeps it to half a second of wall time. The wake-up
#: time is checkpointed: an engine restarted meanwhile wakes the run at the same time.
SETTLEMENT_WINDOW = 0.5


@app.step("list-accounts")
async def list_accounts(day: str) -> list[str]:
    return [f"acct-{n:03d}" for n in range(8)]


@app.step("settle-account")
async def settle_account(account: str) -> dict[str, Any]:
    await trio.sleep(0.02)  # a query against the ledger
    number = int(account.rsplit("-", 1)[1])
    return {"account": account, "balance": 100 * number - 250}


@app.step("publish-report")
async def publish_report(report: dict[str, Any]) -> str:
    return f"report-{report['day']}.csv ({report['accounts']} accounts)"


@app.workflow("nightly")
async def nightly(ctx: WorkflowContext, day: str) -> dict[str, Any]:
    accounts = await ctx.step("list-accounts", day)
    # Every account at once; step ids are fixed left to right when the handles are made.
    settled = await ctx.gather(*(ctx.step("settle-account", a) for a in accounts))
    await ctx.sleep(SETTLEMENT_WINDOW)
    overdrawn = [s["account"] for s in settled if s["balance"] < 0]
    report = {"day": day, "accounts": len(settled), "overdrawn": overdrawn}
    published = await ctx.step("publish-report", report)
    return {"published": published, "overdrawn": overdrawn}


async def main(backend_url: str) -> None:
    namespace = f"nightly-{uuid.uuid4().hex[:8]}"
    async with dt.open_backend(backend_url) as backend:
        async with open_worker(app, backend, namespace=namespace, concurrency=8):
            async with open_engine(app, backend, namespace=namespace) as engine:
                started = time.perf_counter()
                run_id = await engine.start("nightly", "2026-11-29")
                with trio.fail_after(30):
                    outcome = await engine.result(run_id)
                elapsed = time.perf_counter() - started
                history = await engine.history(run_id)
    (timer,) = [step for step in history if step.kind is StepKind.TIMER]
    print(f"  {outcome['published']}; overdrawn: {', '.join(outcome['overdrawn'])}")
    print(
        f"  history: {len(history)} checkpoints — 1 listing, "
        f"{sum(s.name == 'settle-account' for s in history)} settlements run side by side, "
        f"1 durable timer (step {timer.step_id}, {timer.input} s, wake-up time checkpointed), "
        f"1 report"
    )
    print(f"  the run took {elapsed:.2f} s of wall time, the settlement window included")
    if elapsed < SETTLEMENT_WINDOW or timer.wake_at is None:
        raise SystemExit("the durable sleep did not hold the run")


if __name__ == "__main__":
    trio.run(main, "memory://")
