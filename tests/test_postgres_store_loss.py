"""A PostgreSQL store lost under running processes (a loss nobody would otherwise report): the
schema dropped and created again by another process's open, the tables dropped, a server
restarted without them. The store's identity (the ``store`` part's row) is checked at entry,
every ``store_check_interval`` and after the pool opens a connection; a loss is logged at ERROR
once, reported, recorded in the store and shown by health until an operator acknowledges it.
While the tables are missing, calls raise a ``StoreLost`` naming the schema, and nobody creates
them again behind the operator's back.

The private server; the real clock, with short intervals and tight bounds.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from _postgres_server import *  # noqa: F403
from durable_trio._transport._health import read_store_loss
from durable_trio.backends.postgres import open_postgres_backend
from durable_trio.brokers import Job
from durable_trio.brokers.postgres import PostgresBroker
from durable_trio.cli._health import HealthReader, _scrape, render_text
from helpers import Errors

if TYPE_CHECKING:
    from collections.abc import Callable

    from _postgres_server import PostgresServer

Q = "q"


async def eventually(condition: Callable[[], Any], within: float = 10.0) -> None:
    """Return once ``condition()`` (awaited if it is a coroutine) is true."""
    with trio.fail_after(within):
        while True:
            value = condition()
            if hasattr(value, "__await__"):
                value = await value
            if value:
                return
            await trio.sleep(0.02)


def losses(errors: Errors) -> list[dt.StoreLost]:
    return [e for e in errors.seen if isinstance(e, dt.StoreLost)]


def _schema() -> str:
    return f"l_{uuid.uuid4().hex[:12]}"


async def _sql(server: PostgresServer, query: str) -> list[tuple[Any, ...]]:
    return await trio.to_thread.run_sync(server.sql, query)


async def _identity(server: PostgresServer, schema: str) -> tuple[str, str | None]:
    ((identity, alarm),) = await _sql(
        server, f"SELECT identity, alarm FROM {schema}.durable_trio_store"
    )
    return identity, alarm


async def _open_again(url: str, schema: str) -> None:
    """Another process's open: its migrations create the schema again, empty."""
    async with open_postgres_backend(f"{url}?schema={schema}"):
        pass


async def test_a_schema_dropped_then_recreated_raises_the_alarm_once_until_acknowledged(
    postgres_url: str, postgres_server: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    schema = _schema()
    errors = Errors()
    caplog.set_level(logging.ERROR, logger="durable_trio.postgres")
    async with PostgresBroker.open(
        postgres_url, schema=schema, pool_size=2, store_check_interval=0.05, on_error=errors
    ) as broker:
        stamped, alarm = await _identity(postgres_server, schema)
        assert alarm is None
        await broker.push_on(Q, Job("1", b"{}"))
        await trio.sleep(0.3)  # a few checks: all is well, nothing reported
        assert broker.store_loss is None
        assert await broker.read_store_loss() is None
        assert errors.seen == []

        await _sql(postgres_server, f"DROP SCHEMA {schema} CASCADE")
        # A call says what happened (not the driver's "relation does not exist"), and pokes
        # the watch, which raises the alarm at once.
        with pytest.raises(dt.StoreLost, match=f"schema '{schema}' has no durable_trio tables"):
            await broker.size_of(Q)
        await eventually(lambda: losses(errors))
        (loss,) = losses(errors)
        assert (loss.lost, loss.found) == (stamped, None)
        assert "STORE LOST" in str(loss)
        assert "do not create the tables again" in str(loss)
        assert await broker.read_store_loss() is loss  # nowhere to record it yet: this one's
        with pytest.raises(dt.StoreLost):
            await broker.acknowledge_store_loss()
        await trio.sleep(0.3)  # more checks: no schema made again, the alarm reported once
        assert (await _sql(postgres_server, f"SELECT to_regnamespace('{schema}')")) == [(None,)]
        assert len(losses(errors)) == 1

        def logged() -> list[int]:
            return [r.levelno for r in caplog.records if "STORE LOST" in r.getMessage()]

        before = len(logged())
        await _open_again(postgres_url, schema)  # a new, empty schema: a new identity
        # (that opener reports the alarm too if the live broker recorded it before its entry
        # check, as any process started later does: 0 or 1 line of its own)
        theirs = len(logged()) - before
        assert theirs in (0, 1)
        # The live broker records its alarm in the new schema at its next check.
        await eventually(lambda: _recorded(postgres_server, schema))
        identity, _ = await _identity(postgres_server, schema)
        assert identity != stamped
        assert await broker.size_of(Q) == 0  # the store works again, empty
        await trio.sleep(0.3)
        assert len(losses(errors)) == 1
        assert logged() == [logging.ERROR] * (1 + theirs)  # the live broker's: once
        # Another process (health) reads it from the store.
        async with PostgresBroker.open(postgres_url, schema=schema, pool_size=1) as other:
            seen = await read_store_loss(dt.Backend(url="pg", broker=other))
            assert seen is not None
            assert (seen.lost, seen.detected_by) == (stamped, loss.detected_by)
            assert other.store_loss is not None  # found at its entry, reported there
            assert await other.acknowledge_store_loss()
            assert not await other.acknowledge_store_loss()
        await eventually(lambda: broker.store_loss is None)
        assert await broker.read_store_loss() is None
        assert (await _identity(postgres_server, schema))[1] is None
        assert len(losses(errors)) == 1


async def _recorded(server: PostgresServer, schema: str) -> bool:
    rows = await _sql(
        server,
        f"SELECT alarm FROM {schema}.durable_trio_store"
        if (await _sql(server, f"SELECT to_regclass('{schema}.durable_trio_store')"))[0][0]
        else "SELECT NULL",
    )
    return bool(rows and rows[0][0])


async def test_another_identity_found_after_a_reconnection(
    postgres_url: str, postgres_server: PostgresServer
) -> None:
    """The periodic check is far off (60 s): the schema dropped and made again by another
    process's open goes unnoticed by the calls (they work on the empty tables), until the pool
    reconnects (the server cut the connections) and the check that follows finds another
    identity."""
    schema = _schema()
    errors = Errors()
    async with PostgresBroker.open(
        postgres_url, schema=schema, pool_size=1, store_check_interval=60.0, on_error=errors
    ) as broker:
        stamped, _ = await _identity(postgres_server, schema)
        await broker.push_on(Q, Job("1", b"{}"))
        await _sql(postgres_server, f"DROP SCHEMA {schema} CASCADE")
        await _open_again(postgres_url, schema)
        identity, _ = await _identity(postgres_server, schema)
        assert await broker.size_of(Q) == 0  # the loss nobody reports: the job is gone
        assert errors.seen == []

        await _sql(
            postgres_server,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE pid <> pg_backend_pid() AND query LIKE '%{schema}%'",
        )
        with trio.fail_after(10):
            while True:  # the call that meets the cut connection fails; the next reconnects
                try:
                    await broker.pool.execute("SELECT 1")
                    break
                except dt.BrokerUnavailable:
                    await trio.sleep(0.05)
        await eventually(lambda: losses(errors))
        (loss,) = losses(errors)
        assert (loss.lost, loss.found) == (stamped, identity)
        assert "dropped and created again" in str(loss)
        assert (await _identity(postgres_server, schema))[1] is not None  # recorded
        assert (await broker.read_store_loss()) is not None


async def test_a_restart_with_the_schema_gone_is_found_after_the_reconnection_and_in_health(
    postgres_url: str, postgres_server: PostgresServer
) -> None:
    """The server restarted without the tables (dropped, then ``pg_ctl restart``: a database
    restored from nothing looks the same): the first connection after the restart starts a
    check, which finds them gone; the loops report a clear ``StoreLost``; health shows it;
    once the schema is made again the alarm is recorded in it."""
    schema = _schema()
    url = f"{postgres_url}?schema={schema}"
    errors = Errors()
    options: dict[str, Any] = {"poll_interval": 0.05, "stalled_check_interval": 0.5}
    async with (
        open_postgres_backend(url, store_check_interval=60.0, on_error=errors) as backend,
        dt.open_queue_transport(backend, namespace="lost", on_error=errors, **options) as engine,
        dt.open_queue_transport(backend, namespace="lost", concurrency=2, **options) as worker,
    ):

        async def work(task: dt.RemoteTask) -> str:
            return task.step_id

        done: list[str] = []

        async def on_result(result: dt.StepResult) -> None:
            done.append(result.step_id)

        worker.handle("work", work)
        engine.on_result(on_result)
        await engine.dispatch(dt.RemoteTask(run_id="r", step_id="s1", attempt=1, name="work"))
        await eventually(lambda: done)
        stamped, _ = await _identity(postgres_server, schema)
        assert await engine.health.store_loss() is None

        await _sql(postgres_server, f"DROP SCHEMA {schema} CASCADE")
        await trio.to_thread.run_sync(postgres_server.restart)
        # (a loop's call may meet the missing tables first: its StoreLost names no identity)
        await eventually(lambda: [e for e in losses(errors) if e.lost is not None])
        found = [e for e in losses(errors) if e.lost is not None]
        assert [(e.lost, e.found) for e in found] == [(stamped, None)]
        # What the loops meet names the schema, never the driver's bare error.
        assert not [e for e in errors.seen if "does not exist" in str(e) and not isinstance(
            e, dt.StoreLost
        )]  # fmt: skip
        loss = await engine.health.store_loss()
        assert loss is not None
        reader = HealthReader(backend, "lost")
        with pytest.raises(dt.StoreLost, match="has no durable_trio tables"):
            await reader.read()  # the worker keys' table is gone too: said as plainly
        assert reader.store_loss is not None  # read first
        assert render_text([], "lost", reader.store_loss).startswith("STORE LOST")
        assert (await _sql(postgres_server, f"SELECT to_regnamespace('{schema}')")) == [(None,)]

        # An operator brings the store back (another process's open, or durable-trio migrate):
        # the alarm is recorded in it, and the calls work again (the loops, once their error
        # backoff, up to 10 s, has run out: not waited for here).
        await _open_again(postgres_url, schema)
        await eventually(lambda: _recorded(postgres_server, schema))
        await engine.dispatch(dt.RemoteTask(run_id="r", step_id="s2", attempt=1, name="work"))
        assert [(e.lost, e.found) for e in losses(errors) if e.lost is not None] == [
            (stamped, None)
        ]
        reader = HealthReader(backend, "lost")
        await reader.read()
        assert reader.store_loss is not None
        assert "durable_trio_store_lost 1" in (await _scrape(reader)).decode()
        assert await backend.broker.acknowledge_store_loss()  # type: ignore[attr-defined]
        await eventually(lambda: _none(engine))


async def _none(engine: dt.QueueTransport) -> bool:
    return await engine.health.store_loss() is None
