"""An order saga: reserve stock, charge the card, ship; a declined card is compensated."""

from __future__ import annotations

import uuid
from typing import Any

import trio

import durable_trio as dt
from durable_trio import (
    App,
    Retry,
    StepFailed,
    WorkflowContext,
    open_engine,
    open_worker,
    step_info,
)

app = App("saga")

# The "outside world" the steps change: a stock ledger, a payment provider, a carrier.
STOCK: dict[str, int] = {}
PAYMENTS: dict[str, int] = {}
"""Charges by idempotency key: a retried or redelivered charge never charges twice."""
GATEWAY_HICCUPS: list[str] = []


class CardDeclined(Exception):
    """The bank said no: retrying cannot help."""


class GatewayTimeout(Exception):
    """The payment provider did not answer: worth retrying."""


@app.step("reserve-stock")
async def reserve_stock(order: dict[str, Any]) -> dict[str, Any]:
    STOCK[order["sku"]] -= order["quantity"]
    return {"sku": order["sku"], "quantity": order["quantity"]}


@app.step("release-stock")
async def release_stock(reservation: dict[str, Any]) -> None:
    STOCK[reservation["sku"]] += reservation["quantity"]


@app.step(
    "charge-card",
    retry=Retry(max_attempts=4, initial=0.05, jitter=0.0, non_retryable=(CardDeclined,)),
)
async def charge_card(order: dict[str, Any]) -> dict[str, Any]:
    info = step_info()
    if order["id"] not in GATEWAY_HICCUPS:  # every order meets one transient error first
        GATEWAY_HICCUPS.append(order["id"])
        raise GatewayTimeout("the payment provider timed out")
    if order["card"] == "4000000000000002":  # the test card that is always declined
        raise CardDeclined(f"card ending {order['card'][-4:]} declined")
    PAYMENTS.setdefault(info.idempotency_key, order["amount"])  # keyed: effectively once
    return {"payment": info.idempotency_key, "amount": order["amount"], "attempt": info.attempt}


@app.step("refund")
async def refund(payment: dict[str, Any]) -> None:
    PAYMENTS.pop(payment["payment"], None)


@app.step("ship")
async def ship(order: dict[str, Any]) -> str:
    await trio.sleep(0.01)
    return f"parcel-{order['id']}"


@app.workflow("order")
async def order_saga(ctx: WorkflowContext, order: dict[str, Any]) -> dict[str, Any]:
    # Each compensation is recorded once its step succeeded; on failure they run in reverse.
    undo: list[tuple[str, Any]] = []
    try:
        reservation = await ctx.step("reserve-stock", order)
        undo.append(("release-stock", reservation))
        payment = await ctx.step("charge-card", order)
        undo.append(("refund", payment))
        parcel = await ctx.step("ship", order)
    except StepFailed as failure:
        for step, argument in reversed(undo):
            await ctx.step(step, argument)
        return {
            "status": "compensated",
            "failed": failure.step_name,
            "reason": failure.error.message,
            "undone": [step for step, _ in reversed(undo)],
        }
    return {"status": "shipped", "parcel": parcel, "charged_on_attempt": payment["attempt"]}


async def main(backend_url: str) -> None:
    STOCK.clear()
    STOCK["tea"] = 10
    PAYMENTS.clear()
    GATEWAY_HICCUPS.clear()
    # A fresh namespace per run: what an interrupted earlier run left in a reused file stays out.
    namespace = f"saga-{uuid.uuid4().hex[:8]}"
    orders: list[dict[str, Any]] = [
        {"id": "A-1", "sku": "tea", "quantity": 3, "amount": 1200, "card": "4242424242424242"},
        {"id": "B-2", "sku": "tea", "quantity": 2, "amount": 800, "card": "4000000000000002"},
    ]
    async with dt.open_backend(backend_url) as backend:
        async with open_worker(app, backend, namespace=namespace, on_error=lambda exc: None):
            async with open_engine(app, backend, namespace=namespace) as engine:
                run_ids = [await engine.start("order", o, run_id=o["id"]) for o in orders]
                with trio.fail_after(30):
                    outcomes = [await engine.result(run_id) for run_id in run_ids]
                stats = engine.statistics()
    for order, outcome in zip(orders, outcomes, strict=True):
        print(f"  order {order['id']} (card …{order['card'][-4:]}): {outcome}")
    print(f"  stock left: {STOCK['tea']} (10 - 3 shipped; the declined order's 2 were released)")
    print(f"  payments kept: {PAYMENTS}")
    print(
        f"  engine: {stats.steps_dispatched} tasks sent, {stats.retries} retried "
        f"(one transient gateway error per order), {stats.results_applied} results applied"
    )
    shipped, compensated = outcomes
    if (
        shipped["status"] != "shipped"
        or compensated["status"] != "compensated"
        or STOCK["tea"] != 7
        or list(PAYMENTS.values()) != [1200]
    ):
        raise SystemExit("the saga did not end as it should")


if __name__ == "__main__":
    trio.run(main, "memory://")
