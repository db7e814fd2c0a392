"""``python -m tools.screenshots``: the PNGs of docs/console.md (docs/images/console-*.png).

Starts the console on a free port over a fresh SQLite backend holding real runs (completed,
failed, one waiting on a durable timer) with a live worker, and has Debian's headless
chromium (/usr/bin/chromium) take a screenshot of each page.
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

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, order: dict[str, Any]) -> dict[str, Any]:
        receipt = await ctx.step("charge", order)
        if order["id"] == 7:
            await ctx.sleep(3600)
        return {"receipt": receipt, "parcel": await ctx.step("ship", order)}

    return app


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
                    async with dt.open_operations(backend, namespace="shop") as ops:
                        async with trio.open_nursery() as nursery:
                            base = await nursery.start(partial(serve_console, ops, port=0))
                            await _shoot(
                                base,
                                {
                                    "runs": "/runs",
                                    "run": "/runs/order-4",
                                    "workers": "/workers",
                                    "queues": "/queues",
                                },
                            )
                            nursery.cancel_scope.cancel()


if __name__ == "__main__":
    if not Path(CHROMIUM).exists():
        sys.exit("needs Debian's chromium: apt-get install -y chromium")
    trio.run(main)
