"""The web console through its ASGI app in-process (httpx's ASGITransport), over a memory
backend holding real runs: completed, failed (a step out of attempts) and retried; and its
pages and actions once over a real PostgreSQL backend."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio

import durable_trio as dt
from durable_trio.console import check_exposure, create_app
from helpers import serve_until_done, set_aside_by_stalls

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytest.importorskip("starlette")

ACTION = {"X-Durable-Console": "action"}


def shop(declined: set[str]) -> dt.App:
    app = dt.App("shop")

    @app.step("charge", retry=dt.Retry(max_attempts=2))
    async def charge(order: dict[str, Any]) -> dict[str, Any]:
        if order["id"] in declined:
            raise ValueError(f"card declined for order {order['id']}")
        return {"charged": order["amount"]}

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, order: dict[str, Any]) -> dict[str, Any]:
        receipt = await ctx.step("charge", order)
        return {"receipt": receipt}

    return app


@pytest.fixture
async def world(autojump_clock: trio.testing.MockClock) -> AsyncIterator[dict[str, Any]]:
    declined = {"bad"}
    app = shop(declined)
    async with dt.open_backend("memory://") as backend:
        async with dt.open_worker(app, backend, concurrency=4, instance_id="worker-a"):
            async with dt.open_engine(app, backend, reconcile_interval=1.0) as engine:
                for i in range(3):
                    await engine.start("order", {"id": f"ok{i}", "amount": i}, run_id=f"ok{i}")
                    await engine.result(f"ok{i}")
                await engine.start("order", {"id": "bad", "amount": 9}, run_id="bad")
                with pytest.raises(dt.RunFailed):
                    await engine.result("bad")
                async with dt.open_operations(backend, namespace="shop") as ops:
                    yield {"ops": ops, "engine": engine, "declined": declined}


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


async def test_the_runs_page_lists_filters_and_finds_runs(world: dict[str, Any]) -> None:
    async with client(create_app(world["ops"])) as http:
        home = await http.get("/")
        assert home.status_code == 303
        assert home.headers["location"] == "/runs"
        page = await http.get("/runs")
        assert page.status_code == 200
        assert all(f'href="/runs/{r}"' in page.text for r in ("ok0", "ok1", "ok2", "bad"))
        assert "content-security-policy" in page.headers
        failed = await http.get("/runs", params={"status": "failed"})
        assert 'href="/runs/bad"' in failed.text
        assert 'href="/runs/ok0"' not in failed.text
        found = await http.get("/runs", params={"q": "ok1"})
        assert 'href="/runs/ok1"' in found.text
        assert 'href="/runs/ok0"' not in found.text
        missing = await http.get("/runs", params={"q": "nope"})
        assert "no run with id" in missing.text
        bad = await http.get("/runs", params={"status": "bogus"})
        assert bad.status_code == 400
        assert "unknown status" in bad.text
        assert (await http.get("/runs", params={"limit": "x"})).status_code == 400
        assert (await http.get("/runs", params={"cursor": "junk"})).status_code == 400


async def test_paging_follows_the_cursor(world: dict[str, Any]) -> None:
    async with client(create_app(world["ops"])) as http:
        seen: list[str] = []
        url: str | None = "/runs?limit=1"
        while url is not None:
            page = await http.get(url)
            assert page.status_code == 200
            seen += [r for r in ("ok0", "ok1", "ok2", "bad") if f'href="/runs/{r}"' in page.text]
            marker = 'rel="next" href="'
            url = (
                page.text.split(marker, 1)[1].split('"', 1)[0].replace("&amp;", "&")
                if (marker in page.text)
                else None
            )
        assert sorted(seen) == ["bad", "ok0", "ok1", "ok2"]


async def test_the_run_page_shows_the_history_and_the_error(world: dict[str, Any]) -> None:
    async with client(create_app(world["ops"])) as http:
        page = await http.get("/runs/bad")
        assert page.status_code == 200
        assert "card declined for order bad" in page.text
        assert "attempt 2" in page.text
        assert "charge" in page.text
        assert 'data-action="retry"' in page.text
        assert " disabled" in page.text
        assert (await http.get("/runs/nope")).status_code == 404


async def test_an_address_the_console_does_not_have_is_its_own_not_found_page(
    world: dict[str, Any],
) -> None:
    """`/nosuchpage` answered Starlette's bare text "Not Found": now the console's page, with
    its links (and under /api, its JSON reply)."""
    async with client(create_app(world["ops"])) as http:
        page = await http.get("/nosuchpage")
        assert page.status_code == 404
        assert page.headers["content-type"].startswith("text/html")
        assert "the console has no page at /nosuchpage" in page.text
        assert 'href="/runs"' in page.text
        api = await http.post("/api/runs/nope", json={})
        assert api.status_code == 404
        assert api.json() == {"ok": False, "message": "no such action: /api/runs/nope"}


async def test_the_run_page_shows_each_attempts_worker_error_and_duration(
    world: dict[str, Any],
) -> None:
    details = await world["ops"].show_run("bad")
    (step,) = details.steps
    assert [(a.attempt, a.status, a.worker) for a in step.attempts] == [
        (1, "failed", "worker-a"),
        (2, "failed", "worker-a"),
    ]
    async with client(create_app(world["ops"])) as http:
        page = await http.get("/runs/bad")
    rows = page.text.split('<tr class="attempt">')[1:]
    assert len(rows) == 2
    for n, row in enumerate(rows, 1):
        assert f"attempt {n}" in row
        assert "worker-a" in row
        assert "ValueError: card declined for order bad" in row
        assert "badge-failed" in row


async def test_actions_are_refused_unless_allowed(world: dict[str, Any]) -> None:
    async with client(create_app(world["ops"])) as http:
        refused = await http.post("/api/runs/retry", json={"run_id": "bad"}, headers=ACTION)
        assert refused.status_code == 403
        assert "--allow-actions" in refused.json()["message"]
    async with client(create_app(world["ops"], allow_actions=True)) as http:
        no_header = await http.post("/api/runs/retry", json={"run_id": "bad"})
        assert no_header.status_code == 403
        cross = await http.post(
            "/api/runs/retry",
            json={"run_id": "bad"},
            headers={**ACTION, "Origin": "http://evil.example"},
        )
        assert cross.status_code == 403
        assert (await http.post("/api/runs/retry", content=b"{", headers=ACTION)).status_code == 400
        assert (await http.post("/api/runs/retry", json={}, headers=ACTION)).status_code == 400
        done = await http.post("/api/runs/retry", json={"run_id": "ok0"}, headers=ACTION)
        assert done.status_code == 409
        unknown = await http.post("/api/runs/retry", json={"run_id": "zz"}, headers=ACTION)
        assert unknown.status_code == 404
        assert (await http.get("/api/runs/retry")).status_code == 405


async def test_an_action_the_backend_cannot_answer_is_a_503(
    world: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis down: a cancel from the console answered 409 (a conflict: not worth retrying)
    where the pages answer 503. Unavailable is 503, with the backend's message."""

    async def down(*args: Any, **kwargs: Any) -> bool:
        raise dt.BrokerUnavailable("could not connect to 127.0.0.1:6390")

    monkeypatch.setattr(world["ops"], "cancel_run", down)
    async with client(create_app(world["ops"], allow_actions=True)) as http:
        reply = await http.post("/api/runs/cancel", json={"run_id": "bad"}, headers=ACTION)
    assert reply.status_code == 503
    assert reply.json() == {"ok": False, "message": "could not connect to 127.0.0.1:6390"}


async def test_retry_from_the_console_completes_the_failed_run(world: dict[str, Any]) -> None:
    world["declined"].clear()
    async with client(create_app(world["ops"], allow_actions=True)) as http:
        reply = await http.post("/api/runs/retry", json={"run_id": "bad"}, headers=ACTION)
        assert reply.status_code == 200
        assert reply.json()["ok"] is True
        assert await world["engine"].result("bad") == {"receipt": {"charged": 9}}
        page = await http.get("/runs/bad")
        assert "badge-completed" in page.text


async def test_cancel_from_the_console(world: dict[str, Any]) -> None:
    engine = world["engine"]
    async with client(create_app(world["ops"], allow_actions=True)) as http:
        ended = await http.post("/api/runs/cancel", json={"run_id": "ok1"}, headers=ACTION)
        assert ended.status_code == 200
        assert "already ended" in ended.json()["message"]
        await engine.start("order", {"id": "later", "amount": 1}, run_id="p", detach=True)
        reply = await http.post("/api/runs/cancel", json={"run_id": "p"}, headers=ACTION)
        assert reply.status_code == 200


async def test_workers_and_queues_pages(world: dict[str, Any]) -> None:
    async with client(create_app(world["ops"], allow_actions=True)) as http:
        workers = await http.get("/workers")
        assert workers.status_code == 200
        assert "Workers" in workers.text
        queues = await http.get("/queues")
        assert queues.status_code == 200
        assert "Set-aside jobs" in queues.text
        missing = await http.post(
            "/api/jobs/requeue", json={"queue": "shop:tasks:x", "job_id": "j"}, headers=ACTION
        )
        assert missing.status_code == 404
        gone = await http.post(
            "/api/jobs/delete", json={"queue": "shop:tasks:x", "job_id": "j"}, headers=ACTION
        )
        assert gone.status_code == 404


REFUND = "shop:tasks:refund"


async def test_set_aside_jobs_are_requeued_and_deleted_from_the_queues_page(
    world: dict[str, Any],
) -> None:
    """Real set-aside jobs (a worker stalled on them past the limit): the queues page shows
    them with their evidence; its Requeue puts one back (ready, with an age) and a worker runs
    it to completion; its Delete drops the other for good."""
    ops = world["ops"]
    backend = ops.backend
    async with dt.open_queue_transport(backend, namespace="shop") as producer:
        kept = await set_aside_by_stalls(backend.broker, producer, "refund", "kept")
        dropped = await set_aside_by_stalls(backend.broker, producer, "refund", "dropped")
    async with client(create_app(ops, allow_actions=True)) as http:
        page = (await http.get("/queues")).text
        assert f'data-job="{kept}"' in page
        assert f'data-job="{dropped}"' in page
        assert "stalled 2 times (max 1)" in page
        assert "attempts 1 · stalls 2" in page
        assert "w-dead" in page
        reply = await http.post(
            "/api/jobs/requeue", json={"queue": REFUND, "job_id": kept}, headers=ACTION
        )
        assert reply.status_code == 200
        assert reply.json()["ok"] is True
        again = await http.post(
            "/api/jobs/requeue", json={"queue": REFUND, "job_id": kept}, headers=ACTION
        )
        assert again.status_code == 404  # pending now, no longer set aside
        reply = await http.post(
            "/api/jobs/delete", json={"queue": REFUND, "job_id": dropped}, headers=ACTION
        )
        assert reply.status_code == 200
        await trio.sleep(2.0)
        page = (await http.get("/queues")).text
        assert "data-job=" not in page
        assert "no job is set aside" in page
        # ready 1, delayed 0, claimed 0, failed 0, no worker, waiting 2 s
        row = re.search(rf'<td class="mono">{REFUND}</td>(.*?)</tr>', page)
        assert row is not None
        cells = re.findall(r'<td class="num">([^<]*)</td>', row[1])
        assert cells[:5] == ["1", "0", "0", "0", "0"]
        # (2 s of the virtual clock, and what the world's engine and worker loops let pass)
        assert re.fullmatch(r"2\.\d\d s", cells[5]), cells[5]

    assert await serve_until_done(backend, "refund", "refunded") == ["kept"]
    stats = await backend.broker.queue_stats(REFUND)
    assert (stats.ready, stats.claimed, stats.failed) == (0, 0, 0)


async def test_the_token_is_checked_on_every_request(world: dict[str, Any]) -> None:
    token = "s3cret-token-0123456789"
    async with client(create_app(world["ops"], token=token)) as http:
        assert (await http.get("/runs")).status_code == 401
        assert (await http.get("/static/console.css")).status_code == 401
        assert (await http.get("/runs", params={"token": "wrong-token-000000"})).status_code == 401
        opened = await http.get("/runs", params={"token": token, "status": "failed"})
        assert opened.status_code == 303
        assert opened.headers["location"] == "/runs?status=failed"
        assert "HttpOnly" in opened.headers["set-cookie"]
        assert (await http.get("/runs")).status_code == 200  # the cookie now
    async with client(create_app(world["ops"], token=token)) as http:
        bearer = await http.get("/runs", headers={"Authorization": f"Bearer {token}"})
        assert bearer.status_code == 200


async def test_without_a_token_only_loopback_host_names_are_answered(
    world: dict[str, Any],
) -> None:
    async with client(create_app(world["ops"])) as http:
        assert (await http.get("/runs", headers={"Host": "evil.example"})).status_code == 421
        assert (await http.get("/runs", headers={"Host": "localhost:8080"})).status_code == 200
        assert (await http.get("/static/console.js")).status_code == 200


def test_beyond_loopback_a_token_is_required() -> None:
    check_exposure("127.0.0.1", None)
    check_exposure("::1", None)
    check_exposure("localhost", None)
    with pytest.raises(dt.ConfigError, match="--token"):
        check_exposure("0.0.0.0", None)
    with pytest.raises(dt.ConfigError, match="at least 16"):
        check_exposure("0.0.0.0", "short")
    check_exposure("0.0.0.0", "a-long-enough-token-123")


def test_the_cli_refuses_beyond_loopback_without_a_token(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from durable_trio.cli._main import main

    assert main(["console", "--backend", "memory://", "--host", "0.0.0.0"]) == 2
    assert "--token" in capsys.readouterr().err
    assert main(["console", "--backend", "memory://", "--token", "short"]) == 2
    assert "at least 16" in capsys.readouterr().err


@pytest.mark.postgres
async def test_the_console_over_postgres(postgres_schema_url: str) -> None:
    """The pages and actions over a real PostgreSQL backend (real time), beside an engine and a
    worker: the runs list, its filters and pages, a failed run's page, the workers, queues and
    schedules pages, and a retry and a cancel through the console's actions."""
    from durable_trio._engine._schedules import Schedules

    declined = {"bad"}
    app = dt.App("shop")

    @app.step("charge", retry=dt.Retry(max_attempts=2, initial=0.01, jitter=0))
    async def charge(order: dict[str, Any]) -> dict[str, Any]:
        if order["id"] in declined:
            raise ValueError(f"card declined for order {order['id']}")
        return {"charged": order["amount"]}

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, order: dict[str, Any]) -> dict[str, Any]:
        return {"receipt": await ctx.step("charge", order)}

    @app.workflow("approval")
    async def approval(ctx: dt.WorkflowContext, _: Any) -> Any:
        return await ctx.wait_signal("approve")

    async with (
        dt.open_backend(postgres_schema_url) as backend,
        dt.open_worker(app, backend, instance_id="worker-a"),
        dt.open_engine(app, backend, reconcile_interval=0.5) as engine,
        dt.open_operations(backend, namespace="shop") as ops,
        client(create_app(ops, allow_actions=True)) as http,
    ):
        with trio.fail_after(30):
            for i in range(2):
                await engine.start("order", {"id": f"ok{i}", "amount": i}, run_id=f"ok{i}")
                await engine.result(f"ok{i}")
            await engine.start("order", {"id": "bad", "amount": 9}, run_id="bad")
            with pytest.raises(dt.RunFailed):
                await engine.result("bad")
            await engine.start("approval", None, run_id="waits")
            page = (await http.get("/runs")).text
            assert all(f'href="/runs/{r}"' in page for r in ("ok0", "ok1", "bad", "waits"))
            failed = (await http.get("/runs", params={"status": "failed"})).text
            assert 'href="/runs/bad"' in failed
            assert 'href="/runs/ok0"' not in failed
            found = (await http.get("/runs", params={"q": "ok1"})).text
            assert 'href="/runs/ok1"' in found
            first = (await http.get("/runs", params={"limit": "1"})).text
            assert 'rel="next"' in first
            run = (await http.get("/runs/bad")).text
            assert "card declined for order bad" in run
            assert "attempt 2" in run
            assert "worker-a" in (await http.get("/workers")).text
            assert "Set-aside jobs" in (await http.get("/queues")).text
            schedules = Schedules(ops.store, ops.store.now)
            assert await schedules.add("often", "order", every=3600, input={"id": "s"})
            assert 'data-schedule="often">' in (await http.get("/schedules")).text

            declined.clear()
            retry = await http.post("/api/runs/retry", json={"run_id": "bad"}, headers=ACTION)
            assert retry.status_code == 200, retry.text
            assert await engine.result("bad") == {"receipt": {"charged": 9}}
            assert "badge-completed" in (await http.get("/runs/bad")).text
            cancel = await http.post("/api/runs/cancel", json={"run_id": "waits"}, headers=ACTION)
            assert cancel.status_code == 200, cancel.text
            with pytest.raises(dt.RunFailed):
                await engine.result("waits")
            assert await engine.status("waits") is dt.RunStatus.CANCELLED
