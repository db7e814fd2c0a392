"""``dt.open_backend("postgresql://...")``: the URL's options, the parts it opens and migrates,
and a workflow end to end through an engine and a worker, on the session's private server."""

from __future__ import annotations

import uuid

import pytest
import trio

import durable_trio as dt
from durable_trio._engine import App, WorkflowContext, open_engine, open_worker
from durable_trio._postgres import open_pool
from durable_trio._postgres._migrations import schema_versions
from durable_trio.backends.postgres import postgres_options

pytestmark = pytest.mark.postgres

app = App("pg-backend")


@app.step("double")
async def double(value: int) -> int:
    return value * 2


@app.workflow("twice")
async def twice(ctx: WorkflowContext, value: int) -> int:
    for _ in range(2):
        value = await ctx.step("double", value)
    return value


def _schema() -> str:
    return f"b_{uuid.uuid4().hex[:12]}"


def test_the_url_names_libpqs_part_and_our_options() -> None:
    options = postgres_options("postgres://u:pw@h:5433/db?schema=shop&pool_size=3&sslmode=disable")
    assert options.conninfo == "postgresql://u:pw@h:5433/db?sslmode=disable"
    assert (options.schema, options.pool_size) == ("shop", 3)
    # a space stays a space for libpq (which reads "+" as a plus)
    spaced = postgres_options("postgresql://h/db?options=-c%20statement_timeout%3D5s&schema=s")
    assert spaced.conninfo == "postgresql://h/db?options=-c%20statement_timeout%3D5s"
    defaults = postgres_options("postgresql://h/db")
    assert (defaults.schema, defaults.pool_size) == ("durable_trio", 8)
    for bad, says in [
        ("postgresql://h/db?schema=Shop", "schema name"),
        ("postgresql://h/db?pool_size=0", "pool_size"),
        ("postgresql://h/db?pool_size=x", "pool_size"),
    ]:
        with pytest.raises(dt.ConfigError, match=says):
            postgres_options(bad)


async def test_an_unreachable_server_is_unavailable_and_its_password_unsaid() -> None:
    with pytest.raises(dt.BrokerUnavailable) as refused, trio.fail_after(30):
        async with dt.open_backend("postgresql://me:s3cret@127.0.0.1:1/db?connect_timeout=2"):
            pass
    assert "s3cret" not in str(refused.value)


async def test_open_migrates_every_part_and_a_workflow_runs_end_to_end(postgres_url: str) -> None:
    schema = _schema()
    url = f"{postgres_url}?schema={schema}"
    async with dt.open_backend(url) as backend:
        assert "***" not in backend.url or "@" in backend.url
        async with (
            open_worker(app, backend, namespace="shop"),
            open_engine(app, backend, namespace="shop") as engine,
        ):
            results = []
            for n in range(5):
                results.append(await engine.result(await engine.start("twice", n)))
            assert results == [0, 4, 8, 12, 16]
        assert await backend.run_stores.namespaces() == ["shop"]
    async with open_pool(postgres_url, size=1) as pool:
        versions = await schema_versions(pool, schema)
        assert versions == {"broker": 5, "keys": 1, "runs": 11, "store": 1}


async def test_a_run_started_detached_elsewhere_is_taken_at_once(postgres_url: str) -> None:
    """Two backends stand for two processes: the second starts a run detached and waits for it;
    the first process's engine takes it on the store's NOTIFY, not at its next reconcile."""
    url = f"{postgres_url}?schema={_schema()}"
    async with (
        dt.open_backend(url) as here,
        open_worker(app, here, namespace="shop"),
        open_engine(app, here, namespace="shop"),
        dt.open_backend(url) as there,
        open_engine(app, there, namespace="shop", reconcile=False) as caller,
    ):
        start = trio.current_time()
        run_id = await caller.start("twice", 21, detach=True)
        with trio.fail_after(10):
            assert await caller.result(run_id) == 84
        print(f"detached start -> result {1000 * (trio.current_time() - start):.1f} ms")


async def test_a_schema_newer_than_the_code_is_a_clear_error(postgres_url: str) -> None:
    schema = _schema()
    url = f"{postgres_url}?schema={schema}"
    async with dt.open_backend(url):
        pass
    async with open_pool(postgres_url, size=1) as pool:
        await pool.execute(
            f'UPDATE "{schema}".durable_trio_schema SET version = 99 WHERE part = $1', "broker"
        )
    with pytest.raises(dt.BrokerError, match="newer than this durable_trio knows"):
        async with dt.open_backend(url):
            pass
