"""The namespace the operator's commands read when none is named: the only one the backend
holds, else ``durable`` (none yet), else one line naming them (docs/operations.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import trio

import durable_trio as dt
from durable_trio._ops import discover_namespace
from durable_trio.cli._main import main

if TYPE_CHECKING:
    from pathlib import Path


async def _add_run(url: str, namespace: str, run_id: str) -> None:
    async with dt.open_backend(url) as backend, backend.open_run_store(namespace) as store:
        await store.create_run(dt.RunRecord(run_id, "order", None, dt.RunStatus.PENDING, 0.0, 0.0))


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_the_commands_read_the_only_namespace_and_name_several(
    kind: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    monkeypatch.delenv("DURABLE_TRIO_NAMESPACE", raising=False)
    url = f"sqlite:///{tmp_path / 'ns.db'}"
    if kind == "postgres":  # a fresh schema
        url = str(request.getfixturevalue("postgres_schema_url"))

    async def cli(*argv: str) -> tuple[int, str, str]:
        return await trio.to_thread.run_sync(lambda: _cli(capsys, *argv, "--backend", url))

    async with dt.open_backend(url):
        pass  # the file exists, with no run in it (a worker made it)
    status, out, err = await cli("runs", "list")
    assert (status, out, err) == (0, "no runs\n", "")

    await _add_run(url, "shop", "r1")  # what `durable-trio run app:app ...` of App('shop') does
    status, out, err = await cli("runs", "list")
    assert status == 0, err
    assert "r1" in out
    status, out, _ = await cli("runs", "show", "r1")
    assert status == 0
    assert "order" in out
    status, out, _ = await cli("schedules", "list")
    assert status == 0
    status, out, _ = await cli("health")
    assert status == 0
    assert "'shop'" in out

    await _add_run(url, "billing", "r2")
    status, out, err = await cli("runs", "list")
    assert status == 2
    assert out == ""
    assert err == (
        "error: this backend holds 2 namespaces ('billing', 'shop'): pick one with "
        "--namespace NAME (or --app MODULE:app, or $DURABLE_TRIO_NAMESPACE)\n"
    )
    status, out, _ = await cli("runs", "list", "--namespace", "billing")
    assert status == 0
    assert "r2" in out
    monkeypatch.setenv("DURABLE_TRIO_NAMESPACE", "shop")
    status, out, _ = await cli("runs", "list")
    assert status == 0
    assert "r1" in out


async def test_memory_backends_list_their_namespaces(autojump_clock: object) -> None:
    async with dt.open_backend("memory://") as backend:
        assert await discover_namespace(backend) is None
        async with backend.open_run_store("empty"):
            pass  # opened, never written: not a namespace anyone ran anything in
        assert await discover_namespace(backend) is None
        async with backend.open_run_store("shop") as store:
            await store.put_schedule("nightly", '{"workflow": "w"}', replace=False)
        assert await discover_namespace(backend) == "shop"


@pytest.mark.redis
async def test_redis_lists_its_namespaces(redis_url: str) -> None:
    await _add_run(redis_url, "shop", "r1")
    await _add_run(redis_url, "a:b", "r2")  # a colon inside a namespace survives the parse
    async with dt.open_backend(redis_url) as backend:
        assert await backend.run_stores.namespaces() == ["a:b", "shop"]


@pytest.mark.postgres
async def test_postgres_lists_its_namespaces(postgres_schema_url: str) -> None:
    await _add_run(postgres_schema_url, "shop", "r1")
    await _add_run(postgres_schema_url, "a:b", "r2")
    async with dt.open_backend(postgres_schema_url) as backend:
        async with backend.open_run_store("reports") as store:
            await store.put_schedule("nightly", '{"workflow": "w"}', replace=False)
        assert await backend.run_stores.namespaces() == ["a:b", "reports", "shop"]


@pytest.mark.redis
async def test_a_redis_cluster_lists_its_namespaces(redis_cluster_url: str) -> None:
    for index in range(20):  # runs over the run shards, so over every master
        await _add_run(redis_cluster_url, "shop", f"r{index}")
    async with dt.open_backend(redis_cluster_url) as backend:
        assert await discover_namespace(backend) == "shop"
