"""``durable_trio.postgres``: a workflow start, or a job, written in the application's own
transaction (issue 32, item 3), on psycopg's blocking and asyncio connections and the project's
own driver, on the session's private server: it exists (and runs) if and only if the
application's write commits, and its wake is delivered at the commit only."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
import trio
from psycopg.rows import dict_row

import durable_trio as dt
from durable_trio import postgres as dtpg
from durable_trio._engine import App, WorkflowContext, open_engine, open_worker
from durable_trio._engine._stores._wakes import STARTS
from durable_trio._engine._stores.postgres import wake_payload, wakes_channel
from durable_trio._postgres import connect
from durable_trio.brokers import Job
from durable_trio.brokers.postgres import PostgresBroker, channel_for

pytestmark = pytest.mark.postgres

app = App("shop")


@app.step("double")
async def double(value: int) -> int:
    return value * 2


@app.workflow("ship")
async def ship(ctx: WorkflowContext, order: dict[str, Any]) -> int:
    doubled: int = await ctx.step("double", order["qty"])
    return doubled


def _schema() -> str:
    return f"t_{uuid.uuid4().hex[:12]}"


async def _migrated(postgres_url: str) -> tuple[str, str]:
    """A fresh schema with every part's tables (as an open makes them), and the backend URL."""
    schema = _schema()
    url = f"{postgres_url}?schema={schema}"
    async with dt.open_backend(url) as backend, backend.open_run_store("shop"):
        pass
    return schema, url


def _orders_table(postgres_url: str, schema: str) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {schema}.orders (id text PRIMARY KEY, qty int)".encode())


def _place_order(
    postgres_url: str, schema: str, order_id: str, qty: int, *, commit: bool
) -> tuple[str, list[tuple[str, str]]]:
    """The application's transaction: its order row and the run's start, committed or rolled
    back; returns the run id and the notifications a listener heard after it ended."""
    channel = wakes_channel(schema, "shop")
    with (
        psycopg.connect(postgres_url, autocommit=True) as listener,
        psycopg.connect(postgres_url) as conn,
    ):
        listener.execute(f'LISTEN "{channel}"'.encode())
        with conn.transaction(force_rollback=not commit):
            conn.execute(f"INSERT INTO {schema}.orders VALUES (%s, %s)".encode(), (order_id, qty))
            run_id = dtpg.start_workflow(
                conn, "ship", {"qty": qty}, namespace="shop", run_id=order_id, schema=schema
            )
            # Not yet: nothing is seen, nothing is notified, before the commit.
            assert not list(listener.notifies(timeout=0.2, stop_after=1))
        heard = [(n.channel, n.payload) for n in listener.notifies(timeout=2, stop_after=1)]
    return run_id, heard


async def test_a_start_in_a_committed_transaction_runs_at_once(postgres_url: str) -> None:
    schema, url = await _migrated(postgres_url)
    await trio.to_thread.run_sync(_orders_table, postgres_url, schema)
    async with (
        dt.open_backend(url) as backend,
        open_worker(app, backend),
        open_engine(app, backend) as engine,
    ):
        start = trio.current_time()
        run_id, heard = await trio.to_thread.run_sync(
            lambda: _place_order(postgres_url, schema, "o-1", 21, commit=True)
        )
        assert run_id == "o-1"
        assert heard == [(wakes_channel(schema, "shop"), wake_payload(STARTS))]
        with trio.fail_after(30):
            assert await engine.result(run_id) == 42
        print(f"commit -> result {1000 * (trio.current_time() - start):.1f} ms")
        run = await engine.get(run_id)
        assert run.workflow == "ship"
        assert run.input == {"qty": 21}
        assert run.parent is None


async def test_a_start_in_a_rolled_back_transaction_leaves_nothing(postgres_url: str) -> None:
    schema, url = await _migrated(postgres_url)
    await trio.to_thread.run_sync(_orders_table, postgres_url, schema)
    run_id, heard = await trio.to_thread.run_sync(
        lambda: _place_order(postgres_url, schema, "o-2", 1, commit=False)
    )
    assert heard == []
    async with dt.open_backend(url) as backend, backend.open_run_store("shop") as store:
        assert await store.get_run(run_id) is None
        assert await store.count_runs() == {}
        async with open_worker(app, backend), open_engine(app, backend):
            pass  # its reconcile at open found nothing to take
        assert await store.count_runs() == {}


async def test_a_start_is_stored_as_a_detached_start_and_is_idempotent(postgres_url: str) -> None:
    schema, url = await _migrated(postgres_url)

    def start_twice() -> tuple[str, str, str]:
        # (the application's own row factory: the calls read tuples whatever it is)
        with psycopg.connect(postgres_url, row_factory=dict_row) as conn:
            first = dtpg.start_workflow(
                conn, "ship", {"qty": 1}, namespace="shop", timeout=60, schema=schema
            )
            again = dtpg.start_workflow(conn, "ship", {"qty": 9}, namespace="shop",
                                        run_id=first, schema=schema)  # fmt: skip
            conn.commit()
            with pytest.raises(dt.EngineError, match="exists as a run of 'ship'"):
                dtpg.start_workflow(conn, "other", namespace="shop", run_id=first, schema=schema)
            conn.rollback()
            uncommitted = dtpg.start_workflow(conn, "ship", namespace="shop", schema=schema)
            conn.close()  # (the application's process died before its commit)
            return first, again, uncommitted

    first, again, uncommitted = await trio.to_thread.run_sync(start_twice)
    assert again == first
    async with dt.open_backend(url) as backend, backend.open_run_store("shop") as store:
        run = await store.get_run(first)
        assert run is not None
        assert (run.status, run.owner, run.lease_until) == (dt.RunStatus.PENDING, None, None)
        assert (run.input, run.timeout, run.depth) == ({"qty": 1}, 60.0, 0)
        assert await store.get_run(uncommitted) is None


async def test_an_asyncio_connection_and_the_trio_driver_write_in_their_transaction(
    postgres_url: str,
) -> None:
    schema, url = await _migrated(postgres_url)

    async def on_asyncio() -> tuple[str, str]:
        conn = await psycopg.AsyncConnection.connect(postgres_url)
        async with conn:
            async with conn.transaction():
                kept = await dtpg.start_workflow_async(conn, "ship", {"qty": 2},
                                                       namespace="shop", schema=schema)  # fmt: skip
            async with conn.transaction(force_rollback=True):
                dropped = await dtpg.start_workflow_async(
                    conn, "ship", {"qty": 3}, namespace="shop", schema=schema
                )
        return kept, dropped

    kept, dropped = await trio.to_thread.run_sync(lambda: asyncio.run(on_asyncio()))

    ours = await connect(postgres_url)
    try:
        async with ours.transaction():
            kept_here = await dtpg.start_workflow_async(
                ours, "ship", {"qty": 4}, namespace="shop", schema=schema
            )
        dropped_here = ""

        async def failing_transaction() -> None:
            nonlocal dropped_here
            async with ours.transaction():
                dropped_here = await dtpg.start_workflow_async(
                    ours, "ship", {"qty": 5}, namespace="shop", schema=schema
                )
                raise LookupError("the application's own failure")

        with pytest.raises(LookupError):
            await failing_transaction()
    finally:
        ours.close()

    async with (
        dt.open_backend(url) as backend,
        open_worker(app, backend),
        open_engine(app, backend) as engine,
    ):
        with trio.fail_after(30):
            assert await engine.result(kept) == 4
            assert await engine.result(kept_here) == 8
        for run_id in (dropped, dropped_here):
            with pytest.raises(dt.RunNotFound):
                await engine.get(run_id)


async def test_a_job_is_pushed_if_and_only_if_the_transaction_commits(postgres_url: str) -> None:
    schema, url = await _migrated(postgres_url)
    queue = "shop:mail"

    def push(job_id: str, *, commit: bool) -> list[str]:
        with (
            psycopg.connect(postgres_url, autocommit=True) as listener,
            psycopg.connect(postgres_url) as conn,
        ):
            listener.execute(f'LISTEN "{channel_for(schema, queue)}"'.encode())
            with conn.transaction(force_rollback=not commit):
                dtpg.push_job(conn, queue, Job(job_id, b'{"to": "a@b"}'), priority=3,
                              schema=schema)  # fmt: skip
            return [n.channel for n in listener.notifies(timeout=1, stop_after=1)]

    assert await trio.to_thread.run_sync(lambda: push("j-dropped", commit=False)) == []
    assert await trio.to_thread.run_sync(lambda: push("j-kept", commit=True)) == [
        channel_for(schema, queue)
    ]

    async def on_asyncio() -> None:
        async with await psycopg.AsyncConnection.connect(postgres_url) as conn:
            await dtpg.push_job_async(conn, queue, Job("j-async", b"{}"), schema=schema)

    await trio.to_thread.run_sync(lambda: asyncio.run(on_asyncio()))
    async with dt.open_backend(url) as backend:
        broker = backend.broker
        assert isinstance(broker, PostgresBroker)
        with trio.fail_after(10):
            await broker.wait_for_work(queue)
        claimed = await broker.pop_many(queue, 10)
        assert [(c.id, c.data, c.priority) for c in claimed] == [
            ("j-async", b"{}", 0),  # priority 0 pops before 3
            ("j-kept", b'{"to": "a@b"}', 3),
        ]


async def test_missing_tables_and_bad_arguments_are_clear_errors(postgres_url: str) -> None:
    def attempts() -> None:
        with psycopg.connect(postgres_url) as conn:
            with pytest.raises(dt.ConfigError, match="durable-trio migrate"):
                dtpg.start_workflow(conn, "ship", namespace="shop", schema="nowhere")
            conn.rollback()
            with pytest.raises(dt.ConfigError, match="durable-trio migrate"):
                dtpg.push_job(conn, "q", Job("1", b""), schema="nowhere")
            conn.rollback()
            with pytest.raises(dt.ConfigError, match="schema name"):
                dtpg.start_workflow(conn, "ship", namespace="shop", schema="No Such")
            with pytest.raises(dt.ConfigError, match="namespace must not be empty"):
                dtpg.start_workflow(conn, "ship", namespace="")
            with pytest.raises(dt.PayloadError):
                dtpg.start_workflow(conn, "ship", float("nan"), namespace="shop")
            with pytest.raises(TypeError, match="AsyncConnection"):
                dtpg.start_workflow(object(), "ship", namespace="shop")  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="job"):
                dtpg.push_job(conn, "q", ("1", b""))  # type: ignore[arg-type]

    await trio.to_thread.run_sync(attempts)
    with pytest.raises(TypeError, match=r"blocking psycopg\.Connection"):
        await dtpg.start_workflow_async(object(), "ship", namespace="shop")  # type: ignore[arg-type]
