"""Writes of many tasks coalesced into one round trip, each its own transaction
(``PgConnection.pipeline_each``, ``WriteBatcher``; issue 32), against the private server.

The real clock throughout (socket waits are not idle time)."""

from __future__ import annotations

import uuid

import pytest
import trio

from _postgres_server import *  # noqa: F403  (the private server fixture)
from durable_trio._errors import BrokerUnavailable
from durable_trio._postgres import (
    PostgresCommandTimeout,
    PostgresError,
    WriteBatcher,
    connect,
    open_pool,
)

pytestmark = pytest.mark.postgres


def _table() -> str:
    return f"batch_{uuid.uuid4().hex[:10]}"


async def _make(url: str, table: str) -> None:
    conn = await connect(url)
    try:
        await conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    finally:
        conn.close()


async def _ids(url: str, table: str) -> list[int]:
    conn = await connect(url)
    try:
        return sorted(int(row[0]) for row in await conn.fetch(f"SELECT id FROM {table}"))
    finally:
        conn.close()


async def test_pipeline_each_isolates_a_failing_write(postgres_url: str) -> None:
    table = _table()
    await _make(postgres_url, table)
    insert = f"INSERT INTO {table} VALUES ($1)"
    conn = await connect(postgres_url)
    try:
        answers = await conn.pipeline_each(
            [
                [(insert, (1,)), (f"SELECT count(*) FROM {table}", ())],
                [(insert, (2,)), (insert, (2,)), (insert, (3,))],  # fails: none of it commits
                [(insert, (4,))],
            ]
        )
        assert conn.idle
    finally:
        conn.close()
    first, failed, last = answers
    assert isinstance(first, list)
    assert first[1].rows == [(1,)]
    assert isinstance(failed, PostgresError)
    assert failed.index == 1
    assert isinstance(last, list)
    assert last[0].rowcount == 1
    assert await _ids(postgres_url, table) == [1, 4]


async def test_pipeline_each_timed_out_is_drained_to_its_last_sync(postgres_url: str) -> None:
    table = _table()
    await _make(postgres_url, table)
    insert = f"INSERT INTO {table} VALUES ($1)"
    conn = await connect(postgres_url)
    try:
        with pytest.raises(PostgresCommandTimeout):
            await conn.pipeline_each(
                [[(insert, (1,))], [("SELECT pg_sleep(30)", ())], [(insert, (2,))]],
                command_timeout=0.3,
            )
        assert conn.idle
        assert conn.stats.recovered == 1
        assert await conn.fetchval("SELECT 7") == 7
    finally:
        conn.close()
    assert await _ids(postgres_url, table) == [1, 2]  # the cancel hit only the sleeping one


async def test_batcher_coalesces_and_isolates(postgres_url: str) -> None:
    table = _table()
    await _make(postgres_url, table)
    insert = f"INSERT INTO {table} VALUES ($1)"
    async with open_pool(postgres_url, size=2) as pool:
        batcher = WriteBatcher(pool, senders=1)
        outcomes: dict[int, object] = {}

        async def one(n: int) -> None:
            try:
                outcomes[n] = (await batcher.write([(insert, (n % 30,))]))[0].rowcount
            except PostgresError as exc:
                outcomes[n] = exc

        async with trio.open_nursery() as nursery:
            for n in range(40):
                nursery.start_soon(one, n)  # 10 duplicates fail on their own
        statements = pool.connection_stats.statements
    assert statements < 20  # round trips: far fewer than writes
    assert sum(1 for value in outcomes.values() if value == 1) == 30
    assert sum(1 for value in outcomes.values() if isinstance(value, PostgresError)) == 10
    assert await _ids(postgres_url, table) == list(range(30))


async def test_batcher_cancelled_before_sending_is_dropped(postgres_url: str) -> None:
    table = _table()
    await _make(postgres_url, table)
    insert = f"INSERT INTO {table} VALUES ($1)"
    async with open_pool(postgres_url, size=1) as pool:
        batcher = WriteBatcher(pool, senders=1)
        written: list[int] = []

        async def one(n: int, scope: trio.CancelScope) -> None:
            with scope:
                await batcher.write([(insert, (n,))])
                written.append(n)

        scopes = [trio.CancelScope() for _ in range(3)]
        async with trio.open_nursery() as nursery:
            async with pool.connection():  # every write waits: 0 as the sender, 1 and 2 queued
                for n, scope in enumerate(scopes):
                    nursery.start_soon(one, n, scope)
                await trio.sleep(0.1)
                scopes[0].cancel()  # the sender, waiting for a connection: the queue moves on
                scopes[1].cancel()  # queued
                await trio.sleep(0.1)
    assert written == [2]
    assert await _ids(postgres_url, table) == [2]


async def test_batcher_cancelled_after_sending_runs_to_its_end(postgres_url: str) -> None:
    table = _table()
    await _make(postgres_url, table)
    async with open_pool(postgres_url, size=1) as pool:
        batcher = WriteBatcher(pool)
        with trio.move_on_after(0.1) as scope:
            await batcher.write(
                [("SELECT pg_sleep(0.4)", ()), (f"INSERT INTO {table} VALUES ($1)", (1,))]
            )
        assert scope.cancelled_caught
    assert await _ids(postgres_url, table) == [1]


async def test_batcher_without_a_connection_within_its_bound(postgres_url: str) -> None:
    """Writes that get no connection within the bound fail and send nothing; with an idle
    connection again (taken without waiting), the next write goes through."""
    table = _table()
    await _make(postgres_url, table)
    insert = f"INSERT INTO {table} VALUES ($1)"
    async with open_pool(postgres_url, size=1) as pool:
        batcher = WriteBatcher(pool, bound=0.2)
        failed: list[int] = []

        async def one(n: int) -> None:
            with pytest.raises(BrokerUnavailable, match="no PostgreSQL connection"):
                await batcher.write([(insert, (n,))])
            failed.append(n)

        async with trio.open_nursery() as nursery:
            async with pool.connection():  # 0 waits for it as the sender, 1 queued
                nursery.start_soon(one, 0)
                nursery.start_soon(one, 1)
                await trio.sleep(0.4)
        assert sorted(failed) == [0, 1]
        assert len(pool.idle_connections) == 1
        assert [r.rowcount for r in await batcher.write([(insert, (2,))])] == [1]
    assert await _ids(postgres_url, table) == [2]
