"""The Trio-native PostgreSQL driver (``durable_trio._postgres``), against a private server.

The real clock throughout (no ``autojump_clock``: it would count socket waits as idle time).
The server is the session's (``tests/_postgres_server.py``); each test uses its own tables,
channels and ``application_name``, so tests need no reset between them.
"""

from __future__ import annotations

import math
import os
import random
import socket
import sys
import uuid
from typing import TYPE_CHECKING, Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from psycopg.adapt import PyFormat, Transformer
from psycopg.types.numeric import Int8

from _postgres_server import *  # noqa: F403  (the private server fixture)
from durable_trio._errors import (
    AuthenticationError,
    BrokerError,
    BrokerUnavailable,
    ConfigError,
    TransportClosed,
)
from durable_trio._postgres import (
    PostgresAuthError,
    PostgresCommandTimeout,
    PostgresError,
    PostgresQueryCanceled,
    PostgresUnavailableError,
    connect,
)
from durable_trio._postgres._listen import Notification, NotificationsMissed, open_listener
from durable_trio._postgres._mux import PgMux
from durable_trio._postgres._pool import PgPool, open_pool
from durable_trio._postgres._statements import pack_array

if TYPE_CHECKING:
    from _postgres_server import PostgresServer

pytestmark = pytest.mark.postgres


# -- helpers ----------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _named(url: str, name: str) -> str:
    """``url`` with an ``application_name`` (to find its backends in ``pg_stat_activity``)."""
    return f"{url}?application_name={name}"


def _table() -> str:
    return f"t_{uuid.uuid4().hex[:12]}"


async def _eventually(check: Any, *, within: float = 30.0) -> Any:
    """Call ``check()`` until it returns without a broker error (the server is coming back)."""
    with trio.fail_after(within):
        while True:
            try:
                return await check()
            except BrokerError:
                await trio.sleep(0.05)


async def _terminate(admin: PgPool, pid: int) -> None:
    """``pg_terminate_backend(pid)`` and wait until the backend is gone."""
    assert await admin.fetchval("SELECT pg_terminate_backend($1)", pid) is True
    with trio.fail_after(10):
        while await admin.fetchval(  # noqa: ASYNC110  (the server's state)
            "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid
        ):
            await trio.sleep(0.01)


async def _receive(listener: Any, within: float = 10.0) -> Notification | NotificationsMissed:
    with trio.fail_after(within):
        event: Notification | NotificationsMissed = await listener.receive()
        return event


# -- one connection ---------------------------------------------------------------------------


async def test_parameters_and_results(postgres_url: str) -> None:
    conn = await connect(postgres_url)
    try:
        result = await conn.execute(
            "SELECT $1::int AS n, $2::text AS s, $3::bytea AS b, $4::float8, $5::bool, $6::int",
            7, "héllo", b"\x00\xff", 1.5, True, None,
        )  # fmt: skip
        assert result.rows == [(7, "héllo", b"\x00\xff", 1.5, True, None)]
        assert result.columns[:3] == ("n", "s", "b")
        assert result.rowcount == 1
        assert result.status == "SELECT 1"
        assert await conn.fetchval("SELECT 1 WHERE false") is None
        blobs = [b'{"a": "\\"}', b"", b"\x00\xff,{}", None]  # sent in binary
        assert await conn.fetchval("SELECT $1::bytea[]", blobs) == blobs
        assert await conn.fetchrow("SELECT 1 WHERE false") is None
        table = _table()
        await conn.script(f"CREATE TABLE {table} (k int PRIMARY KEY, v text); SELECT 1")
        inserted = await conn.execute(
            f"INSERT INTO {table} VALUES ($1, $2), ($3, $4)", 1, "a", 2, "b"
        )
        assert (inserted.rowcount, inserted.status) == (2, "INSERT 0 2")
        assert await conn.fetch(f"SELECT k, v FROM {table} ORDER BY k") == [(1, "a"), (2, "b")]
    finally:
        conn.close()


_PACKABLE = st.one_of(
    st.lists(st.one_of(st.none(), st.text().filter(lambda t: "\x00" not in t)), min_size=1),
    st.lists(st.one_of(st.none(), st.binary()), min_size=1),
    st.lists(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)), min_size=1),
    st.lists(st.one_of(st.none(), st.floats()), min_size=1),
)


@given(_PACKABLE)
def test_pack_array_writes_the_bytes_psycopg_s_binary_dumper_writes(items: list[Any]) -> None:
    """Byte for byte, for any list of one element type with NULLs among it (ints as bigint:
    psycopg's own dumper picks the narrowest type, so it is handed them as ``Int8``)."""
    packed = pack_array(items)
    if all(item is None for item in items):
        assert packed is None
        return
    assert packed is not None
    as_psycopg = [Int8(item) if type(item) is int else item for item in items]
    tx = Transformer()
    (expected,) = tx.dump_sequence([as_psycopg], [PyFormat.BINARY])
    assert tx.types is not None
    assert (packed[0], packed[1]) == (bytes(expected or b""), tx.types[0])


async def test_lists_packed_by_hand_reach_the_server_as_psycopg_would_send_them(
    postgres_url: str,
) -> None:
    """A list of one element type (``pack_array``: bytea[], text[], bigint[], float8[], NULLs
    among them) comes back as sent; one it does not pack (mixed types, a big int) goes
    through psycopg; a str PostgreSQL cannot hold is refused before anything is sent."""
    rng = random.Random(7)
    texts = ["", "a", "héllo", 'quote" back\\slash {,}', "NULL", "\u2603" * 40]
    lists: list[tuple[str, list[Any]]] = [
        ("text[]", [rng.choice([*texts, None]) for _ in range(n)]) for n in (1, 2, 9)
    ]
    lists += [
        ("bytea[]", [b"", b"\x00\xff", None, bytes(range(256))]),
        ("bigint[]", [0, -1, 2**63 - 1, -(2**63), None]),
        ("float8[]", [1.5, -0.0, None, 1e300]),
        ("numeric[]", [2**70, 1]),  # (not bigint: psycopg sends it)
        ("text[]", [None]),
    ]
    for packed, expected in ((pack_array(["a", None]), 1009), (pack_array([1]), 1016)):
        assert packed is not None
        assert packed[1] == expected
    assert pack_array([1, "a"]) is None
    assert pack_array([2**64]) is None
    conn = await connect(postgres_url)
    try:
        for kind, values in lists:
            assert await conn.fetchval(f"SELECT $1::{kind}", values) == values, kind
        with pytest.raises(ConfigError, match=r"cannot store the text 'nul\\x00'"):
            await conn.execute("SELECT $1::text[]", ["a", "nul\x00"])
        with pytest.raises(ConfigError, match=r"cannot store the text '\\udc80'"):
            await conn.execute("SELECT $1::text[]", ["\udc80"])
        with pytest.raises(ValueError, match=r"cannot store the text 'a\\x00'"):  # (one still)
            await conn.execute("SELECT $1::text", "a\x00")
        assert conn.idle
        assert await conn.fetchval("SELECT cardinality($1::text[])", ["x"] * 3) == 3
    finally:
        conn.close()


async def test_server_errors_are_clear_and_keep_the_connection(postgres_url: str) -> None:
    conn = await connect(postgres_url)
    try:
        table = _table()
        await conn.execute(f"CREATE TABLE {table} (k int PRIMARY KEY)")
        await conn.execute(f"INSERT INTO {table} VALUES (1)")
        with pytest.raises(PostgresError) as duplicate:
            await conn.execute(f"INSERT INTO {table} VALUES (1)")
        assert duplicate.value.sqlstate == "23505"
        assert "duplicate key" in str(duplicate.value)
        assert isinstance(duplicate.value, BrokerError)
        with pytest.raises(PostgresError) as syntax:
            await conn.execute("SELEC 1")
        assert syntax.value.sqlstate == "42601"
        with pytest.raises(ValueError, match="cannot send a parameter"):
            await conn.execute("SELECT $1", object())
        with pytest.raises(PostgresError):
            await conn.script("SELECT 1; SELECT 1/0; SELECT 2")
        assert await conn.fetchval("SELECT $1::int", 5) == 5
        assert conn.idle
    finally:
        conn.close()
    with pytest.raises(TransportClosed):
        await conn.execute("SELECT 1")


async def test_transactions(postgres_url: str) -> None:
    conn = await connect(postgres_url)
    try:
        table = _table()
        await conn.execute(f"CREATE TABLE {table} (k int PRIMARY KEY)")
        async with conn.transaction():
            await conn.execute(f"INSERT INTO {table} VALUES (1)")

        async def failing_block() -> None:
            async with conn.transaction():
                await conn.execute(f"INSERT INTO {table} VALUES (2)")
                raise KeyError("the block fails")

        async def caught_error() -> None:
            async with conn.transaction(isolation="serializable"):
                await conn.execute(f"INSERT INTO {table} VALUES (3)")
                with pytest.raises(PostgresError):
                    await conn.execute(f"INSERT INTO {table} VALUES (1)")

        with pytest.raises(KeyError):
            await failing_block()
        # An error caught inside the block aborted the transaction: it is not committed.
        with pytest.raises(PostgresError, match="aborted by an earlier error"):
            await caught_error()
        with pytest.raises(RuntimeError, match="already open"):
            async with conn.transaction(), conn.transaction():
                pass
        with pytest.raises(ConfigError):
            async with conn.transaction(isolation="chaotic"):
                pass
        assert await conn.fetch(f"SELECT k FROM {table}") == [(1,)]
        assert conn.idle
    finally:
        conn.close()


async def test_pipeline_is_one_round_trip_and_atomic(postgres_url: str) -> None:
    conn = await connect(postgres_url)
    try:
        table = _table()
        results = await conn.pipeline(
            [
                (f"CREATE TABLE {table} (k int PRIMARY KEY)", ()),
                (f"INSERT INTO {table} VALUES ($1), ($2)", (1, 2)),
                (f"SELECT k FROM {table} ORDER BY k", ()),
            ]
        )
        assert [r.status for r in results] == ["CREATE TABLE", "INSERT 0 2", "SELECT 2"]
        assert results[2].rows == [(1,), (2,)]
        with pytest.raises(PostgresError) as failed:
            await conn.pipeline(
                [
                    (f"INSERT INTO {table} VALUES ($1)", (3,)),
                    (f"INSERT INTO {table} VALUES ($1)", (1,)),  # a duplicate
                    (f"INSERT INTO {table} VALUES ($1)", (4,)),
                ]
            )
        assert failed.value.index == 1
        assert failed.value.sqlstate == "23505"
        # One implicit transaction: the statement before the failure was rolled back too.
        assert await conn.fetch(f"SELECT k FROM {table} ORDER BY k") == [(1,), (2,)]
        assert await conn.pipeline([]) == []
        with trio.move_on_after(0.05) as scope:
            await conn.pipeline([("SELECT pg_sleep(0.01)", ())] * 50)
        assert scope.cancelled_caught
        assert conn.stats.recovered == 1
        assert conn.idle
        assert await conn.fetchval("SELECT $1::int", 8) == 8
    finally:
        conn.close()


async def test_statements_are_prepared_once_per_connection(postgres_url: str) -> None:
    conn = await connect(postgres_url)
    try:
        table = _table()
        await conn.execute(f"CREATE TABLE {table} (k int PRIMARY KEY, v text)")
        insert = f"INSERT INTO {table} VALUES ($1, $2)"
        for k in range(3):
            await conn.execute(insert, k, "x")
        assert conn.stats.prepared == 1
        # Other parameter types (a big int, a NULL): another statement of the same text.
        await conn.execute(insert, 10**9, None)
        assert conn.stats.prepared == 2
        # Prepared in a failing pipeline: kept (a rollback does not undo it), and its error
        # is the statement's.
        select = f"SELECT v FROM {table} WHERE k = $1"
        with pytest.raises(PostgresError) as failed:
            await conn.pipeline([(select, (1,)), (insert, (1, "dup")), (select, (2,))])
        assert (failed.value.index, failed.value.sqlstate) == (1, "23505")
        assert conn.stats.prepared == 3
        assert await conn.fetchval(select, 1) == "x"
        assert conn.stats.prepared == 3
        # A statement the server refuses to prepare: its error, and nothing kept.
        with pytest.raises(PostgresError) as refused:
            await conn.execute("SELEC $1", 1)
        assert refused.value.sqlstate == "42601"
        with pytest.raises(PostgresError):
            await conn.pipeline([(select, (1,)), ("SELEC $1", (1,))])
        assert conn.stats.prepared == 3
        # Interrupted before its answer: made safe, then prepared again under a new name.
        sleep = "SELECT pg_sleep($1::float8)"
        with trio.move_on_after(0.05):
            await conn.execute(sleep, 5.0)
        assert conn.idle
        await conn.execute(sleep, 0.0)
        await conn.execute(sleep, 0.0)
        assert conn.stats.prepared == 4
        assert await conn.fetch(f"SELECT k FROM {table} ORDER BY k") == [
            (0,), (1,), (2,), (10**9,)
        ]  # fmt: skip
    finally:
        conn.close()
    plain = await connect(postgres_url, prepare_statements=False)
    try:
        assert await plain.fetchval("SELECT $1::int", 1) == 1
        assert await plain.fetchval("SELECT $1::int", 1) == 1
        assert plain.stats.prepared == 0
    finally:
        plain.close()


async def test_connect_failures(postgres_url: str, postgres_server: PostgresServer) -> None:
    with pytest.raises(BrokerUnavailable, match="could not connect") as down:
        await connect(f"postgresql://postgres@127.0.0.1:{_closed_port()}/postgres")
    # libpq's lines folded into one: the CLI prints it as one line, nothing escaped
    assert "Is the server running" in str(down.value)
    assert "\n" not in str(down.value)
    assert "\t" not in str(down.value)
    with pytest.raises(ConfigError):
        await connect("postgresql://[bad")
    with pytest.raises(PostgresAuthError) as refused:
        await connect(f"postgresql://nobody_here@127.0.0.1:{postgres_server.port}/postgres")
    assert isinstance(refused.value, AuthenticationError)
    with pytest.raises(PostgresError, match="does not exist") as missing:
        await connect(f"postgresql://postgres@127.0.0.1:{postgres_server.port}/no_such_db")
    assert missing.value.sqlstate == "3D000"
    assert not isinstance(missing.value, BrokerUnavailable)
    with pytest.raises(ConfigError):
        await connect(postgres_url, command_timeout=0)
    # A host name is looked up by Trio (not by libpq, which would block the event loop).
    by_name = await connect(f"postgresql://postgres@localhost:{postgres_server.port}/postgres")
    try:
        assert await by_name.fetchval("SELECT 1") == 1
        assert by_name.address == f"localhost:{postgres_server.port}/postgres"
    finally:
        by_name.close()
    with pytest.raises(ConfigError):
        open_pool(postgres_url, size=0)


async def test_statement_timeout_is_a_clear_error_and_the_connection_is_reused(
    postgres_url: str,
) -> None:
    async with open_pool(postgres_url, size=1) as pool:
        async with pool.connection() as conn:
            pid = conn.backend_pid
            await conn.execute("SET statement_timeout = 50")
            with pytest.raises(PostgresQueryCanceled, match="statement timeout") as caught:
                await conn.execute("SELECT pg_sleep(5)")
            assert caught.value.sqlstate == "57014"
            assert await conn.fetchval("SELECT $1::int", 11) == 11
            await conn.execute("RESET statement_timeout")
        # The driver's own timeout: a cancel request, and the connection is kept.
        with pytest.raises(PostgresCommandTimeout, match="may have run"):
            await pool.execute("SELECT pg_sleep(5)", command_timeout=0.1)
        (kept,) = pool.idle_connections
        assert kept.backend_pid == pid
        assert kept.stats.recovered == 1
        assert kept.stats.cancel_requests == 1
        assert await pool.fetchval("SELECT $1::int", 12) == 12
        assert pool.stats.connects == 1


async def test_cancel_before_send_does_nothing(postgres_url: str) -> None:
    conn = await connect(postgres_url)
    try:
        table = _table()
        await conn.execute(f"CREATE TABLE {table} (k int)")
        sent = conn.stats.statements
        with trio.CancelScope() as scope:
            scope.cancel()
            await conn.execute(f"INSERT INTO {table} VALUES (1)")
        assert scope.cancelled_caught
        assert conn.stats.statements == sent  # never handed to libpq
        assert conn.stats.interrupted == 0
        assert await conn.fetchval(f"SELECT count(*) FROM {table}") == 0
    finally:
        conn.close()


async def test_cancel_after_send_cancels_on_the_server(postgres_url: str) -> None:
    url = _named(postgres_url, "cancel_after_send")
    conn = await connect(url)
    try:
        with trio.move_on_after(0.1) as scope:
            await conn.execute("SELECT pg_sleep(30)")
        assert scope.cancelled_caught
        assert conn.stats.cancel_requests == 1
        assert conn.stats.recovered == 1
        assert conn.idle
        # Nothing still runs for it on the server, and the next answer is the right one.
        state = await conn.fetchval(
            "SELECT state FROM pg_stat_activity WHERE pid = pg_backend_pid()"
        )
        assert state == "active"  # this very query
        assert await conn.fetchval("SELECT $1::int", 99) == 99
    finally:
        conn.close()


async def test_cancel_inside_a_transaction_rolls_it_back(postgres_url: str) -> None:
    conn = await connect(postgres_url)
    try:
        table = _table()
        await conn.execute(f"CREATE TABLE {table} (k int)")
        with trio.move_on_after(0.1):
            async with conn.transaction():
                await conn.execute(f"INSERT INTO {table} VALUES (1)")
                await conn.execute("SELECT pg_sleep(30)")
        assert conn.idle
        assert await conn.fetchval("SELECT txid_current_if_assigned()") is None
        assert await conn.fetchval(f"SELECT count(*) FROM {table}") == 0
    finally:
        conn.close()


async def test_cancel_during_a_large_send(postgres_url: str) -> None:
    """Cancels while a 16 MiB parameter is still being written (the socket full, psycopg
    waiting to read or write): the rest is sent, the answer drained, the connection kept."""
    conn = await connect(postgres_url)
    big = b"y" * (16 << 20)
    try:
        for step in range(12):
            with trio.move_on_after(0.003 * step):
                assert await conn.fetchval("SELECT length($1::bytea)", big) == len(big)
            assert await conn.fetchval("SELECT $1::int", step) == step
        assert conn.stats.interrupted >= 3
        assert conn.stats.recovered == conn.stats.interrupted
    finally:
        conn.close()


_PURE_PROBE = """
import sys, trio
import psycopg
from durable_trio._postgres import connect
assert psycopg.pq.__impl__ == "python", psycopg.pq.__impl__
async def main():
    conn = await connect(sys.argv[1])
    with trio.move_on_after(0.1):
        await conn.execute("SELECT pg_sleep(30)")
    value = await conn.fetchval("SELECT $1::int", 41)
    print(value, conn.stats.cancel_requests, conn.stats.recovered, psycopg.pq.version())
    conn.close()
trio.run(main)
"""


async def test_the_pure_python_binding_cancels_through_a_thread(postgres_url: str) -> None:
    """psycopg's pure-Python binding on the system's libpq (15 on Debian 12: only the blocking
    PQcancel, run in a thread): the same rule holds."""
    import ctypes.util

    if ctypes.util.find_library("pq") is None:
        pytest.skip("no system libpq for psycopg's pure-Python binding")
    done = await trio.run_process(
        [sys.executable, "-c", _PURE_PROBE, postgres_url],
        capture_stdout=True,
        capture_stderr=True,
        env={**os.environ, "PSYCOPG_IMPL": "python"},
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    value, cancels, recovered, _libpq = done.stdout.decode().split()
    assert (value, cancels, recovered) == ("41", "1", "1")


async def test_close_from_another_task_wakes_the_waiting_one(postgres_url: str) -> None:
    conn = await connect(postgres_url)
    async with trio.open_nursery() as nursery:

        async def closer() -> None:
            await trio.sleep(0.05)
            conn.close()

        nursery.start_soon(closer)
        with trio.fail_after(5), pytest.raises(TransportClosed):
            await conn.execute("SELECT pg_sleep(30)")
    assert conn.closed


async def test_one_task_at_a_time(postgres_url: str) -> None:
    conn = await connect(postgres_url)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.execute, "SELECT pg_sleep(0.2)")
            await trio.sleep(0.05)
            with pytest.raises(RuntimeError, match="another task"):
                await conn.execute("SELECT 1")
    finally:
        conn.close()


# -- the pool ---------------------------------------------------------------------------------


async def test_pool_reuses_its_connections(postgres_url: str) -> None:
    async with open_pool(postgres_url, size=3) as pool:
        for n in range(50):
            assert await pool.fetchval("SELECT $1::int", n) == n
        assert pool.stats.connects == 1
        pids: set[int] = set()

        async def sleeper(n: int) -> None:
            async with pool.connection() as conn:
                pids.add(conn.backend_pid)
                await conn.execute("SELECT pg_sleep(0.02)")
                assert await conn.fetchval("SELECT $1::int", n) == n

        async with trio.open_nursery() as nursery:
            for n in range(20):
                nursery.start_soon(sleeper, n)
        assert len(pids) <= 3
        assert pool.stats.connects <= 3
    with pytest.raises(TransportClosed):
        await pool.execute("SELECT 1")


async def test_waiting_for_a_slot_is_cancelled_with_nothing_taken(postgres_url: str) -> None:
    async with open_pool(postgres_url, size=1) as pool:
        async with pool.connection() as held:
            with trio.move_on_after(0.05) as scope:
                await pool.execute("SELECT 1")  # waits: the one connection is held
            assert scope.cancelled_caught
            assert await held.fetchval("SELECT $1::int", 1) == 1
        # The cancelled waiter took no slot: the pool still has its one connection to give.
        with trio.fail_after(5):
            assert await pool.fetchval("SELECT $1::int", 2) == 2
        assert pool.stats.connects == 1


async def test_pool_rolls_back_what_a_block_left_open(postgres_url: str) -> None:
    async with open_pool(postgres_url, size=1) as pool:
        table = _table()
        await pool.execute(f"CREATE TABLE {table} (k int)")
        async with pool.connection() as conn:
            await conn.execute("BEGIN")
            await conn.execute(f"INSERT INTO {table} VALUES (1)")
        async with pool.transaction() as conn:
            await conn.execute(f"INSERT INTO {table} VALUES (2)")
        assert await pool.fetch(f"SELECT k FROM {table}") == [(2,)]
        assert pool.stats.connects == 1


async def test_pool_replaces_a_terminated_connection(postgres_url: str) -> None:
    async with open_pool(postgres_url, size=2) as admin, open_pool(postgres_url, size=1) as pool:
        first = await pool.fetchval("SELECT pg_backend_pid()")
        await _terminate(admin, first)
        # The dead idle connection is found before use: the caller never sees it.
        second = await pool.fetchval("SELECT pg_backend_pid()")
        assert second != first
        assert pool.stats.discarded == 1
        assert pool.stats.connects == 2


async def test_terminated_mid_statement_is_unavailable_then_recovered(postgres_url: str) -> None:
    async with open_pool(postgres_url, size=2) as admin, open_pool(postgres_url, size=1) as pool:
        pid = await pool.fetchval("SELECT pg_backend_pid()")
        failure: list[BaseException] = []

        async def victim() -> None:
            try:
                await pool.execute("SELECT pg_sleep(30)")
            except BrokerUnavailable as exc:
                failure.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(victim)
            with trio.fail_after(10):
                while not await admin.fetchval(  # noqa: ASYNC110  (the server's state)
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND state = 'active'",
                    pid,
                ):
                    await trio.sleep(0.01)
            await _terminate(admin, pid)
        assert len(failure) == 1
        assert isinstance(failure[0], BrokerUnavailable)
        assert isinstance(failure[0], PostgresUnavailableError) or "lost" in str(failure[0])
        assert await pool.fetchval("SELECT $1::int", 3) == 3


async def test_pool_backs_off_while_the_server_is_unreachable() -> None:
    url = f"postgresql://postgres@127.0.0.1:{_closed_port()}/postgres"
    async with open_pool(url, backoff_initial=1.0, backoff_max=1.0) as pool:
        with pytest.raises(BrokerUnavailable, match="could not connect"):
            await pool.execute("SELECT 1")
        with pytest.raises(BrokerUnavailable, match="next connect attempt"):
            await pool.execute("SELECT 1")
        assert pool.stats.failed_connects == 1


# -- LISTEN / NOTIFY --------------------------------------------------------------------------


async def test_listen_notify_round_trip(postgres_url: str) -> None:
    async with open_pool(postgres_url, size=1) as pool, open_listener(postgres_url) as listener:
        await listener.listen("jobs")
        await listener.listen('Mixed "Case"')
        assert listener.connected
        await pool.execute("SELECT pg_notify($1, $2)", "jobs", "hello")
        await pool.execute("SELECT pg_notify($1, $2)", 'Mixed "Case"', "")
        first = await _receive(listener)
        second = await _receive(listener)
        assert isinstance(first, Notification)
        assert (first.channel, first.payload) == ("jobs", "hello")
        assert isinstance(second, Notification)
        assert (second.channel, second.payload) == ('Mixed "Case"', "")
        await listener.unlisten("jobs")
        await pool.execute("SELECT pg_notify('jobs', 'unheard')")
        await pool.execute("SELECT pg_notify('Mixed \"Case\"', 'heard')")
        third = await _receive(listener)
        assert isinstance(third, Notification)
        assert third.payload == "heard"
        with pytest.raises(ConfigError):
            await listener.listen("x" * 64)
    with pytest.raises(TransportClosed):
        await listener.receive()


async def test_listen_while_the_server_is_down_is_unavailable_then_kept() -> None:
    url = f"postgresql://postgres@127.0.0.1:{_closed_port()}/postgres"
    async with open_listener(url, command_timeout=0.2, backoff_max=0.1) as listener:
        with pytest.raises(BrokerUnavailable, match="once the connection is back"):
            await listener.listen("later")
        assert listener.channels == {"later"}  # still wanted: listened to once it is back
        assert not listener.connected


async def test_pool_script_and_pipeline(postgres_url: str) -> None:
    async with open_pool(postgres_url, size=1) as pool:
        table = _table()
        await pool.script(f"CREATE TABLE {table} (k int); INSERT INTO {table} VALUES (1)")
        results = await pool.pipeline(
            [(f"INSERT INTO {table} VALUES ($1)", (2,)), (f"SELECT count(*) FROM {table}", ())]
        )
        assert results[1].rows == [(2,)]
        assert pool.connection_stats.statements == 2


async def test_listener_overflow_becomes_one_miss(postgres_url: str) -> None:
    async with open_pool(postgres_url, size=1) as pool:
        async with open_listener(postgres_url, buffer=5) as listener:
            await listener.listen("burst")
            await pool.execute("SELECT pg_notify('burst', n::text) FROM generate_series(1, 20) n")
            assert await _receive(listener) == NotificationsMissed("overflow")


async def test_listener_reconnects_after_terminate(postgres_url: str) -> None:
    async with open_pool(postgres_url, size=2) as pool, open_listener(postgres_url) as listener:
        await listener.listen("wake")
        pid = await pool.fetchval(
            "SELECT pid FROM pg_stat_activity WHERE query LIKE 'LISTEN%' "
            "AND pid <> pg_backend_pid() ORDER BY backend_start DESC LIMIT 1"
        )
        await _terminate(pool, pid)
        assert await _receive(listener) == NotificationsMissed("reconnected")
        assert listener.reconnects == 1
        await pool.execute("SELECT pg_notify('wake', 'after')")
        event = await _receive(listener)
        assert isinstance(event, Notification)
        assert event.payload == "after"


@pytest.mark.chaos
async def test_server_restart_pool_and_listener_come_back(
    postgres_url: str, postgres_server: PostgresServer
) -> None:
    async with (
        open_pool(postgres_url, size=2, backoff_max=0.2) as pool,
        open_listener(postgres_url, backoff_max=0.2) as listener,
    ):
        await listener.listen("restart")
        assert await pool.fetchval("SELECT 1") == 1
        await trio.to_thread.run_sync(postgres_server.restart)
        assert await _eventually(lambda: pool.fetchval("SELECT $1::int", 5)) == 5
        assert await _receive(listener, within=30) == NotificationsMissed("reconnected")
        await pool.execute("SELECT pg_notify('restart', 'back')")
        event = await _receive(listener)
        assert isinstance(event, Notification)
        assert event.payload == "back"


# -- the cancellation fuzz --------------------------------------------------------------------


async def _settled_backends(admin: PgPool, name: str, allowed: int) -> list[tuple[Any, ...]]:
    """The backends of ``name`` once closed ones are gone (the server notices a close soon
    after, not at once); fails if more than ``allowed`` stay."""
    rows: list[tuple[Any, ...]] = []
    with trio.move_on_after(5):
        while True:
            rows = await admin.fetch(
                "SELECT pid, state, backend_xid FROM pg_stat_activity WHERE application_name = $1",
                name,
            )
            if len(rows) <= allowed:
                return rows
            await trio.sleep(0.02)
    raise AssertionError(f"connections leaked: {rows}")


async def test_cancellation_fuzz(postgres_url: str) -> None:
    """Hundreds of cancels at random points of every kind of operation (queries,
    transactions, pipelines, 1 MiB parameters, scripts, LISTEN waits, connects), each followed by
    checks on the same pool: right answers, no transaction left open, nothing leaked."""
    rng = random.Random(20261205)
    name = f"fuzz_{uuid.uuid4().hex[:8]}"
    url = _named(postgres_url, name)
    table = _table()
    big = b"x" * (1 << 20)
    committed: set[int] = set()
    outcomes = {"completed": 0, "cancelled": 0}
    async with (
        open_pool(postgres_url, size=1) as admin,
        open_pool(url, size=1, recover_timeout=5) as pool,
        open_listener(url) as listener,
    ):
        await pool.execute(f"CREATE TABLE {table} (k int PRIMARY KEY)")
        await listener.listen("fuzz")

        async def query(_key: int) -> None:
            value = rng.randrange(1 << 30)
            pause = rng.choice([0, 0.001, 0.003])
            got = await pool.fetchval(
                "SELECT $1::int + 0 * length(pg_sleep($2)::text)", value, pause
            )
            assert got == value

        async def transaction(key: int) -> None:
            async with pool.transaction() as conn:
                await conn.execute(f"INSERT INTO {table} VALUES ($1)", key)
                await conn.execute("SELECT pg_sleep($1)", rng.choice([0, 0.002]))
            committed.add(key)

        async def large_send(_key: int) -> None:
            assert await pool.fetchval("SELECT length($1::bytea)", big) == len(big)

        async def listen_wait(_key: int) -> None:
            await listener.receive()

        async def connecting(_key: int) -> None:
            conn = await connect(url)
            conn.close()

        async def pipeline(key: int) -> None:
            value = rng.randrange(1 << 30)
            results = await pool.pipeline(
                [
                    (f"INSERT INTO {table} VALUES ($1)", (key,)),
                    ("SELECT pg_sleep($1)", (rng.choice([0, 0.002]),)),
                    ("SELECT $1::int", (value,)),
                ]
            )
            assert results[2].rows == [(value,)]
            committed.add(key)

        async def script(_key: int) -> None:
            await pool.script("SELECT pg_sleep(0.002); SELECT 1; SELECT pg_sleep(0.001)")

        operations = {
            "query": query,
            "transaction": transaction,
            "large": large_send,
            "listen": listen_wait,
            "connect": connecting,
            "script": script,
            "pipeline": pipeline,
        }
        for key in range(400):
            operation = operations[rng.choice(sorted(operations))]
            delay = rng.choice([0.0, rng.uniform(0, 0.001), rng.uniform(0, 0.004)])
            with trio.move_on_after(delay) as scope:
                await operation(key)
            outcomes["cancelled" if scope.cancelled_caught else "completed"] += 1
            # The same pool (one connection) answers right, with no transaction open.
            value = rng.randrange(1 << 30)
            assert await pool.fetchval("SELECT $1::int", value) == value
            assert await pool.fetchval("SELECT txid_current_if_assigned()") is None
            if rng.random() < 0.2:
                await pool.execute("SELECT pg_notify('fuzz', $1)", str(key))
        # Every transaction that completed is there; the others may or may not be.
        stored = {row[0] for row in await pool.fetch(f"SELECT k FROM {table}")}
        assert committed <= stored
        # Nothing left behind: at most the pool's and the listener's backends, none in a
        # transaction, none still running a statement.
        rows = await _settled_backends(admin, name, allowed=2)
        assert all(xid is None for _pid, _state, xid in rows), rows
        assert all(state == "idle" for _pid, state, _xid in rows), rows
        # The listener still delivers.
        await pool.execute("SELECT pg_notify('fuzz', 'last')")
        with trio.fail_after(10):
            while True:
                event = await listener.receive()
                if isinstance(event, Notification) and event.payload == "last":
                    break
    assert outcomes["cancelled"] > 50, outcomes
    assert outcomes["completed"] > 50, outcomes
    # Both halves of the rule were hit: cancels after sending, made safe and kept.
    assert pool.connection_stats.recovered > 10, pool.connection_stats


async def test_no_command_timeout_cancelled_mid_statement_stays_usable(postgres_url: str) -> None:
    """``command_timeout=math.inf`` (no timeout scope of the driver's own): an answer as usual,
    and a cancellation after sending still leaves the connection made safe."""
    conn = await connect(postgres_url)
    try:
        assert await conn.fetchval("SELECT $1::int", 7, command_timeout=math.inf) == 7
        with trio.move_on_after(0.1) as scope:
            await conn.execute("SELECT pg_sleep(5)", command_timeout=math.inf)
        assert scope.cancelled_caught
        assert (conn.stats.interrupted, conn.stats.recovered) == (1, 1)
        assert conn.idle
        assert await conn.fetchval("SELECT $1::int", 8, command_timeout=math.inf) == 8
    finally:
        conn.close()


# -- pipelined calls on one connection (PgMux) -------------------------------------------------


async def test_pipelined_calls_share_one_connection_and_are_answered_in_order(
    postgres_url: str,
) -> None:
    """A call sent while another waits goes out at once on the same connection (one backend),
    the server runs them in the order sent and each gets its own answer; a failing statement
    fails its call alone."""
    table = _table()
    async with open_pool(postgres_url, size=4) as pool, trio.open_nursery() as nursery:
        await pool.execute(f"CREATE TABLE {table} (k int PRIMARY KEY)")
        await pool.execute(f"CREATE SEQUENCE {table}_seq")
        mux = PgMux(pool, nursery)
        await mux.pipeline([("SELECT 1", ())])  # (the connection open: the calls below queue)
        turn = f"nextval('{table}_seq')"
        out: dict[str, Any] = {}

        async def run(name: str, statements: list[tuple[str, tuple[Any, ...]]]) -> None:
            try:
                out[name] = await mux.pipeline(statements)
            except PostgresError as exc:
                out[name] = exc

        async with trio.open_nursery() as calls:
            calls.start_soon(run, "slow", [(f"SELECT pg_sleep(0.3), pg_backend_pid(), {turn}", ())])
            await trio.sleep(0.05)
            calls.start_soon(
                run, "fails", [(f"INSERT INTO {table} VALUES ($1)", (1,)), ("SELECT 1/0", ())]
            )
            await trio.sleep(0.01)
            calls.start_soon(
                run,
                "after",
                [
                    (f"INSERT INTO {table} VALUES ($1)", (2,)),
                    (f"SELECT pg_backend_pid(), {turn}", ()),
                ],
            )
        assert isinstance(out["fails"], PostgresError)
        assert out["fails"].sqlstate == "22012"
        _, pid, first = out["slow"][0].rows[0]
        assert out["after"][1].rows == [(pid, first + 1)]  # the same backend, right after
        # The failing call's insert rolled back with it; the next call's committed.
        assert await pool.fetch(f"SELECT k FROM {table}") == [(2,)]
        mux.close()
        with pytest.raises(TransportClosed):
            await mux.pipeline([("SELECT 1", ())])


async def test_a_pipelined_connection_lost_fails_its_calls_and_the_next_opens_another(
    postgres_url: str,
) -> None:
    """Its backend terminated while calls wait: each gets BrokerUnavailable (it may have run);
    the next call runs on a new connection. A call cancelled before its answer (its deadline)
    gives the connection up the same way: the calls behind it fail, the next one runs."""
    async with (
        open_pool(postgres_url, size=4) as pool,
        open_pool(postgres_url, size=1) as admin,
        trio.open_nursery() as nursery,
    ):
        mux = PgMux(pool, nursery)
        (first,) = await mux.pipeline([("SELECT pg_backend_pid()", ())])
        pid = first.rows[0][0]
        failed: list[BaseException] = []

        async def waits() -> None:
            try:
                await mux.pipeline([("SELECT pg_sleep(5)", ())])
            except BrokerUnavailable as exc:
                failed.append(exc)

        async with trio.open_nursery() as calls:
            calls.start_soon(waits)
            calls.start_soon(waits)
            await trio.sleep(0.2)
            await _terminate(admin, pid)
        assert len(failed) == 2
        (again,) = await _eventually(lambda: mux.pipeline([("SELECT pg_backend_pid()", ())]))
        other = again.rows[0][0]
        assert other != pid

        failed.clear()
        async with trio.open_nursery() as calls:
            calls.start_soon(waits)  # behind the cancelled one
            with trio.move_on_after(0.2) as cancelled:
                await mux.pipeline([("SELECT pg_sleep(5)", ())])
        assert cancelled.cancelled_caught
        assert len(failed) == 1
        (third,) = await mux.pipeline([("SELECT pg_backend_pid(), 7", ())])
        assert third.rows[0][0] not in (pid, other)
        assert third.rows[0][1] == 7
        mux.close()


async def test_pipelined_calls_cancellation_fuzz(postgres_url: str) -> None:
    """Rounds of three concurrent pipelined calls on one PgMux, some cancelled at random
    points: every call that returned got its own right answer, every one that committed is
    stored, the mux answers right after each round, and no backend is left in a transaction
    or past the pool's size."""
    rng = random.Random(20261206)
    name = f"muxfuzz_{uuid.uuid4().hex[:8]}"
    table = _table()
    committed: set[int] = set()
    outcomes = {"completed": 0, "cancelled": 0, "unavailable": 0}
    async with (
        open_pool(postgres_url, size=1) as admin,
        open_pool(_named(postgres_url, name), size=3) as pool,
        trio.open_nursery() as nursery,
    ):
        await pool.execute(f"CREATE TABLE {table} (k int PRIMARY KEY)")
        mux = PgMux(pool, nursery)

        async def call(key: int) -> None:
            value = rng.randrange(1 << 30)
            delay = rng.choice([None, None, 0.0, rng.uniform(0, 0.002), rng.uniform(0, 0.006)])
            with trio.move_on_after(math.inf if delay is None else delay) as scope:
                try:
                    results = await mux.pipeline(
                        [
                            (f"INSERT INTO {table} VALUES ($1)", (key,)),
                            ("SELECT pg_sleep($1)", (rng.choice([0, 0.001, 0.003]),)),
                            ("SELECT $1::int", (value,)),
                        ]
                    )
                except BrokerUnavailable:
                    outcomes["unavailable"] += 1  # behind a cancelled call: may have run
                    return
                assert results[2].rows == [(value,)]
                committed.add(key)
            outcomes["cancelled" if scope.cancelled_caught else "completed"] += 1

        for round_ in range(120):
            async with trio.open_nursery() as calls:
                for n in range(3):
                    calls.start_soon(call, round_ * 3 + n)
            value = rng.randrange(1 << 30)
            (answer,) = await _eventually(lambda v=value: mux.pipeline([("SELECT $1::int", (v,))]))
            assert answer.rows == [(value,)]
        stored = {row[0] for row in await pool.fetch(f"SELECT k FROM {table}")}
        assert committed <= stored
        mux.close()
        rows = await _settled_backends(admin, name, allowed=3)
        assert all(xid is None for _pid, _state, xid in rows), rows
    # (A cancelled call gives the connection up: the calls behind it are "unavailable".)
    assert outcomes["cancelled"] > 20, outcomes
    assert outcomes["completed"] > 20, outcomes
