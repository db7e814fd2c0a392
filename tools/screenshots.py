"""``python -m tools.screenshots``: the PNGs of docs/console.md (docs/images/console-*.png).

Starts the console on a free port over a fresh SQLite backend holding real runs (completed,
failed, one waiting on a durable timer, one cancelled while its step ran) and two schedules,
with a live worker, plus a queue nobody serves with
jobs waiting (so the oldest-age column has a figure) and one job set aside after a worker died
on it twice; then Debian's headless chromium (/usr/bin/chromium) takes a screenshot of each
page (the queues page through chromedriver and selenium, with the evidence unfolded).
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import trio

import durable_trio as dt
from durable_trio.console import serve_console

IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def _app() -> dt.App:
    app = dt.App("shop")

    @app.step("charge", retry=dt.Retry(max_attempts=2))
    async def charge(order: dict[str, Any]) -> dict[str, Any]:
        if order["amount"] > 400:
            raise ValueError(f"card declined: {order['amount']} is over the limit")
        return {"charged": order["amount"]}

    @app.step("ship")
    async def ship(order: dict[str, Any]) -> str:
        return f"parcel-{order['id']}"

    @app.step("reserve")
    async def reserve(order: dict[str, Any]) -> dict[str, Any]:
        await trio.sleep(3600)  # still reserving when the run is cancelled
        return order

    @app.step("release")
    async def release(order: dict[str, Any]) -> str:
        return f"released {order['id']}"

    @app.workflow("restock")
    async def restock(ctx: dt.WorkflowContext, order: dict[str, Any]) -> Any:
        try:
            return await ctx.step("reserve", order)
        except dt.RunCancelled:
            await ctx.step("release", order)  # compensation
            raise

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, order: dict[str, Any]) -> dict[str, Any]:
        receipt = await ctx.step("charge", order)
        if order["id"] == 7:
            await ctx.sleep(3600)
        return {"receipt": receipt, "parcel": await ctx.step("ship", order)}

    return app


async def _set_aside(backend: dt.Backend, producer: dt.QueueTransport) -> None:
    """An ``invoice`` task (a group no worker serves) whose worker died on it twice: popped by
    hand as the dead worker did, its silent claims taken back by the same sweep a transport
    runs (``max_stalled=1``: the second is past the limit), then failed for good as the sweep
    fails poison. Then two more ``invoice`` tasks that just wait."""
    broker: Any = backend.broker
    queue = producer.names.task_queue("invoice")
    order = {"id": 13, "amount": 120}
    await producer.dispatch(dt.RemoteTask("order-13", "1", 1, "invoice", order))
    exceeded: tuple[Any, ...] = ()
    for _ in range(2):
        claimed = await broker.pop_from(queue, worker="worker-7f3a:1")
        await broker.mark_started(queue, [claimed.lease])
        await trio.sleep(0.2)  # the worker is gone: its claim goes silent
        exceeded = (await broker.recover_stalled_jobs(queue, 0.1, 1)).exceeded
    (poison,) = exceeded
    await broker.fail_job(
        poison.lease, queue, "poison: stalled 2 times (max_stalled_count 1), its worker died"
    )
    for i in (14, 15):
        order = {"id": i, "amount": 10 * i}
        await producer.dispatch(dt.RemoteTask(f"order-{i}", "1", 1, "invoice", order))


def _shoot_unfolded(url: str, target: Path, height: int = 800) -> None:
    """A screenshot of ``url`` with every ``<details>`` open (in a thread: selenium blocks)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        # The page itself 1280 x 800, as the other shots (a window's size includes its frame).
        metrics = {"width": 1280, "height": height, "deviceScaleFactor": 1, "mobile": False}
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
        driver.get(url)
        # (the page swaps its <main> every 3 s, folding them again: shot at once)
        driver.execute_script("document.querySelectorAll('details').forEach(d => d.open = true)")
        driver.save_screenshot(str(target))
    finally:
        driver.quit()


async def _shoot(base: str, pages: dict[str, str]) -> None:
    IMAGES.mkdir(parents=True, exist_ok=True)
    for name, path in pages.items():
        target = IMAGES / f"console-{name}.png"
        command = [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--screenshot={target}",
            "--window-size=1280,800",
            base + path,
        ]
        if name in ("queues", "cancelled"):
            height = 1180 if name == "cancelled" else 800  # down to the cancel event
            await trio.to_thread.run_sync(_shoot_unfolded, base + path, target, height)
        else:
            await trio.run_process(command, capture_stdout=True, capture_stderr=True)
        print(f"wrote {target}")


async def main() -> None:
    """Build the data, serve the console, take the screenshots."""
    app = _app()
    with tempfile.TemporaryDirectory() as folder:
        url = "sqlite:///" + str(Path(folder) / "shop.db")
        async with dt.open_backend(url) as backend:
            async with dt.open_worker(app, backend, concurrency=4):
                async with dt.open_engine(app, backend) as engine:
                    for i in range(1, 13):
                        amount = 450 if i in (4, 9) else 20 * i
                        await engine.start(
                            "order", {"id": i, "amount": amount}, run_id=f"order-{i}"
                        )
                    for i in range(1, 13):
                        if i != 7:
                            with contextlib.suppress(dt.RunFailed):
                                await engine.result(f"order-{i}")
                    async with dt.open_queue_transport(backend, namespace="shop") as producer:
                        await _set_aside(backend, producer)
                    await trio.sleep(2.5)  # the invoices wait: an age to show
                    await engine.schedules.add(
                        "nightly-restock", "restock", cron="0 3 * * *", timezone="Europe/Paris",
                        input={"id": 100, "amount": 0},
                    )  # fmt: skip
                    await engine.schedules.add("audit", "order", every=900, input={"id": 0})
                    await engine.schedules.pause("audit")
                    async with dt.open_operations(backend, namespace="shop") as ops:
                        await engine.start("restock", {"id": 21, "amount": 5}, run_id="restock-21")
                        await trio.sleep(1.0)  # its step runs on the worker
                        await ops.cancel_run("restock-21", reason="supplier out of stock")
                        async with trio.open_nursery() as nursery:
                            base = await nursery.start(partial(serve_console, ops, port=0))
                            await _shoot(
                                base,
                                {
                                    "runs": "/runs",
                                    "run": "/runs/order-4",
                                    "cancelled": "/runs/restock-21",
                                    "schedules": "/schedules",
                                    "workers": "/workers",
                                    "queues": "/queues",
                                },
                            )
                            nursery.cancel_scope.cancel()


if __name__ == "__main__":
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        sys.exit("needs Debian's chromium: apt-get install -y chromium chromium-driver")
    trio.run(main)
