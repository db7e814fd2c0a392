"""A patched workflow: a run started on the old code and a run started on the new one both
complete on the new code (``ctx.patched``); then a workflow shape changed without a patch parks
a run ``blocked``, and deploying the fix resumes it on its own."""

from __future__ import annotations

import uuid
from typing import Any

import trio

import durable_trio as dt
from durable_trio import App, RunStatus, WorkflowContext, open_engine, open_worker


def shop(name: str, version: str) -> App:
    app = App(name)

    @app.step("email-receipt")
    async def email(order: int) -> str:
        return f"emailed receipt of order {order}"

    @app.step("push-receipt")
    async def push(order: int) -> str:
        return f"pushed receipt of order {order} to the app"

    @app.step("charge")
    async def charge(order: int) -> str:
        return f"charged order {order}"

    if version == "v1":

        @app.workflow("checkout")
        async def v1(ctx: WorkflowContext, order: int) -> list[Any]:
            charged = await ctx.step("charge", order)
            receipt = await ctx.step("email-receipt", order)
            await ctx.sleep(0.3)  # waiting for the carrier, say
            return [charged, receipt]

    elif version == "v2":  # receipts go to the app now, for runs that get here on v2

        @app.workflow("checkout")
        async def v2(ctx: WorkflowContext, order: int) -> list[Any]:
            charged = await ctx.step("charge", order)
            if ctx.patched("push-receipt"):
                receipt = await ctx.step("push-receipt", order)
            else:
                receipt = await ctx.step("email-receipt", order)
            await ctx.sleep(0.3)
            return [charged, receipt]

    else:  # "unpatched": the same change without ctx.patched: old runs cannot replay it

        @app.workflow("checkout")
        async def unpatched(ctx: WorkflowContext, order: int) -> list[Any]:
            charged = await ctx.step("charge", order)
            receipt = await ctx.step("push-receipt", order)
            await ctx.sleep(0.3)
            return [charged, receipt]

    return app


async def main(backend_url: str) -> None:
    name = f"patched-{uuid.uuid4().hex[:8]}"
    async with dt.open_backend(backend_url) as backend:
        # The old code starts two runs and is replaced while they wait.
        v1 = shop(name, "v1")
        async with open_worker(v1, backend), open_engine(v1, backend) as old:
            await old.start("checkout", 1, run_id="order-1")
            await old.start("checkout", 2, run_id="order-2")
            await trio.sleep(0.1)
        # A deploy without the patch: order-2's history says email-receipt, the code says
        # push-receipt: parked blocked, with the diff.
        bad = shop(name, "unpatched")
        async with open_worker(bad, backend), open_engine(bad, backend) as broken:
            with trio.fail_after(30):
                # Polled as an operator would (`durable-trio runs list --status blocked`).
                while (run := await broken.get("order-2")).status is not RunStatus.BLOCKED:  # noqa: ASYNC110
                    await trio.sleep(0.05)
            print(f"  order-2 {run.status}: expected {run.error['expected']}, "
                  f"found {run.error['found']}")
        # The patched code: order-1 and order-2 (old histories) replay with patched() False
        # (order-2 resumes on its own: this engine's code has another fingerprint), a new run
        # takes the new branch.
        v2 = shop(name, "v2")
        async with open_worker(v2, backend), open_engine(v2, backend) as new:
            await new.start("checkout", 3, run_id="order-3")
            with trio.fail_after(30):
                outputs = [await new.result(f"order-{n}") for n in (1, 2, 3)]
    for output in outputs:
        print(f"  {output}")
    if [o[1].split()[0] for o in outputs] != ["emailed", "emailed", "pushed"]:
        raise SystemExit(f"old and new runs did not both complete as expected: {outputs}")
