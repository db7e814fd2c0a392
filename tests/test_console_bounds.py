"""The console's bounds: a 10 MB run output is shown cut at ``VALUE_LIMIT`` with a link to the
whole (served as JSON), a page renders in a worker thread while other requests are answered,
an ended run's page is not polled, the workers page grows linearly with the step names a
worker serves; and, over a real socket, ``?token=`` redirects only to the console's own paths
and a control character in the path is a 400."""

from __future__ import annotations

import threading
from functools import partial
from typing import TYPE_CHECKING, Any

import httpx
import orjson
import pytest
import trio

import durable_trio as dt
from durable_trio.console import _pages, create_app, serve_console
from durable_trio.console._html import VALUE_LIMIT
from durable_trio.console._run_view import render_run
from durable_trio.console._security import local_path

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytest.importorskip("starlette")

#: About 10 MB of JSON: what a run may return (the run store keeps it whole).
BIG = {"rows": [f"row {i:07d} " + "x" * 88 for i in range(100_000)]}
TOKEN = "s3cret-token-0123456789"


def _app() -> dt.App:
    app = dt.App("shop")

    @app.workflow("report")
    async def report(ctx: dt.WorkflowContext, size: str) -> Any:
        if size == "fail":
            raise ValueError("bad " + "e" * 1_000_000)
        if size == "wait":
            await ctx.sleep(3600)
        return BIG if size == "big" else {"small": True}

    return app


@pytest.fixture
async def ops(autojump_clock: trio.testing.MockClock) -> AsyncIterator[dt.Operations]:
    app = _app()
    async with dt.open_backend("memory://") as backend:
        async with dt.open_engine(app, backend) as engine:
            for run_id in ("big", "small"):
                await engine.start("report", run_id, run_id=run_id)
                await engine.result(run_id)
            await engine.start("report", "fail", run_id="fail")
            with pytest.raises(dt.RunFailed):
                await engine.result("fail")
            await engine.start("report", "wait", run_id="wait", detach=True)
            async with dt.open_operations(backend, namespace="shop") as opened:
                yield opened


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


async def test_a_large_output_is_cut_with_a_link_to_the_whole(ops: dt.Operations) -> None:
    whole = orjson.dumps(BIG)
    assert len(whole) > 10_000_000
    async with client(create_app(ops)) as http:
        page = await http.get("/runs/big")
        assert page.status_code == 200
        assert len(page.content) < 4 * VALUE_LIMIT  # not 42 MB: the output cut at 64 KiB
        assert f"shown: the first {VALUE_LIMIT:,} of " in page.text
        link = "/raw/run?id=big&value=output"
        assert f'href="{link.replace("&", "&amp;")}"' in page.text
        raw = await http.get(link)
        assert raw.status_code == 200
        assert raw.headers["content-type"] == "application/json"
        for header in ("content-security-policy", "x-content-type-options", "cache-control"):
            assert header in raw.headers
        assert orjson.loads(raw.content) == BIG
        run = orjson.loads((await http.get("/raw/run", params={"id": "big"})).content)
        assert (run["runId"], run["output"]) == ("big", BIG)
        small = await http.get("/runs/small")
        assert "shown: the first" not in small.text
        assert "raw/run?id=small&amp;value=output" not in small.text
        assert (await http.get("/raw/run", params={"id": "nope"})).status_code == 404
        assert (await http.get("/raw/run")).status_code == 400
        bad = await http.get("/raw/run", params={"id": "big", "value": "lease"})
        assert bad.status_code == 400


async def test_a_long_error_is_cut_too(ops: dt.Operations) -> None:
    async with client(create_app(ops)) as http:
        page = await http.get("/runs/fail")
        assert page.status_code == 200
        assert len(page.content) < 4 * VALUE_LIMIT
        assert "more characters)" in page.text  # the error line, cut
        assert 'href="/raw/run?id=fail&amp;value=error"' in page.text
        raw = await http.get("/raw/run", params={"id": "fail", "value": "error"})
        assert orjson.loads(raw.content)["message"] == "bad " + "e" * 1_000_000


async def test_only_the_page_of_a_run_that_has_not_ended_is_polled(ops: dt.Operations) -> None:
    async with client(create_app(ops)) as http:
        assert 'data-live="0"' in (await http.get("/runs/big")).text
        assert 'data-live="0"' in (await http.get("/runs/fail")).text
        assert 'data-live="1"' in (await http.get("/runs/wait")).text
        assert 'data-live="1"' in (await http.get("/runs")).text


async def test_another_request_is_answered_while_a_heavy_page_renders(
    ops: dt.Operations, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run page of the 10 MB output is held inside its rendering (fault injection at that
    point) until the runs page has been answered: it can be only if rendering is off the
    event loop. (Rendered on the loop, the hold would stall every request until it ran out.)"""
    started, release = threading.Event(), threading.Event()
    order: list[str] = []

    def held(details: Any, **options: Any) -> Any:
        order.append("render started")
        started.set()
        release.wait(10)
        markup = render_run(details, **options)
        order.append("render done")
        return markup

    monkeypatch.setattr(_pages, "render_run", held)
    pages: dict[str, httpx.Response] = {}
    async with client(create_app(ops)) as http:

        async def get(path: str) -> None:
            pages[path] = await http.get(path)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(get, "/runs/big")
            await trio.to_thread.run_sync(started.wait, 10)
            await get("/runs")
            order.append("runs answered")
            release.set()
    assert order == ["render started", "runs answered", "render done"]
    assert pages["/runs"].status_code == pages["/runs/big"].status_code == 200
    assert "shown: the first" in pages["/runs/big"].text


def _wide_app(names: int) -> dt.App:
    app = dt.App("shop")
    for n in range(names):

        @app.step(f"step-{n:05d}")
        async def step(value: Any) -> Any:
            return value

    return app


async def _workers_page_size(names: int) -> int:
    async with dt.open_backend("memory://") as backend:
        async with dt.open_worker(_wide_app(names), backend, instance_id="w1"):
            await trio.sleep(0.5)
            async with dt.open_operations(backend, namespace="shop") as ops:
                (worker,) = await ops.workers()
                assert len(worker.groups) == names
                async with client(create_app(ops)) as http:
                    page = await http.get("/workers")
                    assert page.status_code == 200
                    assert page.text.count('<section class="card">') == names
                    return len(page.content)


async def test_the_workers_page_grows_linearly_with_the_names_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One worker serving every step name: each group's row names a few of its other groups
    and counts the rest (it used to list them all: the page grew with the square)."""
    small, large = await _workers_page_size(500), await _workers_page_size(1000)
    assert large < 2.5 * small, (small, large)


def test_a_redirect_goes_only_to_a_path_of_the_console() -> None:
    assert local_path("/runs") == "/runs"
    assert local_path("/runs/a b/c") == "/runs/a%20b/c"
    assert local_path("/runs/50%") == "/runs/50%25"
    for other_host in ("//evil.example", "/\\evil.example", "/runs\\x", "https://evil.example"):
        assert local_path(other_host) == "/", other_host
    assert local_path("") == "/"
    assert local_path("/a\r\nSet-Cookie: x") == "/"


async def _raw_request(port: int, target: str) -> tuple[int, dict[str, str]]:
    """``GET target`` over a real socket, as sent (no client normalises it)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        request = f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        await stream.send_all(request.encode("latin-1"))
        reply = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                reply += chunk
    head = reply.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in head[1:])
    return int(head[0].split(" ")[1]), {k.lower(): v for k, v in headers.items()}


@pytest.mark.parametrize("token", [TOKEN, None])
async def test_redirects_and_control_characters_over_a_real_socket(token: str | None) -> None:
    """A real server (hypercorn): after a correct ``?token=``, ``//evil.example`` and
    ``/\\evil.example`` (raw and percent-encoded) land on ``/``, never on another host; a CR
    LF (or another control character) in the path is a 400, not a 500 with a traceback."""
    async with dt.open_operations("memory://") as ops:
        async with trio.open_nursery() as nursery:
            base = await nursery.start(partial(serve_console, ops, port=0, token=token))
            port = int(base.rsplit(":", 1)[1])
            given = f"token={TOKEN}"
            if token is not None:
                for target in (
                    f"//evil.example?{given}",
                    f"//evil.example/runs?{given}",
                    f"/%2Fevil.example?{given}",
                    f"/\\evil.example?{given}",
                    f"/%5Cevil.example?{given}",
                ):
                    status, headers = await _raw_request(port, target)
                    assert (status, headers["location"]) == (303, "/"), target
                status, headers = await _raw_request(port, f"/runs?{given}&status=failed")
                assert (status, headers["location"]) == (303, "/runs?status=failed")
                status, headers = await _raw_request(port, f"/runs/a%20b?{given}")
                assert (status, headers["location"]) == (303, "/runs/a%20b")
            suffix = f"?{given}" if token is not None else ""
            for target in ("/runs/a%0d%0ab", "/a%0d%0aSet-Cookie:%20x=1", "/runs/%1b[2J"):
                status, headers = await _raw_request(port, target + suffix)
                assert status == 400, target
                assert "set-cookie" not in headers
            nursery.cancel_scope.cancel()
