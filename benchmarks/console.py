"""``make bench`` section "console: runs page": the server time of ``GET /runs`` (the first
page and a deep page, the last one reached by its cursor, 50 runs a page) over 10,000 runs, on
SQLite and on a private Redis. The console app is driven in-process through httpx's
ASGITransport: each figure (median of N) is the app's whole work for one page, the store's
query and the HTML render, without a network hop."""

from __future__ import annotations

from typing import Any

import httpx

import durable_trio as dt
from durable_trio.console import create_app

from .ops import REPEAT, _deepest_cursor, _fill, _median_ms, over_backends

Figures = dict[str, Any]


async def _measure(url: str, count: int, label: str) -> Figures:
    async with (
        dt.open_backend(url) as backend,
        dt.open_operations(backend, namespace="bench") as ops,
    ):
        await _fill(ops.store, count)
        deep = await _deepest_cursor(ops, (await ops.list_runs(limit=50)).next_cursor)
        transport = httpx.ASGITransport(app=create_app(ops))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:

            async def first() -> None:
                assert (await http.get("/runs")).status_code == 200

            async def deep_page() -> None:
                assert (await http.get("/runs", params={"cursor": deep})).status_code == 200

            first_ms = await _median_ms(first)
            deep_ms = await _median_ms(deep_page)
    note = f"median of {REPEAT}, {count:,} runs, 50 a page"
    return {
        f"console: runs page {label} first page (ms)": (first_ms, note),
        f"console: runs page {label} deep page (ms)": (deep_ms, note),
    }


def section(quick: bool) -> Figures:
    """The section's figures (``quick``: 2,000 runs instead of 10,000)."""
    return over_backends("console: runs page", _measure, quick)
