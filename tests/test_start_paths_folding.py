"""``dedup_key``, ``debounce`` and ``tags`` on the start paths other than ``engine.start``
(issue 33, item 4): ``Operations.start_run`` on every run store (exact virtual time), the
console's start action, and ``durable-trio run``."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio
import trio.testing

import durable_trio as dt
from _every_store import open_store
from durable_trio._engine import App, RunStatus, WorkflowContext, open_engine
from durable_trio.cli._main import main
from durable_trio.console import create_app

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

ACTION = {"X-Durable-Console": "action"}


def inbox() -> App:
    app = App("folding")

    @app.workflow("digest")
    async def digest(ctx: WorkflowContext, item: Any) -> list[Any]:
        return [item, trio.current_time()]

    @app.workflow("slow")
    async def slow(ctx: WorkflowContext, item: Any) -> Any:
        await ctx.sleep(10)
        return item

    return app


@asynccontextmanager
async def operations(backend: dt.Backend) -> AsyncIterator[dt.Operations]:
    async with dt.open_operations(backend, namespace="folding") as ops:
        follow = getattr(ops.store, "follow_trio_clock", None)
        if follow is not None:
            follow()
        yield ops


async def test_ops_start_run_dedups_debounces_and_tags(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = inbox()
    async with open_store(every_store, app.name) as (backend, store), operations(backend) as ops:
        t0 = trio.current_time()
        # Debounced by the operator, no engine up: one pending start, the latest input wins.
        debounce = dt.Debounce(key="user-7", delay=5)
        first = await ops.start_run("digest", 1, debounce=debounce, tags={"who": "a"})
        await trio.sleep(3)
        second = await ops.start_run("digest", 2, debounce=debounce, tags={"who": "b"})
        assert first == second
        with pytest.raises(dt.RunNotFound):
            await ops.show_run(first)  # not a run before it is due
        # Deduped: the first start's run, while it is unfinished.
        deduped = await ops.start_run("slow", "x", dedup_key="k", tags={"team": "ops"})
        assert await ops.start_run("slow", "y", dedup_key="k") == deduped
        assert await ops.start_run("digest", "z", dedup_key="k") != deduped  # its workflow's
        async with open_engine(app, backend, store=store) as engine:
            # An engine's start with the key folds into the operator's pending start.
            assert await engine.start("digest", 3, debounce=debounce) == first
            assert await engine.result(first) == [3, t0 + 8]  # 5 s after the last start
            run = await engine.get(first)
            assert run.tags == {}  # the latest start's (none given)
            assert await engine.result(deduped) == "x"
            assert trio.current_time() == t0 + 13
            assert (await engine.get(deduped)).tags == {"team": "ops"}
            tagged = await ops.list_runs(tags={"team": "ops"})
            assert [r.run_id for r in tagged.runs] == [deduped]
            # Ended: the key makes a new run.
            fresh = await ops.start_run("slow", "w", dedup_key="k")
            assert fresh != deduped
            assert await engine.result(fresh) == "w"
            assert (await engine.get(fresh)).status is RunStatus.COMPLETED


async def test_ops_start_run_checks_like_engine_start() -> None:
    async with dt.open_backend("memory://") as backend, operations(backend) as ops:
        debounce = dt.Debounce(key="k", delay=1)
        with pytest.raises(dt.ConfigError, match=r"ops\.start_run: dedup_key must not be empty"):
            await ops.start_run("digest", dedup_key="")
        with pytest.raises(TypeError, match=r"ops\.start_run: debounce must be a dt\.Debounce"):
            await ops.start_run("digest", debounce="k")  # type: ignore[arg-type]
        with pytest.raises(dt.ConfigError, match="together"):
            await ops.start_run("digest", dedup_key="k", debounce=debounce)
        with pytest.raises(dt.ConfigError, match="give no run_id"):
            await ops.start_run("digest", run_id="r", debounce=debounce)
        with pytest.raises(dt.ConfigError, match="give no run_id"):
            await ops.start_run("digest", run_id="r", dedup_key="k")
        assert await ops.store.list_runs() == []


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


async def test_the_console_starts_with_a_dedup_key_a_debounce_and_tags(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = inbox()
    async with dt.open_backend("memory://") as backend, operations(backend) as ops:
        async with client(create_app(ops, allow_actions=True)) as http:
            runs = (await http.get("/runs")).text
            for field in ("tags", "dedup_key", "debounce_key", "debounce_delay"):
                assert f'name="{field}"' in runs

            async def start(**body: str) -> httpx.Response:
                return await http.post(
                    "/api/runs/start", json={"workflow": "slow", **body}, headers=ACTION
                )

            one = await start(input='"a"', dedup_key="nightly", tags="team=ops, env=prod")
            assert one.status_code == 200, one.text
            first = one.json()["location"].rsplit("/", 1)[1]
            two = await start(input='"b"', dedup_key="nightly")
            assert two.json()["location"] == f"/runs/{first}"
            run = await ops.store.get_run(first)
            assert run is not None
            assert run.input == "a"
            assert run.tags == {"env": "prod", "team": "ops"}
            folded = [
                await start(input=str(n), debounce_key="burst", debounce_delay="2")
                for n in range(3)
            ]
            assert all(r.status_code == 200 for r in folded), folded[0].text
            assert "folded into run" in folded[0].json()["message"]
            for body, words in (
                ({"debounce_key": "b"}, "delay must be a finite number"),
                ({"debounce_key": "b", "debounce_delay": "x"}, "could not convert"),
                ({"tags": "nokey"}, "KEY=VALUE"),
                ({"dedup_key": "k", "run_id": "r"}, "give no run_id"),
            ):
                bad = await start(input="1", **body)
                assert bad.status_code == 400, (body, bad.text)
                assert words in bad.json()["message"]
        t0 = trio.current_time()
        async with open_engine(app, backend, store=ops.store) as engine:
            assert await engine.result(first) == "a"
            digests = await engine.list(workflow="slow")
            assert len(digests) == 2  # the deduped one and the debounced one
            debounced = next(r for r in digests if r.run_id != first)
            assert await engine.result(debounced.run_id) == 2  # the latest input
            assert trio.current_time() == t0 + 12  # due at 2, then its 10 s


def test_durable_trio_run_takes_a_dedup_key_a_debounce_and_tags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "folding_app.py").write_text(
        "import durable_trio as dt\n"
        "app = dt.App('folding')\n"
        "@app.workflow('slow')\n"
        "async def slow(ctx, item):\n"
        "    await ctx.sleep(3600)\n"
        "    return item\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    url = f"sqlite:///{tmp_path / 'runs.db'}".replace("///", "////", 1)
    base = ["run", "folding_app:app", "slow", "--backend", url, "--detach"]

    def run(*extra: str) -> dict[str, Any]:
        assert main([*base, *extra]) == 0
        out: dict[str, Any] = json.loads(capsys.readouterr().out)
        return out

    first = run("--input", '"a"', "--dedup-key", "k", "--tag", "team=ops")
    assert run("--input", '"b"', "--dedup-key", "k")["runId"] == first["runId"]
    folded = run("--debounce", "burst", "--debounce-delay", "5")
    assert run("--debounce", "burst", "--debounce-delay", "5")["runId"] == folded["runId"]
    assert folded["runId"] != first["runId"]
    assert main(["run", "folding_app:app", "slow", "--backend", url, "--debounce", "b"]) == 2
    assert "--debounce needs --detach" in capsys.readouterr().err
    assert main([*base, "--debounce", "b"]) == 2
    assert "--debounce-delay" in capsys.readouterr().err
    assert main([*base, "--dedup-key", "k", "--run-id", "r"]) == 2
    assert "give no run_id" in capsys.readouterr().err

    async def check() -> None:
        async with dt.open_backend(url) as backend, operations(backend) as ops:
            run = await ops.store.get_run(first["runId"])
            assert run is not None
            assert run.input == "a"
            assert run.tags == {"team": "ops"}
            assert len(await ops.store.list_runs()) == 1  # the debounced one is not due yet

    trio.run(check)
