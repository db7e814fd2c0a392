"""A control plane and two store-less tenant pods, each starting and watching its own runs."""

from __future__ import annotations

import uuid
from typing import Any

import trio

import durable_trio as dt
from durable_trio import App, WorkflowContext, open_engine, open_worker


def shop(name: str) -> App:
    app = App(name)

    @app.step("quote")
    async def quote(item: dict[str, Any]) -> int:
        return int(item["qty"]) * 12

    @app.workflow("checkout")
    async def checkout(ctx: WorkflowContext, basket: dict[str, Any]) -> dict[str, Any]:
        prices = await ctx.gather(*(ctx.step("quote", item) for item in basket["items"]))
        await ctx.sleep(0.1)
        return {"basket": basket["id"], "total": sum(prices)}

    return app


async def pod(
    shared: dt.Backend, namespace: str, tenant: str, baskets: int, log: list[str]
) -> list[Any]:
    """One tenant's pod: no run store, no key store; the broker is all it talks to. (In its own
    process it would open the broker's URL itself; here it borrows the shared broker.)"""
    store_less = dt.Backend(url=shared.url, broker=shared.broker, keys=None)
    async with dt.open_tenant_client(
        store_less, tenant, namespace=namespace, result_poll=1.0
    ) as client:
        client.watch(lambda event: log.append(f"{event.kind}:{event.run_id}"))
        await trio.sleep(0.2)  # the subscription is announced to the control plane
        # Both tenants name their runs basket-0, basket-1, ...: the same id, another run.
        run_ids = [
            await client.start(
                "checkout",
                {"id": f"{tenant}-{n}", "items": [{"qty": n + 1}]},
                run_id=f"basket-{n}",
            )
            for n in range(baskets)
        ]
        outputs = [await client.result(run_id) for run_id in run_ids]
        # Isolation: another tenant's run ids mean nothing here.
        try:
            await client.status("not-mine")
        except dt.RunNotFound:
            log.append("status of a run that is not ours: not found")
        await trio.sleep(0.2)  # the last events reach the inbox
        return outputs


async def main(backend_url: str) -> None:
    name = f"tenants-{uuid.uuid4().hex[:8]}"
    logs: dict[str, list[str]] = {"acme": [], "globex": []}
    outputs: dict[str, list[Any]] = {}
    async with (
        dt.open_backend(backend_url) as backend,
        open_worker(shop(name), backend),
        open_engine(shop(name), backend, serve_tenants=True) as control_plane,
    ):

        async def run_pod(tenant: str, baskets: int) -> None:
            outputs[tenant] = await pod(backend, name, tenant, baskets, logs[tenant])

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_pod, "acme", 3)
                nursery.start_soon(run_pod, "globex", 2)
        stored = [run.run_id for run in await control_plane.list()]
        stats = control_plane.statistics()
    for tenant in ("acme", "globex"):
        print(f"  pod {tenant}: totals {[o['total'] for o in outputs[tenant]]}")
        for line in logs[tenant]:
            print(f"    {line}")
    print(f"  the control plane stores them under the tenant's name: {sorted(stored)}")
    print(
        f"  it served {stats.tenant_requests} requests and published {stats.tenant_events} events"
    )
    # globex has no basket-2: an event about one would be acme's, leaking.
    foreign = [line for line in logs["globex"] if "basket-2" in line]
    own = [o["basket"] for o in outputs["acme"] + outputs["globex"]]
    expected = ["acme-0", "acme-1", "acme-2", "globex-0", "globex-1"]
    if foreign or own != expected:
        raise SystemExit(f"isolation or results broken: {foreign}, {outputs}")
