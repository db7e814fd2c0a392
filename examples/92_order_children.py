"""An order that fans out to one shipment child workflow per parcel; a lost parcel's child
fails and the order catches it (``ChildFailed``) and refunds that parcel."""

from __future__ import annotations

import uuid
from typing import Any

import trio

import durable_trio as dt
from durable_trio import App, ChildFailed, Retry, WorkflowContext, open_engine, open_worker

app = App("order-children")

SHIPPED: list[str] = []
REFUNDED: list[str] = []


class ParcelLost(Exception):
    """The carrier lost it: retrying cannot help."""


@app.step("book-carrier")
async def book_carrier(parcel: dict[str, Any]) -> str:
    await trio.sleep(0.01)
    if parcel.get("lost"):
        raise ParcelLost(f"the carrier lost parcel {parcel['id']}")
    return f"track-{parcel['id']}"


@app.step("deliver")
async def deliver(tracking: str) -> str:
    SHIPPED.append(tracking)
    return tracking


@app.step("refund")
async def refund(parcel: dict[str, Any]) -> str:
    REFUNDED.append(parcel["id"])
    return str(parcel["id"])


@app.workflow("shipment")
async def shipment(ctx: WorkflowContext, parcel: dict[str, Any]) -> str:
    tracking = await ctx.step("book-carrier", parcel, retry=Retry(max_attempts=1))
    delivered = await ctx.step("deliver", tracking)
    return str(delivered)


@app.workflow("order")
async def order(ctx: WorkflowContext, order: dict[str, Any]) -> dict[str, Any]:
    # One child per parcel, started now (ids order-id/1, order-id/2, ...), awaited together.
    handles = [await ctx.start_child("shipment", parcel) for parcel in order["parcels"]]
    outcomes = await ctx.gather(*handles, return_exceptions=True)
    shipped, refunded = [], []
    for parcel, outcome in zip(order["parcels"], outcomes, strict=True):
        if isinstance(outcome, ChildFailed):
            refunded.append(await ctx.step("refund", parcel))
        else:
            shipped.append(outcome)
    return {"shipped": shipped, "refunded": refunded}


async def main(backend_url: str) -> None:
    SHIPPED.clear()
    REFUNDED.clear()
    # A fresh namespace per run: what an interrupted earlier run left in a reused file stays out.
    namespace = f"children-{uuid.uuid4().hex[:8]}"
    parcels = [{"id": "P1"}, {"id": "P2", "lost": True}, {"id": "P3"}]
    async with dt.open_backend(backend_url) as backend:
        async with open_worker(app, backend, namespace=namespace, on_error=lambda exc: None):
            async with open_engine(app, backend, namespace=namespace) as engine:
                run_id = await engine.start("order", {"parcels": parcels}, run_id="order-7")
                with trio.fail_after(30):
                    outcome = await engine.result(run_id)
                children = [await engine.get(f"{run_id}/{n}") for n in range(1, 4)]
    print(f"  order {run_id}: {outcome}")
    for child in children:
        print(f"  child {child.run_id} ({child.workflow}): {child.status.value}")
    if outcome != {"shipped": ["track-P1", "track-P3"], "refunded": ["P2"]} or sorted(SHIPPED) != [
        "track-P1",
        "track-P3",
    ]:
        raise SystemExit("the order did not end as it should")


if __name__ == "__main__":
    trio.run(main, "memory://")
