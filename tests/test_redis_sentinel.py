"""``redis+sentinel://``: discovery, ROLE admission, failover following, on a private group.

The group (tests/_redis_sentinel.py) is real: one master, one replica, three sentinels, and
the failovers are the sentinels' own, timed by the wall clock (a few seconds each, bounded).
A *lying sentinel* (a tiny RESP server in this file) is the one fault injection: it names the
node the test chooses, so the client's own checks are what is tested.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import hiredis
import pytest
import trio

import durable_trio as dt
from _redis_server import RedisServer, _free_port
from durable_trio._errors import BrokerUnavailable
from durable_trio._redact import redact_url
from durable_trio._redis import RedisBusyReply, RedisClient, open_redis
from durable_trio._redis._sentinel import parse_failover_start, parse_switch_master
from durable_trio._redis._sentinel_url import parse_sentinel_url

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from pathlib import Path

    from _redis_sentinel import SentinelGroup

pytestmark = pytest.mark.redis

#: Bound of one failover as the client sees it (the sentinels need ~1-3 s on a quiet machine).
FAILOVER_BOUND = 30.0


# -- the URL ------------------------------------------------------------------------------


def test_the_url_names_sentinels_master_database_and_options() -> None:
    parsed = parse_sentinel_url(
        "rediss+sentinel://app:p%40ss@s1:26380,s2,[::1]:7/orders/3"
        "?client_name=api&sentinel_password=s%26p&ssl_cert_reqs=none"
    )
    assert parsed.sentinels == (("s1", 26380), ("s2", 26379), ("::1", 7))
    assert parsed.master_name == "orders"
    assert parsed.sentinel_password == "s&p"
    data = parsed.master_url("10.0.0.5", 6380)
    assert (data.host, data.port, data.db, data.tls) == ("10.0.0.5", 6380, 3, True)
    assert (data.username, data.password, data.client_name) == ("app", "p@ss", "api")
    assert data.ssl_cert_reqs == "none"
    sentinel = parsed.sentinel_url(1)
    assert (sentinel.address, sentinel.password, sentinel.tls) == ("s2:26379", "s&p", False)
    assert "p@ss" not in repr(parsed)
    assert "s&p" not in repr(parsed)


@pytest.mark.parametrize(
    ("url", "position", "problem"),
    [
        ("redis+sentinel://s1:1,,s2/m", 23, "an empty sentinel (sentinels are host:port"),
        ("redis+sentinel://s1:x/m", 21, "the port is not a number"),
        ("redis+sentinel://s1:99999/m", 21, "the port is out of range"),
        ("redis+sentinel://s1:1/", 22, "the path names the master"),
        ("redis+sentinel://s1:1", 22, "the path names the master"),
        ("redis+sentinel://s1/m/x", 23, "after the master name, the path is a database number"),
        ("redis+sentinel://s1/m?nope=1", 23, "an unknown option"),
        ("redis+sentinel://::1/m", 19, "the port is not a number"),  # [::1] for IPv6
        ("redis+sentinel://S3cr3t@s1/m", 18, "a user name needs a password"),
    ],
)
def test_a_bad_url_names_the_position_never_the_text(url: str, position: int, problem: str) -> None:
    with pytest.raises(dt.ConfigError) as bad:
        parse_sentinel_url(url)
    assert f"character {position}: {problem}" in str(bad.value)
    assert "S3cr3t" not in str(bad.value)


def test_tls_options_need_the_tls_scheme() -> None:
    with pytest.raises(dt.ConfigError, match="ssl_\\* options need"):
        parse_sentinel_url("redis+sentinel://s1/m?ssl_cert_reqs=none")


def test_the_shown_url_masks_both_passwords() -> None:
    url = "redis+sentinel://u:S3cr3t@h:1,h:2/m/0?sentinel_password=An0ther@pw#x&client_name=c"
    shown = redact_url(url)
    assert shown == "redis+sentinel://***@h:1,h:2/m/0?sentinel_password=***&client_name=c"


def test_open_redis_checks_the_sentinel_options() -> None:
    with pytest.raises(dt.ConfigError, match="sentinel_timeout must be positive"):
        open_redis("redis+sentinel://127.0.0.1/durable", sentinel_timeout=0)
    with pytest.raises(dt.ConfigError, match="character 18: an empty sentinel"):
        open_redis("redis+sentinel://,h/durable")
    client = open_redis("rediss+sentinel://127.0.0.1/durable/4")
    assert client.sentinel is not None
    assert (client.url.db, client.url.tls) == (4, True)
    assert client.url.address == "master 'durable' (via sentinels)"  # until one is found


def test_a_malformed_announcement_is_ignored() -> None:
    assert parse_switch_master(b"durable 127.0.0.1 1 127.0.0.1 2") == ("durable", "127.0.0.1", 2)
    for junk in (b"", b"durable", b"durable a 1 b x", b"\xff\xfe 1 2 3 4 5", b"a b c d e f"):
        assert parse_switch_master(junk) is None
    assert parse_failover_start(b"master durable 127.0.0.1 6379") == "durable"
    for junk in (b"", b"master durable", b"slave durable 127.0.0.1 1", b"\xff 1 2 3"):
        assert parse_failover_start(junk) is None


# -- a lying sentinel (fault injection) ---------------------------------------------------


class Refusal(str):
    """An error reply, for :func:`_resp`."""


def _resp(value: Any) -> bytes:
    if value is None:
        return b"*-1\r\n"
    if isinstance(value, Refusal):
        return b"-%s\r\n" % value.encode()
    if isinstance(value, list):
        return b"*%d\r\n" % len(value) + b"".join(_resp(item) for item in value)
    data = value if isinstance(value, bytes) else str(value).encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


def naming(port: int, epoch: int = 0, flags: str = "master") -> list[str]:
    """A ``SENTINEL MASTER`` reply naming ``127.0.0.1:port`` (the fields the client reads)."""
    fields = {"name": "durable", "ip": "127.0.0.1", "port": port, "flags": flags}
    return [str(item) for pair in {**fields, "config-epoch": epoch}.items() for item in pair]


@asynccontextmanager
async def lying_sentinel(
    answer: Callable[[], Any],
    *,
    announce: trio.Event | None = None,
    messages: tuple[bytes, ...] = (),
    refuse_auth: bool = False,
) -> AsyncIterator[int]:
    """A server answering every command with ``answer()`` (a ``SENTINEL MASTER`` reply), or
    ``-WRONGPASS`` to ``AUTH`` if ``refuse_auth``; a ``SUBSCRIBE`` is confirmed, and once
    ``announce`` is set ``messages`` are published on it. Yields its port."""

    async def serve(stream: trio.SocketStream) -> None:
        reader = hiredis.Reader()
        async with stream:
            while data := await stream.receive_some(65536):
                reader.feed(data)
                while (command := reader.gets()) is not False:
                    name = command[0].upper()
                    if name == b"SUBSCRIBE":
                        for count, channel in enumerate(command[1:], 1):
                            await stream.send_all(_resp([b"subscribe", channel, count]))
                        assert announce is not None
                        await announce.wait()
                        for message in messages:
                            await stream.send_all(_resp([b"message", command[1], message]))
                    elif name == b"AUTH" and refuse_auth:
                        await stream.send_all(_resp(Refusal("WRONGPASS invalid password")))
                    else:
                        await stream.send_all(_resp(answer()))

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, host="127.0.0.1"), serve, 0)
        yield int(listeners[0].socket.getsockname()[1])
        nursery.cancel_scope.cancel()


@pytest.fixture
def two_servers(tmp_path: Path) -> Any:
    """Two private plain servers, both masters at first (not part of the sentinel group)."""
    servers = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        server = RedisServer(tmp_path / name)
        server.start()
        servers.append(server)
    yield servers
    for server in servers:
        server.stop()


async def test_a_node_named_master_that_says_it_is_a_replica_is_never_used(
    redis_sentinel: SentinelGroup,
) -> None:
    redis_sentinel.reset()
    replica = redis_sentinel.replica()
    async with lying_sentinel(lambda: naming(replica.port)) as port:
        url = f"redis+sentinel://127.0.0.1:{port}/durable?client_name=liar-test"
        async with open_redis(url, watch_sentinels=False) as client:
            with pytest.raises(BrokerUnavailable, match="says it is a slave") as refused:
                await client.execute("SET", "k", "v")
            assert client.sentinel is not None
            assert client.sentinel.refusals == 1
            assert client.connections == ()
    assert "\n" not in str(refused.value)
    assert redis_sentinel.master().command("EXISTS", "k") == 0


async def test_a_readonly_reply_drops_the_connections_and_rediscovers(
    two_servers: list[RedisServer],
) -> None:
    first, second = two_servers
    named = [first]
    async with lying_sentinel(lambda: naming(named[0].port)) as port:
        url = f"redis+sentinel://127.0.0.1:{port}/durable"
        async with open_redis(url, watch_sentinels=False) as client:
            assert client.sentinel is not None
            await client.execute("SET", "k", "on-first")
            # The master is demoted under the open connection (what a sentinel does to a
            # partitioned master that comes back), and the sentinel now names the other.
            first.command("REPLICAOF", "127.0.0.1", str(second.port))
            named[0] = second
            with pytest.raises(RedisBusyReply, match="READONLY") as readonly:
                await client.execute("SET", "k", "refused")
            assert isinstance(readonly.value, BrokerUnavailable)  # transient: callers retry
            assert client.sentinel.switches == 1
            await client.execute("SET", "k", "on-second")  # re-discovered, at once
            assert client.sentinel.master == ("127.0.0.1", second.port)
            assert client.sentinel.discoveries == 2
    assert second.command("GET", "k") == b"on-second"


async def test_a_switch_master_announcement_drops_the_connections_junk_is_ignored(
    two_servers: list[RedisServer],
) -> None:
    first, second = two_servers
    named = [first]
    announce = trio.Event()
    messages = (
        b"",
        b"\xff not five words",
        b"another-master 127.0.0.1 1 127.0.0.1 2",
        f"durable 127.0.0.1 {first.port} 127.0.0.1 {second.port}".encode(),
    )
    async with lying_sentinel(
        lambda: naming(named[0].port), announce=announce, messages=messages
    ) as port:
        async with open_redis(f"redis+sentinel://127.0.0.1:{port}/durable") as client:
            assert client.sentinel is not None
            await client.execute("SET", "k", "on-first")
            [before] = client.connections
            named[0] = second
            announce.set()
            with trio.fail_after(5):
                while client.sentinel.switches == 0:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            assert client.sentinel.switches == 1  # the junk and the other master's: ignored
            assert not before.healthy
            await client.execute("SET", "k", "on-second")
            assert client.sentinel.master == ("127.0.0.1", second.port)
    assert first.command("GET", "k") == b"on-first"
    assert second.command("GET", "k") == b"on-second"


async def test_a_refused_sentinel_password_is_an_authentication_error() -> None:
    async with lying_sentinel(lambda: None, refuse_auth=True) as port:
        url = f"redis+sentinel://127.0.0.1:{port}/durable?sentinel_password=Wr0ng-pw"
        with pytest.raises(dt.AuthenticationError) as refused:
            async with dt.open_backend(url):
                pytest.fail("opened")
    assert "Wr0ng-pw" not in str(refused.value)


async def test_no_master_is_named_while_a_sentinel_fails_it_over(
    two_servers: list[RedisServer],
) -> None:
    first, _ = two_servers
    flags = ["master"]
    async with lying_sentinel(lambda: naming(first.port, flags=flags[0])) as port:
        url = f"redis+sentinel://127.0.0.1:{port}/durable"
        async with open_redis(url, watch_sentinels=False) as client:
            await client.execute("SET", "k", "before")
            flags[0] = "master,failover_in_progress"
            [conn] = client.connections
            conn.close()  # the next call needs a new connection, so asks again
            with pytest.raises(BrokerUnavailable, match="a failover of the Redis master"):
                await client.execute("SET", "k", "during")
            flags[0] = "master"
            with trio.fail_after(5):
                while True:
                    with contextlib.suppress(BrokerUnavailable):  # backing off a moment
                        await client.execute("SET", "k", "after")
                        break
                    await trio.sleep(0.05)
    assert first.command("GET", "k") == b"after"


async def test_the_newest_epoch_wins_over_a_sentinel_that_missed_the_failover(
    two_servers: list[RedisServer],
) -> None:
    # Both say they are masters (a restarted old master does, until it is reconfigured): only
    # the epochs tell which the failover chose. The stale sentinel is listed (and answers) first.
    stale_node, promoted = two_servers
    async with (
        # ...still flagged as failing it over: a failover that lost to the newer one.
        lying_sentinel(
            lambda: naming(stale_node.port, epoch=4, flags="master,failover_in_progress")
        ) as stale,
        lying_sentinel(lambda: naming(promoted.port, epoch=5)) as fresh,
    ):
        url = f"redis+sentinel://127.0.0.1:{stale},127.0.0.1:{fresh}/durable"
        async with open_redis(url, watch_sentinels=False) as client:
            await client.execute("SET", "k", "v")
            assert client.sentinel is not None
            assert client.sentinel.master == ("127.0.0.1", promoted.port)
    assert promoted.command("GET", "k") == b"v"
    assert stale_node.command("EXISTS", "k") == 0


async def test_rediss_sentinel_speaks_tls_to_the_data_node(redis_tls_server: RedisServer) -> None:
    redis_tls_server.reset()
    assert redis_tls_server.tls_port is not None
    tls_port = redis_tls_server.tls_port
    async with lying_sentinel(lambda: naming(tls_port)) as port:
        url = f"rediss+sentinel://127.0.0.1:{port}/durable?ssl_ca_certs={redis_tls_server.ca_file}"
        async with open_redis(url, watch_sentinels=False) as client:
            await client.execute("SET", "k", "over-tls")
            [conn] = client.connections
            assert conn.url.tls
            assert conn.url.port == tls_port
    assert redis_tls_server.command("GET", "k") == b"over-tls"


async def test_a_sentinel_with_a_malformed_answer_is_passed_over(
    redis_sentinel: SentinelGroup,
) -> None:
    redis_sentinel.reset()
    good = redis_sentinel.sentinels[0].port
    async with lying_sentinel(lambda: ["ip", "127.0.0.1", "port", "not-a-port"]) as liar:
        url = f"redis+sentinel://127.0.0.1:{liar},127.0.0.1:{good}/durable"
        async with open_redis(url, watch_sentinels=False) as client:
            await client.execute("SET", "k", "v")
    assert redis_sentinel.master().command("GET", "k") == b"v"


# -- discovery on the real group -----------------------------------------------------------


async def test_discovery_asks_the_sentinels_and_writes_to_the_master(
    redis_sentinel_url: str, redis_sentinel: SentinelGroup
) -> None:
    # A dead sentinel first: the next one in turn answers.
    dead = f"127.0.0.1:{_free_port()}"
    url = redis_sentinel_url.replace("redis+sentinel://", f"redis+sentinel://{dead},")
    async with open_redis(url) as client:
        assert await client.execute("SET", "k", "v") == b"OK"
        assert client.sentinel is not None
        assert client.sentinel.master == ("127.0.0.1", redis_sentinel.master().port)
        assert client.sentinel.refusals == 0
    assert redis_sentinel.master().command("GET", "k") == b"v"


async def test_an_unknown_master_name_is_one_clear_line(redis_sentinel: SentinelGroup) -> None:
    url = redis_sentinel.url().replace("/durable/", "/no-such-master/")
    with trio.fail_after(10), pytest.raises(BrokerUnavailable) as bad:
        async with dt.open_backend(url):
            pytest.fail("opened")
    message = str(bad.value)
    assert "no sentinel knows a master named 'no-such-master'" in message
    assert "\n" not in message


async def test_all_sentinels_down_is_one_clear_line_and_fails_fast() -> None:
    ports = [_free_port() for _ in range(3)]
    url = "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in ports) + "/durable"
    async with open_redis(url, sentinel_timeout=1.0) as client:
        began = trio.current_time()
        with pytest.raises(BrokerUnavailable) as bad:
            await client.execute("PING")
        with pytest.raises(BrokerUnavailable, match="next connect attempt"):
            await client.execute("PING")  # no master known: fails fast, backing off
        assert trio.current_time() - began < 3 * 1.0 + 1
    message = str(bad.value)
    assert message.startswith("could not find the Redis master 'durable' through 3 sentinel(s)")
    assert all(str(p) in message for p in ports)
    assert "\n" not in message


# -- failovers (the sentinels' own, on the wall clock) ----------------------------------


async def _kill(group: SentinelGroup, node: RedisServer) -> float:
    """SIGKILL ``node`` (in a thread: the event loop keeps serving the traffic); returns the
    wall-clock time it was dead by."""
    await trio.to_thread.run_sync(group.kill, node)
    return time.monotonic()


class Increments:
    """``INCR counter`` every 5 ms through a client, in the background.

    Attributes:
        acked: every value the client got an answer with, in order.
        refused: calls that failed with ``BrokerUnavailable`` (fast: no master known).
    """

    def __init__(self) -> None:
        self.acked: list[int] = []
        self.refused = 0
        self.stopped = False

    async def run(self, client: RedisClient) -> None:
        # Stopped, not cancelled: a cancelled INCR may have run unacknowledged, and the
        # counter would not match the last acknowledged value.
        while not self.stopped:
            try:
                self.acked.append(await client.execute("INCR", "counter"))
            except BrokerUnavailable:
                self.refused += 1  # fails fast while no master is known; never hangs
            await trio.sleep(0.005)

    async def reach(self, count: int, within: float = 10) -> None:
        """Wait until ``count`` increments were acknowledged."""
        with trio.fail_after(within):
            while len(self.acked) < count:  # noqa: ASYNC110
                await trio.sleep(0.005)

    def lost(self) -> int:
        """Acknowledged increments whose value came again: they were not on the node that
        took over (the replica had not received them)."""
        return sum(a - b + 1 for a, b in itertools.pairwise(self.acked) if b <= a)


@asynccontextmanager
async def incrementing(url: str) -> AsyncIterator[tuple[RedisClient, Increments]]:
    """A client on ``url`` and its :class:`Increments`, 20 of them acknowledged already."""
    traffic = Increments()
    async with open_redis(url) as client, trio.open_nursery() as nursery:
        nursery.start_soon(traffic.run, client)
        await traffic.reach(20)
        yield client, traffic
        traffic.stopped = True


@pytest.mark.chaos
async def test_writes_resume_on_the_promoted_replica_after_the_master_is_killed(
    redis_sentinel_url: str, redis_sentinel: SentinelGroup
) -> None:
    old = redis_sentinel.master()
    async with incrementing(redis_sentinel_url) as (client, traffic):
        killed_at = await _kill(redis_sentinel, old)
        before = len(traffic.acked)
        await traffic.reach(before + 1, within=FAILOVER_BOUND)
        recovered = time.monotonic() - killed_at
        await traffic.reach(before + 20)
        assert client.sentinel is not None
        with trio.fail_after(10):  # the watcher hears the announcement too
            while client.sentinel.switches == 0:  # noqa: ASYNC110
                await trio.sleep(0.05)
    new = redis_sentinel.master()
    acked = traffic.acked
    print(
        f"\nkill -> first write on the promoted replica: {recovered:.2f}s "
        f"({traffic.refused} calls refused meanwhile); acknowledged increments lost: "
        f"{traffic.lost()} (replication is asynchronous)"
    )
    assert new is not old
    assert client.sentinel.master == ("127.0.0.1", new.port)
    after = acked[before:]
    if len(after) > 1 and after[1] <= after[0]:
        # The one INCR in flight at the kill, answered by the old master just before it died
        # and read by the client after the kill returned (seen under load in CI): not a write
        # of the promoted replica, which may not have received it.
        after = after[1:]
    assert after == list(range(after[0], after[0] + len(after)))
    assert int(new.command("GET", "counter")) == acked[-1]


@pytest.mark.chaos
async def test_a_manual_failover_moves_the_writes_to_the_new_master(
    redis_sentinel_url: str, redis_sentinel: SentinelGroup
) -> None:
    # SENTINEL FAILOVER: both nodes stay up; the sentinels demote the old master (REPLICAOF,
    # CLIENT KILL) and promote the replica. The client must follow without any process dying.
    old = redis_sentinel.master()
    async with incrementing(redis_sentinel_url) as (client, traffic):
        began = time.monotonic()
        redis_sentinel.sentinels[0].command("SENTINEL", "FAILOVER", redis_sentinel.master_name)
        assert client.sentinel is not None
        with trio.fail_after(FAILOVER_BOUND):
            while client.sentinel.master == ("127.0.0.1", old.port):  # noqa: ASYNC110
                await trio.sleep(0.005)
        await traffic.reach(len(traffic.acked) + 20)
        took = time.monotonic() - began
    new = redis_sentinel.master()
    with trio.fail_after(30):
        while old.role() != "slave":  # noqa: ASYNC110
            await trio.sleep(0.05)
    # An acknowledged INCR lost here: the old master took it after the replica was promoted
    # and before the sentinels demoted it (the failover is not coordinated).
    lost = traffic.lost()
    print(
        f"\nmanual failover -> writes on the new master after {took:.2f}s; acknowledged "
        f"increments lost: {lost}; drops of every connection (a +try-failover, then each "
        f"sentinel's +switch-master, or a READONLY): {client.sentinel.switches}"
    )
    assert new is not old
    assert int(new.command("GET", "counter")) == traffic.acked[-1]
    # The connections were dropped at +try-failover, before the replica was promoted (a few
    # of the sentinel's 100 ms ticks later); an acknowledged write lost means the replica was
    # that far behind.
    assert lost == 0


@attrs.frozen
class Comeback:
    """What one kill-and-restart of the master showed.

    Attributes:
        roles: the roles the restarted node reported before it was a replica.
        wrong: our connections seen on it while the sentinels' majority named another node.
        failed_back: the sentinels promoted the restarted node again (a spurious down of the
            new master on a loaded machine): it came back a master, legitimately.
    """

    roles: frozenset[str]
    wrong: tuple[bytes, ...]
    failed_back: bool


async def _kill_and_restart_the_master(group: SentinelGroup) -> Comeback:
    name = "never-on-the-old-master"
    old = group.master()
    writes = 0
    roles: set[str] = set()
    wrong: list[bytes] = []

    async def traffic() -> None:
        nonlocal writes
        while True:
            with contextlib.suppress(BrokerUnavailable):
                await client.execute("SET", "k", writes)
                writes += 1
            await trio.sleep(0.01)

    def majority_names_old() -> bool:
        return sum(s.master_port() == old.port for s in group.sentinels) >= 2

    def look() -> None:
        try:
            listing = old.command("CLIENT", "LIST")
        except (OSError, RuntimeError):
            return  # down, or not yet accepting
        ours = [line for line in listing.split(b"\n") if name.encode() in line]
        if ours and not majority_names_old():
            wrong.extend(ours)

    async with open_redis(group.url(query=f"client_name={name}")) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(traffic)
            with trio.fail_after(10):
                while writes < 10:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            await _kill(group, old)
            with trio.fail_after(FAILOVER_BOUND):
                while any(s.master_port() in (old.port, None) for s in group.sentinels):  # noqa: ASYNC110
                    await trio.sleep(0.05)
                switched = writes
                while writes < switched + 10:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            await trio.sleep(1.5)  # the sentinels' links to the new master settle
            # Back on its port with the config it had: it says it is a master until a sentinel
            # turns it into a replica (10-20 s: the sentinels' own timers).
            await trio.to_thread.run_sync(group.restart, old)
            with trio.fail_after(60):
                while (role := old.role()) != "slave" and not majority_names_old():
                    roles.add(role)
                    look()
                    await trio.sleep(0.05)
            settled = writes
            with trio.fail_after(10):
                while writes < settled + 10:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            look()
            nursery.cancel_scope.cancel()
    return Comeback(frozenset(roles), tuple(wrong), failed_back=majority_names_old())


@pytest.mark.chaos
@pytest.mark.timeout(300)  # up to 3 rounds of the sentinels' own 10-20 s reconfiguration
async def test_a_restarted_old_master_comes_back_a_replica_and_gets_no_write(
    redis_sentinel: SentinelGroup,
) -> None:
    for _attempt in range(3):
        redis_sentinel.reset()
        old = redis_sentinel.master()
        comeback = await _kill_and_restart_the_master(redis_sentinel)
        print(f"\nthe restarted old master: {comeback}")
        # Every write it took must have come while the sentinels named it master.
        assert comeback.wrong == ()
        if not comeback.failed_back:
            break
    else:
        pytest.fail("the sentinels failed back to the restarted node 3 times out of 3")
    # It did claim to be one, meanwhile ("down": read before the restarted process accepted
    # connections, as CI saw once).
    assert sorted(comeback.roles - {"down"}) == ["master"]
    assert old.role() == "slave"
    assert redis_sentinel.master() is not old


@pytest.mark.chaos
async def test_a_three_step_workflow_completes_through_a_failover(
    redis_sentinel_url: str, redis_sentinel: SentinelGroup
) -> None:
    app = dt.App("failover")
    calls = {"one": 0, "two": 0, "three": 0}
    two_started = trio.Event()
    release = trio.Event()

    @app.step("one")
    async def one(x: int) -> int:
        calls["one"] += 1
        return x + 1

    @app.step("two")
    async def two(x: int) -> int:
        calls["two"] += 1
        two_started.set()
        await release.wait()  # the master is killed meanwhile: step one is checkpointed
        return x * 10

    @app.step("three")
    async def three(x: int) -> int:
        calls["three"] += 1
        return x + 3

    @app.workflow("chain")
    async def chain(ctx: dt.WorkflowContext, x: int) -> int:
        a = await ctx.step("one", x)
        b = await ctx.step("two", a)
        return int(await ctx.step("three", b))

    old = redis_sentinel.master()
    errors: list[Exception] = []
    async with (
        dt.open_backend(redis_sentinel_url) as backend,
        # A step whose completion fails while no master is known is tried again by the worker
        # for as long as its claim is ours (stalled_threshold: 120 s by default; short here):
        # past that, the stalled sweep re-delivers it (a duplicate).
        dt.open_worker(
            app,
            backend,
            concurrency=2,
            poll_interval=0.05,
            stalled_threshold=3.0,
            stalled_check_interval=0.5,
        ),
        # (the loss audit: a step whose task or result the failover lost is dispatched again
        # once its job has been gone, unanswered, for 3 + 2 * 0.5 + 0.5 s)
        dt.open_engine(
            app,
            backend,
            on_error=errors.append,
            stalled_threshold=3.0,
            stalled_check_interval=0.5,
            audit_interval=0.5,
        ) as engine,
    ):
        run_id = await engine.start("chain", 1)
        with trio.fail_after(20):
            await two_started.wait()
        killed_at = await _kill(redis_sentinel, old)
        release.set()
        with trio.fail_after(60):
            while True:
                try:
                    result = await engine.result(run_id)
                    break
                except BrokerUnavailable:  # asked while no master is known
                    await trio.sleep(0.1)
        took = time.monotonic() - killed_at
        history = await engine.history(run_id)
        duplicates = engine.duplicates(run_id)
        lost = engine.statistics().lost_dispatches
    detected = sum(isinstance(e, dt.StepLost) for e in errors)
    print(
        f"\nkill -> recovered {took:.2f}s, acknowledged-and-lost {lost} (detected {detected}), "
        f"duplicates {sum(calls.values()) - 3} (step calls {calls}; recorded "
        f"{len(duplicates)})"
    )
    assert lost == detected
    assert result == 23
    assert [s.output for s in history] == [2, 20, 23]
    assert redis_sentinel.master() is not old


APP_MODULE = """
import durable_trio as dt

app = dt.App("sentinel-cli")


@app.step("double")
async def double(x: int) -> int:
    return x * 2


@app.workflow("twice")
async def twice(ctx: dt.WorkflowContext, x: int) -> int:
    return int(await ctx.step("double", x))
"""


async def test_the_commands_take_a_sentinel_url(redis_sentinel_url: str, tmp_path: Path) -> None:
    (tmp_path / "sentinel_cli_app.py").write_text(APP_MODULE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    command = [sys.executable, "-m", "durable_trio"]
    target = "sentinel_cli_app:app"
    backend = ["--backend", redis_sentinel_url]
    ran = await trio.run_process(
        [*command, "run", target, "twice", "--input", "21", "--with-worker", *backend],
        env=env,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr.decode()
    outcome = json.loads(ran.stdout)
    assert (outcome["status"], outcome["output"]) == ("completed", 42)
    worker = await trio.lowlevel.open_process(
        [*command, "worker", target, *backend],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert worker.stdout is not None
        with trio.fail_after(20):
            banner = await worker.stdout.receive_some(4096)
        assert banner.startswith(b"worker: serving"), banner
        assert b"redis+sentinel://127.0.0.1:" in banner
    finally:
        worker.send_signal(signal.SIGTERM)
        with trio.fail_after(20):
            status = await worker.wait()
    assert status == 0
