"""The console's tag filter and bulk actions (issue 34, items 2 and 3), through its ASGI app
in-process over a memory backend, in virtual time: the count shown before confirming, the
action behind the same rules as every other (allowed, the action header, same origin), a set
that changed since the page was shown refused, every stored value escaped."""

from __future__ import annotations

import html
import json
import re
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio

import durable_trio as dt
from durable_trio.console import create_app

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytest.importorskip("starlette")

ACTION = {"X-Durable-Console": "action"}


@pytest.fixture
async def ops(autojump_clock: trio.testing.MockClock) -> AsyncIterator[Any]:
    async with (
        dt.open_backend("memory://") as backend,
        dt.open_operations(backend, namespace="shop") as ops,
    ):
        for n in range(3):
            await ops.start_run("order", n, run_id=f"c1-{n}", tags={"customer": "c1"})
            await trio.sleep(1)
        await ops.start_run("order", 9, run_id="c2-0", tags={"customer": "c2", "note": "<b>&"})
        for n in range(2):
            await ops.start_run("refund", n, run_id=f"f{n}", tags={"customer": "c2"})
            await ops.store.finish_run(f"f{n}", dt.RunStatus.FAILED, error={"type": "Boom"})
        yield ops


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


def _bulk_bodies(page: str) -> list[dict[str, str]]:
    found = re.findall(r'data-url="/api/runs/bulk" data-body="([^"]*)"', page)
    return [json.loads(html.unescape(body)) for body in found]


async def test_the_tag_filter_and_the_count_before_a_bulk(ops: Any) -> None:
    async with client(create_app(ops)) as http:
        page = (await http.get("/runs", params={"tag": "customer=c1"})).text
        assert re.findall(r'href="/runs/([^"]+)"', page) == ["c1-2", "c1-1", "c1-0"]
        assert "<strong>3</strong> runs match (tag customer=c1)" in page
        assert 'value="customer=c1"' in page
        # read-only: the buttons are there, disabled
        assert page.count("disabled>Cancel 3</button>") == 1
        assert _bulk_bodies(page)[0] == {
            "status": "", "workflow": "", "tag": "customer=c1", "expected": "3",
            "action": "cancel",
        }  # fmt: skip
        assert "data-confirm=\"Cancel the 3 runs matching tag customer=c1?\"" in page
        refused = await http.post("/api/runs/bulk", json=_bulk_bodies(page)[0], headers=ACTION)
        assert refused.status_code == 403
        # no filter: no bulk
        assert "/api/runs/bulk" not in (await http.get("/runs")).text
        bad = await http.get("/runs", params={"tag": "customer"})
        assert bad.status_code == 400
        assert "KEY=VALUE" in bad.text
        # the run page: its tags, escaped, each a link to the runs of that tag
        run = (await http.get("/runs/c2-0")).text
        assert "note=&lt;b&gt;&amp;" in run
        assert 'href="/runs?tag=customer%3Dc2"' in run
        assert "<b>&" not in run


async def test_a_bulk_cancel_and_retry_from_the_console(ops: Any) -> None:
    async with client(create_app(ops, allow_actions=True)) as http:
        page = (await http.get("/runs", params={"tag": "customer=c1"})).text
        cancel, retry = _bulk_bodies(page)
        assert "disabled" not in page.split("Cancel 3")[0].rsplit("<button", 1)[1]
        assert (await http.post("/api/runs/bulk", json=cancel)).status_code == 403
        cross = await http.post(
            "/api/runs/bulk", json=cancel, headers={**ACTION, "Origin": "http://evil.example"}
        )
        assert cross.status_code == 403
        # a run started since the page was shown: the count differs, nothing done
        await ops.start_run("order", 7, run_id="c1-late", tags={"customer": "c1"})
        changed = await http.post("/api/runs/bulk", json=cancel, headers=ACTION)
        assert changed.status_code == 409
        assert "4 runs match now, not the 3 shown" in changed.json()["message"]
        assert {r.status.value for r in (await ops.list_runs(tags={"customer": "c1"})).runs} == {
            "pending"
        }
        done = await http.post(
            "/api/runs/bulk", json=cancel | {"expected": "4"}, headers=ACTION
        )
        assert done.status_code == 200
        assert done.json()["message"].startswith("4 of 4 runs cancelled (0 skipped")
        left = (await ops.list_runs(tags={"customer": "c1"})).runs
        assert {r.status.value for r in left} == {"cancelled"}
        assert retry["action"] == "retry"

        failed = (await http.get("/runs", params={"tag": "customer=c2", "status": "failed"})).text
        (_, retry_failed) = _bulk_bodies(failed)
        assert retry_failed["expected"] == "2"
        reply = await http.post("/api/runs/bulk", json=retry_failed, headers=ACTION)
        assert reply.json()["message"].startswith("2 of 2 runs retried")
        assert (await ops.store.get_run("f0")).status is dt.RunStatus.PENDING
        again = await http.post("/api/runs/bulk", json=retry_failed, headers=ACTION)
        assert again.status_code == 409  # none match now
        empty = await http.post("/api/runs/bulk", json={"action": "cancel", "expected": "0"},
                                headers=ACTION)  # fmt: skip
        assert empty.status_code == 400
        assert "needs a filter" in empty.json()["message"]
