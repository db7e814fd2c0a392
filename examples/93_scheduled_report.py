"""A scheduled job: a report every second, its tick fixing its run id (cron= in production).

A real schedule would say ``cron="0 3 * * *", timezone="Europe/Paris"``; the demo waits for 3
ticks, each of which started exactly one run."""

from __future__ import annotations

import time
import uuid
from typing import Any

import trio

import durable_trio as dt
from durable_trio import App, WorkflowContext, open_engine, open_worker

app = App("reports")

#: Seconds between ticks (ticks fall on multiples of it since the Unix epoch).
EVERY = 1.0


@app.step("build-report")
async def build_report(audience: str) -> str:
    # (time.time(), not strftime's own clock: that one is the kernel's coarse clock, which may
    # still read the second before a tick that fired a few milliseconds after it began)
    now = time.time()
    return f"report for {audience} at {time.strftime('%H:%M:%S', time.gmtime(now))} UTC"


@app.workflow("report")
async def report(ctx: WorkflowContext, audience: str) -> dict[str, Any]:
    return {"report": await ctx.step("build-report", audience)}


app.schedule("per-second-report", "report", every=EVERY, input="ops")


async def main(backend_url: str) -> None:
    namespace = f"reports-{uuid.uuid4().hex[:8]}"
    async with dt.open_backend(backend_url) as backend:
        async with open_worker(app, backend, namespace=namespace):
            async with open_engine(app, backend, namespace=namespace) as engine:
                with trio.fail_after(30):
                    while True:
                        runs = await engine.store.list_runs(status=dt.RunStatus.COMPLETED)
                        if len(runs) >= 3:
                            break
                        await trio.sleep(0.05)
                    await engine.schedules.pause("per-second-report")
                ticks = [r.run_id for r in sorted(runs, key=lambda r: r.created_at)][:3]
                for run_id in ticks:
                    outcome = await engine.result(run_id)
                    print(f"  {run_id}: {outcome['report']}")
                (info,) = await engine.schedules.list()
    assert info.schedule is not None
    print(f"  3 ticks, one run each; the schedule is now paused: {info.schedule.paused}")


if __name__ == "__main__":
    trio.run(main, "memory://")
