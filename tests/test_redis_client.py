"""The Trio-native Redis client, against private redis-server processes over real sockets.

The real clock throughout (no ``autojump_clock``: it would count socket waits as idle time).
"""

from __future__ import annotations

import math
import random
import socket
import ssl
from typing import TYPE_CHECKING, Any

import pytest
import trio

from _redis_server import *  # noqa: F403  (the fixtures; harmless once conftest imports them too)
from benchmarks.micro.redis_client import measure
from durable_trio._errors import BrokerError, BrokerUnavailable, ConfigError, TransportClosed
from durable_trio._redis import (
    RedisClient,
    RedisCommandTimeout,
    RedisReplyError,
    open_redis,
    parse_redis_url,
)

if TYPE_CHECKING:
    from _redis_server import RedisServer

pytestmark = pytest.mark.redis


# -- helpers ----------------------------------------------------------------------------------


def _closed_port() -> int:
    """A loopback port nothing listens on (just freed by the OS)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _info(server: RedisServer, section: str, field: str) -> str:
    text: bytes = server.command("INFO", section)
    for line in text.decode().splitlines():
        if line.startswith(f"{field}:"):
            return line.partition(":")[2]
    raise KeyError(field)


async def _until(predicate: Any, *, within: float = 5.0) -> None:
    with trio.fail_after(within):
        while True:
            if predicate():
                return
            await trio.sleep(0.01)


def _only_connection(client: RedisClient) -> Any:
    (conn,) = client.connections
    return conn


# -- URL parsing and TLS context (no server) --------------------------------------------------


def test_parse_url_with_everything() -> None:
    url = parse_redis_url(
        "rediss://al%40ice:p%3Ass%20w@cache.example:6380/3"
        "?client_name=worker-1&ssl_cert_reqs=none&ssl_ca_certs=/tmp/ca.pem"
    )
    assert (url.host, url.port, url.db) == ("cache.example", 6380, 3)
    assert (url.username, url.password) == ("al@ice", "p:ss w")
    assert url.tls
    assert url.ssl_cert_reqs == "none"
    assert url.ssl_ca_certs == "/tmp/ca.pem"
    assert url.client_name == "worker-1"
    assert "p:ss w" not in repr(url)
    assert url.handshake() == [
        ("AUTH", "al@ice", "p:ss w"),
        ("SELECT", "3"),
        ("CLIENT", "SETNAME", "worker-1"),
    ]


def test_parse_url_defaults() -> None:
    url = parse_redis_url("redis://localhost")
    assert (url.host, url.port, url.db, url.tls) == ("localhost", 6379, 0, False)
    assert url.username is url.password is url.client_name is None
    assert url.handshake() == []
    assert parse_redis_url("redis://:pw@h/0").handshake() == [("AUTH", "pw")]
    assert parse_redis_url("redis://[::1]:7000").address == "[::1]:7000"


@pytest.mark.parametrize(
    "bad",
    [
        "http://localhost",
        "redis://",
        "redis://h/abc",
        "redis://h:99999",
        "redis://h?db=2",
        "redis://user@h",
        "redis://h?ssl_cert_reqs=none",
        "rediss://h?ssl_cert_reqs=maybe",
    ],
)
def test_parse_url_rejects(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_redis_url(bad)


def test_ssl_context_construction(tmp_path: Any) -> None:
    strict = parse_redis_url("rediss://h").ssl_context()
    assert strict.verify_mode == ssl.CERT_REQUIRED
    assert strict.check_hostname
    relaxed = parse_redis_url("rediss://h?ssl_cert_reqs=none").ssl_context()
    assert relaxed.verify_mode == ssl.CERT_NONE
    assert not relaxed.check_hostname
    optional = parse_redis_url("rediss://h?ssl_cert_reqs=optional").ssl_context()
    assert optional.verify_mode == ssl.CERT_OPTIONAL
    missing = tmp_path / "missing.pem"
    with pytest.raises(ConfigError):
        parse_redis_url(f"rediss://h?ssl_ca_certs={missing}").ssl_context()


@pytest.mark.parametrize(
    "options",
    [
        {"pool_size": 0},
        {"connect_timeout": 0},
        {"command_timeout": -1.0},
        {"backoff_initial": 3.0, "backoff_max": 2.0},
    ],
)
def test_open_redis_rejects_bad_options(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        open_redis("redis://127.0.0.1:1/0", **options)


# -- commands ---------------------------------------------------------------------------------


async def test_basic_commands(redis_url: str) -> None:
    async with open_redis(redis_url) as client:
        assert await client.execute("PING") == b"PONG"
        assert await client.execute("SET", "k", b"\x00bytes\xff") == b"OK"
        assert await client.execute("GET", "k") == b"\x00bytes\xff"
        assert await client.execute("GET", "missing") is None
        assert await client.execute("INCRBY", "n", 41) == 41
        assert await client.execute("INCRBYFLOAT", "f", 1.5) == b"1.5"
        assert await client.execute("RPUSH", "l", "a", "b", "c") == 3
        assert await client.execute("LRANGE", "l", 0, -1) == [b"a", b"b", b"c"]
        assert await client.execute("SET", "unicode", "žluťoučký") == b"OK"
        assert (await client.execute("GET", "unicode")).decode() == "žluťoučký"


async def test_error_reply_is_raised_and_the_connection_survives(redis_url: str) -> None:
    async with open_redis(redis_url, pool_size=1) as client:
        await client.execute("SET", "s", "text")
        with pytest.raises(RedisReplyError) as caught:
            await client.execute("LPUSH", "s", "x")
        assert isinstance(caught.value, BrokerError)
        assert caught.value.code == "WRONGTYPE"
        assert "WRONGTYPE" in caught.value.reply
        conn = _only_connection(client)
        assert await client.execute("GET", "s") == b"text"
        assert _only_connection(client) is conn
        async with client.dedicated() as dedicated:
            replies = await dedicated.pipeline(
                [("MULTI",), ("SET", "t", "1"), ("INCR", "s"), ("EXEC",)]
            )
        assert replies[:3] == [b"OK", b"QUEUED", b"QUEUED"]
        ok, nested_error = replies[3]
        assert ok == b"OK"
        assert isinstance(nested_error, RedisReplyError)  # nested: a value, not raised


async def test_commands_that_would_break_reply_order_are_refused(redis_url: str) -> None:
    async with open_redis(redis_url) as client:
        for command in [(), ("SUBSCRIBE", "c"), ("monitor",), ("CLIENT", "REPLY", "OFF")]:
            with pytest.raises(ValueError, match=r"."):
                await client.execute(*command)
        with pytest.raises(ValueError, match="PSUBSCRIBE"):
            await client.pipeline([("PING",), (b"psubscribe", b"p*")])
        assert await client.execute("PING") == b"PONG"


@pytest.mark.parametrize("pool_size", [1, None], ids=["one", "default"])
async def test_concurrent_callers_share_one_connection(
    redis_url: str, pool_size: int | None
) -> None:
    """200 concurrent callers on a pool of one connection (``open_redis``'s default, as
    ioredis's): a second is never opened, and their commands share writes."""
    results: dict[int, list[bytes]] = {}
    client = (
        open_redis(redis_url) if pool_size is None else open_redis(redis_url, pool_size=pool_size)
    )

    async with client:

        async def caller(i: int) -> None:
            got = results.setdefault(i, [])
            for j in range(20):
                got.append(await client.execute("ECHO", f"{i}:{j}"))

        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(caller, i)
        assert len(client.connections) == 1
        stats = _only_connection(client).stats
    for i in range(200):
        assert results[i] == [f"{i}:{j}".encode() for j in range(20)]
    assert stats.commands == stats.replies == 4000
    assert stats.batches <= stats.commands / 10, stats  # writes are coalesced


async def test_pool_spreads_concurrent_callers(redis_url: str) -> None:
    async with open_redis(redis_url, pool_size=3) as client:
        await client.execute("PING")
        assert len(client.connections) == 1

        async def caller(i: int) -> None:
            for j in range(30):
                assert await client.execute("ECHO", f"{i}.{j}") == f"{i}.{j}".encode()

        async with trio.open_nursery() as nursery:
            for i in range(60):
                nursery.start_soon(caller, i)
        assert len(client.connections) == 3
        used = [conn for conn in client.connections if conn.stats.commands > 0]
        assert len(used) >= 2


async def test_pipeline(redis_url: str) -> None:
    async with open_redis(redis_url) as client:
        assert await client.pipeline([]) == []
        replies = await client.pipeline(
            [("SET", "a", "1"), ["INCR", "a"], ("GET", "a"), ("DEL", "a")]
        )
        assert replies == [b"OK", 2, b"2", 1]
        many = await client.pipeline([("ECHO", str(i)) for i in range(3000)])
        assert many == [str(i).encode() for i in range(3000)]

        await client.execute("SET", "s", "text")
        with pytest.raises(RedisReplyError) as caught:
            await client.pipeline([("INCR", "s"), ("SET", "after", "ran"), ("LPUSH", "s", "x")])
        assert caught.value.index == 0
        assert caught.value.code == "ERR"
        assert await client.execute("GET", "after") == b"ran"  # all commands ran

        mixed = await client.pipeline(
            [("GET", "s"), ("INCR", "s"), ("GET", "after")], raise_on_error=False
        )
        assert mixed[0] == b"text"
        assert isinstance(mixed[1], RedisReplyError)
        assert mixed[2] == b"ran"


# -- scripts ----------------------------------------------------------------------------------

_BUMP = "return redis.call('INCRBY', KEYS[1], ARGV[1])"


async def test_script_falls_back_to_eval_after_script_flush(redis_url: str) -> None:
    async with open_redis(redis_url) as client:
        bump = client.script(_BUMP)
        assert await client.execute("SCRIPT", "EXISTS", bump.sha) == [0]
        assert await bump(keys=["n"], args=[5]) == 5  # NOSCRIPT -> EVAL
        assert await client.execute("SCRIPT", "EXISTS", bump.sha) == [1]  # EVAL cached it
        assert await bump(keys=["n"], args=[1]) == 6  # EVALSHA
        await client.execute("SCRIPT", "FLUSH")
        assert await bump(keys=["n"], args=[1]) == 7
        assert bump.command(["k"], [1, "x"]) == ("EVALSHA", bump.sha, 1, "k", 1, "x")


async def test_script_in_a_pipeline_after_script_flush(redis_url: str) -> None:
    async with open_redis(redis_url) as client:
        bump = client.script(_BUMP)
        replies = await client.pipeline([("SET", "n", "1"), bump.command(["n"], [2]), ("GET", "n")])
        # The NOSCRIPT slot was retried (as EVAL) after the rest of the pipeline.
        assert replies == [b"OK", 3, b"1"]
        assert await client.pipeline([bump.command(["n"], [2]), ("GET", "n")]) == [5, b"5"]
        await client.execute("SCRIPT", "FLUSH")
        async with client.dedicated() as conn:  # the fallback works on dedicated connections
            assert await conn.execute(*bump.command(["n"], [1])) == 6


async def test_script_errors(redis_url: str) -> None:
    async with open_redis(redis_url) as client:
        failing = client.script("return redis.error_reply('MYERR custom failure')")
        with pytest.raises(RedisReplyError) as caught:
            await failing()
        assert caught.value.code == "MYERR"
        with pytest.raises(RedisReplyError) as unknown:
            await client.execute("EVALSHA", "0" * 40, 0)  # not registered: no fallback
        assert unknown.value.code == "NOSCRIPT"


# -- URL settings: AUTH, SELECT, client name ---------------------------------------------------


async def test_auth_with_password(redis_auth_server: RedisServer) -> None:
    port = redis_auth_server.port
    async with open_redis(f"redis://:s3cret%20pass@127.0.0.1:{port}/0") as client:
        assert await client.execute("ACL", "WHOAMI") == b"default"
    async with open_redis(f"redis://127.0.0.1:{port}/0") as client:
        with pytest.raises(RedisReplyError) as missing:
            await client.execute("GET", "k")
        assert missing.value.code == "NOAUTH"
    async with open_redis(f"redis://:wrong@127.0.0.1:{port}/0") as client:
        with pytest.raises(RedisReplyError) as wrong:
            await client.execute("GET", "k")  # the handshake fails
        assert wrong.value.code == "WRONGPASS"
        assert client.connections == ()


async def test_auth_with_acl_user(redis_auth_server: RedisServer) -> None:
    port = redis_auth_server.port
    async with open_redis(f"redis://alice:al1ce-pw@127.0.0.1:{port}/2") as client:
        assert await client.execute("ACL", "WHOAMI") == b"alice"
        async with client.dedicated() as conn:  # every connection gets the handshake
            assert await conn.execute("ACL", "WHOAMI") == b"alice"
    async with open_redis(f"redis://alice:nope@127.0.0.1:{port}/0") as client:
        with pytest.raises(RedisReplyError, match="WRONGPASS"):
            await client.execute("PING")


async def test_select_and_client_name(redis_server: RedisServer, redis_url: str) -> None:
    port = redis_server.port
    url = f"redis://127.0.0.1:{port}/5?client_name=dt-test"
    async with open_redis(url) as db5, open_redis(redis_url) as db0:
        await db5.execute("SET", "where", "five")
        assert await db5.execute("CLIENT", "GETNAME") == b"dt-test"
        assert await db0.execute("GET", "where") is None
        assert await db0.execute("CLIENT", "GETNAME") is None
        async with db5.dedicated() as conn:
            assert await conn.execute("GET", "where") == b"five"
    with pytest.raises(RedisReplyError):
        async with open_redis(f"redis://127.0.0.1:{port}/99") as bad:
            await bad.execute("PING")


# -- cancellation -------------------------------------------------------------------------------


async def test_cancelled_before_sending_runs_nothing(redis_url: str) -> None:
    async with open_redis(redis_url, pool_size=1) as client:
        await client.execute("PING")
        sent = _only_connection(client).stats.commands
        with trio.move_on_after(0):
            await client.execute("SET", "ghost", "1")
        with trio.CancelScope() as scope:
            scope.cancel()
            await client.pipeline([("SET", "ghost", "2")])
        assert _only_connection(client).stats.commands == sent
        assert await client.execute("GET", "ghost") is None


async def test_cancellation_at_every_point_keeps_replies_in_step(redis_url: str) -> None:
    async with open_redis(redis_url, pool_size=1) as client:
        await client.execute("PING")
        conn = _only_connection(client)

        async def cancel_after(scope: trio.CancelScope, checkpoints: int) -> None:
            for _ in range(checkpoints):
                await trio.lowlevel.checkpoint()
            scope.cancel()

        cancelled = completed = 0
        for checkpoints in range(25):
            for pipelined in (False, True):
                tag = f"{checkpoints}/{pipelined}"
                async with trio.open_nursery() as nursery:
                    scope = trio.CancelScope()
                    nursery.start_soon(cancel_after, scope, checkpoints)
                    with scope:
                        if pipelined:
                            replies = await client.pipeline([("ECHO", tag), ("ECHO", "2")])
                            assert replies == [tag.encode(), b"2"]
                        else:
                            assert await client.execute("ECHO", tag) == tag.encode()
                if scope.cancelled_caught:
                    cancelled += 1
                else:
                    completed += 1
                # Whatever happened, the next caller gets its own reply.
                assert await client.execute("ECHO", f"next {tag}") == f"next {tag}".encode()
        # A call cancelled while its reply is awaited, for sure: a blocking pop the server
        # answers (nil) only later. Its reply is drained, so the next caller gets its own (the
        # loop above may see no call cancelled in flight on a loaded machine, where every reply
        # can come before the canceller's checkpoints: seen once in CI).
        with trio.move_on_after(0.05) as scope:
            await client.execute("BLPOP", "never-pushed", 0.3)
        assert scope.cancelled_caught
        cancelled += 1
        assert await client.execute("ECHO", "after") == b"after"
        assert cancelled
        assert completed
        assert _only_connection(client) is conn  # drained, never discarded
        assert conn.stats.dropped > 0


async def test_cancellation_storm_with_concurrent_callers(redis_url: str) -> None:
    outcomes = {"cancelled": 0, "completed": 0}
    async with open_redis(redis_url, pool_size=2) as client:

        async def caller(i: int) -> None:
            rng = random.Random(i)
            for j in range(40):
                tag = f"{i}-{j}"
                with trio.move_on_after(rng.choice([0, 1e-5, 5e-5, 1e-4, 3e-4, 1e-3, 1.0])):
                    if rng.random() < 0.3:
                        replies = await client.pipeline([("ECHO", tag), ("ECHO", tag + "b")])
                        assert replies == [tag.encode(), (tag + "b").encode()]
                    else:
                        assert await client.execute("ECHO", tag) == tag.encode()
                    outcomes["completed"] += 1
                    continue
                outcomes["cancelled"] += 1

        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(caller, i)
        assert all(conn.healthy for conn in client.connections)
        assert await client.execute("ECHO", "after") == b"after"
    assert outcomes["cancelled"] > 0
    assert outcomes["completed"] > 0


async def test_cancelled_blocking_command_discards_a_dedicated_connection(
    redis_server: RedisServer, redis_url: str
) -> None:
    async with open_redis(redis_url) as client:
        async with client.dedicated() as conn:
            with trio.move_on_after(0.1):
                await conn.execute("BLPOP", "queue", 0, reply_timeout=math.inf)
            assert not conn.healthy
            with pytest.raises(BrokerUnavailable):
                await conn.execute("PING")
        # The server dropped the blocked client: a later push is not popped by nobody.
        await _until(lambda: _info(redis_server, "clients", "blocked_clients") == "0")
        await client.execute("RPUSH", "queue", "job")
        assert await client.execute("LLEN", "queue") == 1


# -- timeouts and failures ----------------------------------------------------------------------


async def test_command_timeout_discards_the_connection(
    redis_server: RedisServer, redis_url: str
) -> None:
    async with open_redis(redis_url, pool_size=1, command_timeout=0.25) as client:
        await client.execute("PING")
        stuck = _only_connection(client)
        redis_server.command("CLIENT", "PAUSE", 600, "ALL")
        errors: dict[str, BaseException] = {}

        async def caller(command: tuple[str, ...]) -> None:
            try:
                await client.execute(*command)
            except BrokerUnavailable as exc:
                errors[command[1]] = exc

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller, ("GET", "a"))
            await trio.sleep(0.05)
            nursery.start_soon(caller, ("GET", "b"))
        elapsed = trio.current_time() - start
        assert 0.2 < elapsed < 0.55  # the timeout fired; the 0.6 s pause did not end it
        assert isinstance(errors["a"], RedisCommandTimeout)
        # The other waiter failed too (not a timeout of its own: its connection is gone).
        assert type(errors["b"]) is BrokerUnavailable
        assert not stuck.healthy

        with pytest.raises(RedisCommandTimeout):  # a per-call override, on a new connection
            await client.execute("GET", "c", reply_timeout=0.05)
        await trio.sleep(0.45)  # the pause ends
        assert await client.execute("PING") == b"PONG"

    # A blocking command can outlive the default timeout.
    async with open_redis(redis_url, command_timeout=0.1) as client, client.dedicated() as conn:
        assert await conn.execute("BLPOP", "empty", 0.3, reply_timeout=2) is None
        assert conn.healthy


async def test_server_restart(redis_server: RedisServer, redis_url: str) -> None:
    async with open_redis(
        redis_url, connect_timeout=1.0, backoff_initial=0.5, backoff_max=0.5
    ) as client:
        await client.execute("SET", "survives", "yes")
        pooled = _only_connection(client)
        waiter_error: list[BaseException] = []

        async def blocked(conn: Any) -> None:
            try:
                await conn.execute("BLPOP", "nothing", 0, reply_timeout=math.inf)
            except BrokerUnavailable as exc:
                waiter_error.append(exc)

        async with client.dedicated() as conn:
            with trio.fail_after(5):  # the waiter gets an error, not a hang
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(blocked, conn)
                    await _until(lambda: _info(redis_server, "clients", "blocked_clients") == "1")
                    await trio.to_thread.run_sync(redis_server.stop)
        assert len(waiter_error) == 1
        await _until(lambda: not pooled.healthy)

        with pytest.raises(BrokerUnavailable) as refused:
            await client.execute("GET", "survives")
        assert isinstance(refused.value.__cause__, OSError | trio.BrokenResourceError)
        with trio.fail_after(0.2), pytest.raises(BrokerUnavailable, match="next connect"):
            await client.execute("GET", "survives")  # fails fast while backing off

        await trio.to_thread.run_sync(redis_server.start)
        with trio.fail_after(5):
            while True:
                try:
                    value = await client.execute("GET", "survives")
                    break
                except BrokerUnavailable:
                    await trio.sleep(0.02)
        assert value == b"yes"  # the AOF kept it
        assert client.connections
        assert client.connections[0] is not pooled


async def test_connection_refused_and_connect_timeout() -> None:
    async with open_redis(f"redis://127.0.0.1:{_closed_port()}/0", backoff_initial=1.0) as client:
        with pytest.raises(BrokerUnavailable, match="could not connect"):
            await client.execute("PING")
        with pytest.raises(BrokerUnavailable, match="next connect attempt"):
            await client.execute("PING")
        with pytest.raises(BrokerUnavailable, match="could not connect"):
            async with client.dedicated():  # dedicated connects do not wait for the backoff
                pass

    # A listener that never answers the TLS handshake: the connect timeout fires.
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    with listener:
        async with open_redis(
            f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=none", connect_timeout=0.2
        ) as client:
            start = trio.current_time()
            with pytest.raises(BrokerUnavailable, match=r"within 0\.2s"):
                await client.execute("PING")
            assert trio.current_time() - start < 1.0


async def test_closing_the_client(redis_url: str) -> None:
    client = open_redis(redis_url)
    with pytest.raises(TransportClosed):
        await client.execute("PING")  # never entered
    errors: list[BaseException] = []

    async def waiter(client: RedisClient) -> None:
        try:
            await client.execute("BLPOP", "never", 0, reply_timeout=math.inf)
        except TransportClosed as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery, open_redis(redis_url, pool_size=1) as client:
        await client.execute("PING")
        nursery.start_soon(waiter, client)
        await _until(lambda: _only_connection(client).load == 1)
    assert len(errors) == 1
    with pytest.raises(TransportClosed):
        await client.execute("PING")

    async with trio.open_nursery() as nursery, open_redis(redis_url) as client:
        await client.execute("PING")
        nursery.start_soon(waiter, client)
        await trio.sleep(0.05)
        client.close()  # from the body: waiters and later calls see TransportClosed
        with pytest.raises(TransportClosed):
            await client.execute("PING")
    assert len(errors) == 2

    async def failing_body() -> None:
        async with open_redis(redis_url) as client:
            await client.execute("PING")
            raise KeyError("body")

    with pytest.raises(KeyError):  # the body's exception is not wrapped in a group
        await failing_body()


# -- pub/sub --------------------------------------------------------------------------------------


async def test_pubsub(redis_url: str) -> None:
    async with open_redis(redis_url) as client:
        async with client.subscribe("ch1", patterns=["jobs.*"]) as sub:
            assert sub.channels == {b"ch1"}
            assert sub.patterns == {b"jobs.*"}
            assert await client.execute("PUBLISH", "ch1", "hello") == 1
            assert await client.execute("PUBLISH", "jobs.q1", "ring") == 1
            assert await sub.receive() == (b"ch1", b"hello")
            assert await sub.receive() == (b"jobs.q1", b"ring")
            await sub.subscribe("ch2")
            await sub.unsubscribe("ch1")
            await sub.ping()
            assert await client.execute("PUBLISH", "ch1", "lost") == 0
            for i in range(50):
                await client.execute("PUBLISH", "ch2", str(i))
            got = []
            async for channel, message in sub:
                assert channel == b"ch2"
                got.append(message)
                if len(got) == 50:
                    break
            assert got == [str(i).encode() for i in range(50)]
            await sub.punsubscribe()
            assert sub.patterns == frozenset()
            assert await client.execute("PUBLISH", "jobs.q1", "x") == 0

        async with client.subscribe("bell") as sub:
            received: list[tuple[bytes, bytes]] = []

            async def listen() -> None:
                async for item in sub:  # ends when the subscription is closed
                    received.append(item)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(listen)
                await client.execute("PUBLISH", "bell", "ding")
                await _until(lambda: bool(received))
                sub.close()
            assert received == [(b"bell", b"ding")]


async def test_pubsub_connection_loss_is_reported(redis_url: str) -> None:
    async with open_redis(redis_url) as client, client.subscribe("bell") as sub:
        await client.execute("CLIENT", "KILL", "TYPE", "pubsub")
        with trio.fail_after(5), pytest.raises(BrokerUnavailable):
            async for _ in sub:
                pass


# -- TLS ------------------------------------------------------------------------------------------


async def test_tls(redis_tls_server: RedisServer) -> None:
    base = redis_tls_server.tls_url
    async with open_redis(f"{base}?ssl_ca_certs={redis_tls_server.ca_file}") as client:
        assert await client.execute("PING") == b"PONG"
        assert await client.pipeline([("SET", "t", "1"), ("GET", "t")]) == [b"OK", b"1"]
    async with open_redis(f"{base}?ssl_cert_reqs=none") as client:
        assert await client.execute("PING") == b"PONG"
    async with open_redis(base, connect_timeout=2) as client:  # self-signed: not trusted
        with pytest.raises(BrokerUnavailable, match="could not connect"):
            await client.execute("PING")


# -- the micro-benchmark ----------------------------------------------------------------------


async def test_measure_smoke(redis_url: str) -> None:
    figures = await measure(
        redis_url, sequential=20, pipelines=2, pipeline_size=50, tasks=10, per_task=5
    )
    assert set(figures) == {
        "sequential_get_us",
        "pipelined_get_us",
        "concurrent_get_us",
        "concurrent_one_connection_get_us",
    }
    assert all(value > 0 for value in figures.values())


def test_transient_error_replies_are_broker_unavailable() -> None:
    from durable_trio import BrokerUnavailable
    from durable_trio._redis._errors import RedisBusyReply, RedisReplyError, raisable

    loading = raisable(RedisReplyError("LOADING Redis is loading the dataset in memory"))
    assert isinstance(loading, RedisBusyReply)
    assert isinstance(loading, BrokerUnavailable)
    assert loading.code == "LOADING"
    wrong = RedisReplyError("WRONGTYPE Operation against a key holding the wrong kind of value")
    assert raisable(wrong) is wrong


# -- the direct write of a lone request (issue 19, item 2) -------------------------------------


async def test_lone_requests_are_written_by_their_callers(redis_url: str) -> None:
    # One caller at a time: each request finds the connection quiet and writes itself, one
    # write per command, and every reply is its own.
    async with open_redis(redis_url, pool_size=1) as client:
        for j in range(50):
            assert await client.execute("ECHO", f"lone:{j}") == f"lone:{j}".encode()
        stats = _only_connection(client).stats
    assert stats.commands == stats.replies == stats.batches == 50
    assert stats.dropped == 0


async def test_a_direct_write_the_socket_cuts_short_is_finished_by_the_writer(
    redis_url: str,
) -> None:
    # A send buffer far smaller than the command: the caller's write takes what the socket
    # takes, the writer sends the rest, and the command arrives whole.
    value = random.randbytes(4 * 1024 * 1024)
    async with open_redis(redis_url, pool_size=1) as client:
        await client.execute("PING")
        conn = _only_connection(client)
        conn._stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        assert await client.execute("SET", "h19:big", value) == b"OK"
        assert await client.execute("GET", "h19:big") == value
        assert conn.stats.batches > conn.stats.commands  # the first write was cut short
        await client.execute("DEL", "h19:big")


async def test_a_lone_request_cancelled_after_its_direct_write_leaves_the_stream_in_step(
    redis_url: str,
) -> None:
    # Cancelled while its reply is awaited (the command was written whole, in one call): the
    # reply is drained, and the next caller gets its own.
    async with open_redis(redis_url, pool_size=1) as client:
        await client.execute("PING")
        with trio.move_on_after(0.05) as scope:
            await client.execute("BLPOP", "h19:nothing", 0.2, reply_timeout=math.inf)
        assert scope.cancelled_caught
        assert await client.execute("ECHO", "after") == b"after"
        stats = _only_connection(client).stats
        assert stats.dropped == 1
