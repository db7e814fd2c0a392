"""``durable-trio runs list --tag`` and ``runs cancel|retry`` by filter (issue 34, items 2 and
3) on the stores a CLI shares with live processes: SQLite, Redis (a single server, and a
Cluster's run shards), PostgreSQL."""

from __future__ import annotations

import builtins
import json
import sys
import uuid
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from durable_trio.cli._main import main

if TYPE_CHECKING:
    from pathlib import Path


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


async def _populate(url: str, ns: str) -> None:
    async with dt.open_operations(url, namespace=ns) as ops:
        for n in range(3):
            await ops.start_run("order", n, run_id=f"c1-{n}", tags={"customer": "c1"})
            await ops.start_run("order", n, run_id=f"c2-{n}", tags={"customer": "c2", "vip": "y"})
        for n in range(2):
            await ops.start_run("refund", n, run_id=f"f{n}", tags={"customer": "c2"})
            await ops.store.finish_run(f"f{n}", dt.RunStatus.FAILED, error={"type": "Boom"})


async def _bulk_commands(
    url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = f"bulk{uuid.uuid4().hex[:6]}"
    await _populate(url, ns)
    common = ["--backend", url, "--namespace", ns]

    async def run(*argv: str) -> tuple[int, str, str]:
        return await trio.to_thread.run_sync(lambda: _cli(capsys, *argv, *common))

    status, out, _ = await run("runs", "list", "--tag", "customer=c1", "--json")
    assert status == 0
    assert [r["runId"] for r in json.loads(out)["runs"]] == ["c1-2", "c1-1", "c1-0"]
    assert json.loads(out)["runs"][0]["tags"] == {"customer": "c1"}
    status, out, _ = await run("runs", "list", "--tag", "customer=c2", "--tag", "vip=y")
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["c2-2", "c2-1", "c2-0"]
    status, out, _ = await run("runs", "show", "c2-0")
    assert "tags   customer=c2 vip=y" in out
    status, _, err = await run("runs", "list", "--tag", "customer")
    assert (status, err) == (2, "error: --tag: a tag filter is KEY=VALUE, got 'customer'\n")

    # No terminal to ask on and no --yes: the count, then a refusal (exit status 2).
    status, out, err = await run("runs", "cancel", "--tag", "customer=c1")
    assert status == 2
    assert out == "3 runs match (tag customer=c1)\n"
    assert "stdin is not a terminal" in err
    assert "--yes" in err
    status, out, _ = await run("runs", "cancel", "--tag", "customer=c1", "--dry-run")
    assert status == 0
    assert out.splitlines() == [
        "3 runs match (tag customer=c1)",
        "would cancel: c1-2 (order, was pending)",
        "would cancel: c1-1 (order, was pending)",
        "would cancel: c1-0 (order, was pending)",
        "would cancel: 3, skipped: 0",
    ]
    # On a terminal: asked; "n" does nothing (exit status 1), "y" does it.
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    answers = iter(["n", "y"])
    prompts: list[str] = []

    def answer(prompt: str) -> str:
        prompts.append(prompt)
        return next(answers)

    monkeypatch.setattr(builtins, "input", answer)
    status, out, _ = await run("runs", "cancel", "--tag", "customer=c1")
    assert (status, out.splitlines()[-1]) == (1, "nothing done")
    status, out, _ = await run("runs", "cancel", "--tag", "customer=c1")
    assert status == 0
    assert prompts == ["cancel these 3 runs? [y/N] "] * 2
    assert out.splitlines()[1:] == [
        "cancelled: c1-2 (order, was pending)",
        "cancelled: c1-1 (order, was pending)",
        "cancelled: c1-0 (order, was pending)",
        "done: 3, skipped: 0",
    ]
    # Again (an interrupted bulk run again): every one already ended, skipped.
    status, out, _ = await run("runs", "cancel", "--tag", "customer=c1", "--yes")
    assert status == 0
    assert out.splitlines()[-1] == "done: 0, skipped: 3"

    status, out, _ = await run(
        "runs", "retry", "--status", "failed", "--tag", "customer=c2", "--yes", "--json"
    )
    assert status == 0
    data: Any = json.loads(out)
    assert data["filter"] == {"status": "failed", "tags": {"customer": "c2"}}
    assert (data["matched"], data["done"]) == (2, 2)
    assert [r["note"] for r in data["runs"]] == ["reopened", "reopened"]
    status, out, _ = await run("runs", "retry", "--status", "failed", "--yes")
    assert (status, out) == (0, "0 runs match (status failed)\n")

    status, _, err = await run("runs", "cancel", "c2-0", "--status", "pending")
    assert (status, "not both" in err) == (2, True)
    status, _, err = await run("runs", "retry")
    assert (status, "say which runs" in err) == (2, True)


async def test_bulk_commands_on_sqlite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    await _bulk_commands(f"sqlite:///{tmp_path / 'cli.db'}", capsys, monkeypatch)


@pytest.mark.redis
async def test_bulk_commands_on_redis(
    redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    await _bulk_commands(redis_url, capsys, monkeypatch)


@pytest.mark.redis
async def test_bulk_commands_on_a_redis_cluster(
    redis_cluster_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run shards of a Cluster: each keeps its own tag indexes, the pages merge them."""
    await _bulk_commands(redis_cluster_url, capsys, monkeypatch)


@pytest.mark.postgres
async def test_bulk_commands_on_postgres(
    postgres_schema_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    await _bulk_commands(postgres_schema_url, capsys, monkeypatch)
