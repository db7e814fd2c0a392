"""``dedup_key``, ``debounce`` and ``tags`` of ``durable_trio.postgres.start_workflow`` (issue
33, item 4), on the session's private server: the dedup key's row is written in the caller's
transaction (a rollback leaves none; a concurrent start with the key waits for the commit), and
a debounced start is one upsert in it (a rollback undoes the fold)."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import psycopg
import pytest
import trio

import durable_trio as dt
from durable_trio import postgres as dtpg
from durable_trio._engine import App, WorkflowContext, open_engine
from durable_trio._postgres import connect

pytestmark = pytest.mark.postgres

app = App("shop")


@app.workflow("ship")
async def ship(ctx: WorkflowContext, order: Any) -> Any:
    return order


async def _migrated(postgres_url: str) -> tuple[str, str]:
    schema = f"t_{uuid.uuid4().hex[:12]}"
    url = f"{postgres_url}?schema={schema}"
    async with dt.open_backend(url) as backend, backend.open_run_store("shop"):
        pass
    return schema, url


def _count(postgres_url: str, schema: str, table: str) -> int:
    with psycopg.connect(postgres_url) as conn:
        row = conn.execute(f"SELECT count(*) FROM {schema}.{table}".encode()).fetchone()
        assert row is not None
        return int(row[0])


async def test_a_dedup_key_is_written_in_the_callers_transaction(postgres_url: str) -> None:
    schema, url = await _migrated(postgres_url)

    def start(conn: psycopg.Connection[Any], order: Any, **extra: Any) -> str:
        return dtpg.start_workflow(conn, "ship", order, namespace="shop", schema=schema, **extra)

    def scenario() -> tuple[str, str, str]:
        with psycopg.connect(postgres_url) as conn:
            with conn.transaction(force_rollback=True):
                dropped = start(conn, 0, dedup_key="k")
                assert start(conn, 9, dedup_key="k") == dropped  # seen in its own transaction
            assert _count(postgres_url, schema, "run_dedup_keys") == 0  # rolled back: no row
            assert _count(postgres_url, schema, "runs") == 0
            # A concurrent start with the key waits for the first transaction's end.
            with conn.transaction():
                first = start(conn, 1, dedup_key="k", tags={"team": "ops"})
                waited: list[str] = []

                def other() -> None:
                    with psycopg.connect(postgres_url) as other_conn:
                        waited.append(start(other_conn, 2, dedup_key="k"))

                thread = threading.Thread(target=other)
                thread.start()
                thread.join(0.5)
                assert thread.is_alive()  # blocked on the key's row lock
            thread.join(10)
            assert waited == [first]  # the first committed: its unfinished run
            elsewhere = start(conn, 3, dedup_key="k", tags=None)
            conn.commit()
        return dropped, first, elsewhere

    dropped, first, again = await trio.to_thread.run_sync(scenario)
    assert again == first
    async with (
        dt.open_backend(url) as backend,
        dt.open_operations(backend, namespace="shop") as ops,
    ):
        assert await ops.store.get_run(dropped) is None
        run = await ops.store.get_run(first)
        assert run is not None
        assert (run.input, run.tags) == (1, {"team": "ops"})
        assert [r.run_id for r in (await ops.list_runs(tags={"team": "ops"})).runs] == [first]
        async with open_engine(app, backend) as engine:
            with trio.fail_after(30):
                assert await engine.result(first) == 1
        # Ended: the key makes a new run, on the trio driver's connection too.
        ours = await connect(postgres_url)
        try:
            async with ours.transaction():
                fresh = await dtpg.start_workflow_async(
                    ours, "ship", 4, namespace="shop", schema=schema, dedup_key="k"
                )
                again = await dtpg.start_workflow_async(
                    ours, "ship", 5, namespace="shop", schema=schema, dedup_key="k"
                )
        finally:
            ours.close()
        assert fresh == again != first
        stored = await ops.store.get_run(fresh)
        assert stored is not None
        assert stored.input == 4


async def test_a_debounced_start_folds_in_the_callers_transaction(postgres_url: str) -> None:
    schema, url = await _migrated(postgres_url)
    debounce = dt.Debounce(key="burst", delay=1)

    def start(conn: psycopg.Connection[Any], order: Any) -> str:
        return dtpg.start_workflow(
            conn, "ship", order, namespace="shop", schema=schema, debounce=debounce,
            tags={"n": str(order)},
        )  # fmt: skip

    def scenario() -> list[str]:
        with psycopg.connect(postgres_url) as conn:
            with conn.transaction(force_rollback=True):
                start(conn, 0)
            assert _count(postgres_url, schema, "run_debounced") == 0
            ids = []
            with conn.transaction():
                ids.append(start(conn, 1))
            with conn.transaction():
                ids.append(start(conn, 2))
            with conn.transaction(force_rollback=True):
                ids.append(start(conn, 3))  # undone: the window keeps input 2
        return ids

    ids = await trio.to_thread.run_sync(scenario)
    assert len(set(ids)) == 1
    async with dt.open_backend(url) as backend:
        async with open_engine(app, backend, reconcile_interval=0.2) as engine:
            with trio.fail_after(30):
                assert await engine.result(ids[0]) == 2
            run = await engine.get(ids[0])
            assert run.tags == {"n": "2"}
            assert len(await engine.list()) == 1


async def test_folding_arguments_are_checked_before_any_statement(postgres_url: str) -> None:
    schema, _ = await _migrated(postgres_url)
    debounce = dt.Debounce(key="k", delay=1)

    def scenario() -> None:
        with psycopg.connect(postgres_url) as conn:
            for extra, error, words in (
                ({"dedup_key": ""}, dt.ConfigError, "start_workflow: dedup_key must not be"),
                ({"dedup_key": "k", "debounce": debounce}, dt.ConfigError, "together"),
                ({"dedup_key": "k", "run_id": "r"}, dt.ConfigError, "give no run_id"),
                ({"debounce": "k"}, TypeError, r"debounce must be a dt\.Debounce"),
                ({"tags": {"": "x"}}, dt.ConfigError, "tags"),
            ):
                with pytest.raises(error, match=words):
                    dtpg.start_workflow(conn, "ship", namespace="shop", schema=schema, **extra)
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE

    await trio.to_thread.run_sync(scenario)


async def test_a_debounced_start_in_the_callers_transaction_rings_at_its_commit(
    postgres_url: str,
) -> None:
    """The engine re-reads pending starts every 10 minutes; a start debounced 1 s in the
    application's transaction is started at its due time (the DEBOUNCED wake, at the commit)."""
    schema, url = await _migrated(postgres_url)

    def commit() -> str:
        with psycopg.connect(postgres_url) as conn, conn.transaction():
            return dtpg.start_workflow(
                conn, "ship", 7, namespace="shop", schema=schema,
                debounce=dt.Debounce(key="rung", delay=1),
            )  # fmt: skip

    async with dt.open_backend(url) as backend:
        async with open_engine(app, backend, reconcile_interval=600) as engine:
            await trio.sleep(0.3)  # its first reads are done
            run_id = await trio.to_thread.run_sync(commit)
            with trio.fail_after(15):
                assert await engine.result(run_id) == 7
