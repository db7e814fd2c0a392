"""The Redis Cluster client, against a private 6-node cluster (3 masters, 3 replicas).

The real clock throughout (the server's own timing is involved: failure detection, failover);
every wait is bounded. The topology changes as tests move slots and fail masters over, so tests
look it up (``redis_cluster.owner(slot)``) and never assume which node serves what.
"""

from __future__ import annotations

import random
import socket
import time
from typing import TYPE_CHECKING, Any

import hiredis
import pytest
import trio
import trio.lowlevel

from _redis_cluster import *  # noqa: F403  (the fixture; harmless once conftest imports it too)
from durable_trio._errors import BrokerError, BrokerUnavailable, ConfigError, TransportClosed
from durable_trio._redis import (
    Connection,
    RedisAuthError,
    RedisCrossSlotError,
    RedisReplyError,
    key_slot,
    open_redis,
    open_redis_cluster,
    parse_redis_cluster_url,
)
from durable_trio._redis._cluster import _redirect
from durable_trio._redis._keyslot import command_keys
from durable_trio._redis._topology import Node, parse_shards, parse_slots

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from _redis_cluster import ClusterNode, RedisCluster

pytestmark = pytest.mark.redis


# -- helpers ----------------------------------------------------------------------------------


def _key_on(cluster: RedisCluster, master: ClusterNode, prefix: str = "k") -> str:
    """A key whose slot ``master`` serves now."""
    for index in range(100_000):
        key = f"{prefix}{index}"
        if cluster.owner(key_slot(key)) is master:
            return key
    raise AssertionError("no key found")


def _key_per_master(cluster: RedisCluster, prefix: str) -> tuple[list[ClusterNode], list[str]]:
    """The masters, and one key served by each (in the same order)."""
    masters = cluster.masters()
    return masters, [_key_on(cluster, m, prefix=f"{prefix}{i}-") for i, m in enumerate(masters)]


async def _until(predicate: Callable[[], bool], *, within: float) -> None:
    with trio.fail_after(within):
        while True:
            if predicate():
                return
            await trio.sleep(0.01)


async def _until_async(check: Callable[[], Awaitable[object]], *, within: float) -> None:
    """Until ``check()`` gives something true (``SPUBLISH``: until a subscriber got it)."""
    with trio.fail_after(within):
        while True:
            if await check():
                return
            await trio.sleep(0.02)


def _asking(node: ClusterNode, *command: Any) -> Any:
    """``command`` on ``node`` right after ``ASKING`` (reads a key of a slot being imported)."""
    reader = hiredis.Reader()
    replies: list[Any] = []
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as sock:
        sock.sendall(hiredis.pack_command(("ASKING",)) + hiredis.pack_command(command))
        while len(replies) < 2:
            reader.feed(sock.recv(65536))
            while (reply := reader.gets()) is not False:
                replies.append(reply)
    return replies[1]


def _slot_to_move(cluster: RedisCluster, prefix: str) -> tuple[ClusterNode, ClusterNode, str, int]:
    """Two masters, a key the first serves, and its slot (to move to the second)."""
    source, target = cluster.masters()[:2]
    key = _key_on(cluster, source, prefix=prefix)
    return source, target, key, key_slot(key)


def _begin_migration(slot: int, source: ClusterNode, target: ClusterNode) -> None:
    target.command("CLUSTER", "SETSLOT", slot, "IMPORTING", source.node_id)
    source.command("CLUSTER", "SETSLOT", slot, "MIGRATING", target.node_id)


def _move_keys(slot: int, source: ClusterNode, target: ClusterNode) -> None:
    keys = source.command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    if keys:
        source.command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)


def _end_migration(cluster: RedisCluster, slot: int, target: ClusterNode) -> None:
    """``SETSLOT NODE`` on the target first, then on every master (as ``redis-cli`` does)."""
    target_id = target.node_id
    target.command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
    for node in cluster.masters():
        if node is not target:
            node.command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
    cluster.wait_ok()


# -- key slots and command keys (no server needed for most) -----------------------------------


def test_key_slot_follows_hash_tags() -> None:
    assert key_slot("{user1000}.following") == key_slot("{user1000}.followers")
    assert key_slot("foo{}{bar}") == key_slot("foo{}{bar}")  # an empty tag: the whole key
    assert key_slot("foo{{bar}}zap") == key_slot("{bar")  # the tag is "{bar"
    assert key_slot("foo{bar}{zap}") == key_slot("bar")  # only the first tag counts
    assert key_slot("123456789") == 0x31C3 % 16384  # CRC16/XMODEM's check value
    assert key_slot(b"") == 0


def test_key_slot_agrees_with_the_server_for_many_random_keys(
    redis_cluster: RedisCluster,
) -> None:
    rng = random.Random(17)
    alphabet = "ab{}c:é\x00-_"
    keys: list[str | bytes] = ["", "{}", "{", "}", "{a}", "}{a}"]
    keys += ["".join(rng.choices(alphabet, k=rng.randint(1, 12))) for _ in range(500)]
    keys += [rng.randbytes(rng.randint(1, 20)) for _ in range(200)]
    node = redis_cluster.nodes[0]
    for key in keys:
        assert key_slot(key) == int(node.command("CLUSTER", "KEYSLOT", key)), key


@pytest.mark.parametrize(
    ("command", "keys"),
    [
        (("GET", "a"), ["a"]),
        (("MSET", "a", 1, "b", 2), ["a", "b"]),
        (("BLPOP", "a", "b", 5), ["a", "b"]),
        (("EVALSHA", "f" * 40, 2, "a", "b", "arg"), ["a", "b"]),
        (("ZUNIONSTORE", "d", 2, "a", "b", "WEIGHTS", 1, 2), ["d", "a", "b"]),
        (("XREAD", "COUNT", 2, "STREAMS", "s1", "s2", "0", "0"), ["s1", "s2"]),
        (("XINFO", "STREAM", "s"), ["s"]),
        (("XINFO", "HELP"), []),
        (("PING",), []),
        (("script", "load", "return 1"), []),
        (("LCS", "a", "b"), None),  # not in the table: the client asks the server
        (("EVALSHA", "f" * 40, "two"), None),  # a bad key count: the server says what is wrong
        (("GET",), None),
    ],
)
def test_command_keys(command: tuple[Any, ...], keys: list[str] | None) -> None:
    assert command_keys(command) == keys


# -- the slot map's parsers, with damaged replies ------------------------------------------------


def test_parse_shards_and_slots_read_the_same_map() -> None:
    node = [b"id", b"x", b"port", 7001, b"ip", b"10.0.0.1", b"endpoint", b"10.0.0.1"]
    shards = [
        [b"slots", [0, 99, 200, 16383], b"nodes", [[*node, b"role", b"master", b"health", b"ok"]]],
        [b"slots", [100, 199], b"nodes", [[b"port", 7002, b"endpoint", b"", b"role", b"master"]]],
    ]  # fmt: skip
    slots = [[0, 99, [b"10.0.0.1", 7001, b"x"]], [200, 16383, [b"10.0.0.1", 7001]],
             [100, 199, [b"", 7002]]]  # fmt: skip
    for parsed in (parse_shards(shards, asked="seed"), parse_slots(slots, asked="seed")):
        assert parsed.owners[0] == parsed.owners[16383] == Node("10.0.0.1", 7001)
        assert parsed.owners[150] == Node("seed", 7002)  # no endpoint: the node asked
        assert parsed.masters == (Node("10.0.0.1", 7001), Node("seed", 7002))


@pytest.mark.parametrize(
    "reply",
    [
        None,
        b"garbage",
        [[b"slots", [0, 99999], b"nodes", [[b"port", 1, b"role", b"master"]]]],
        [[b"slots", [0, 5], b"nodes", [[b"port", b"x", b"role", b"master"]]]],
        [[b"slots"]],
        [[1, 2, 3]],
    ],
)
def test_damaged_slot_maps_are_a_clear_broker_error(reply: Any) -> None:
    with pytest.raises(BrokerError, match="not a CLUSTER SHARDS reply from seed"):
        parse_shards(reply, asked="seed")
    with pytest.raises(BrokerError, match="not a CLUSTER SLOTS reply from seed"):
        parse_slots([[0, 5, [b"h"]]] if reply is None else reply, asked="seed")


def test_a_redirect_reply_the_client_cannot_read_is_raised_as_the_error_it_is() -> None:
    here = Node("10.0.0.1", 7000)
    assert _redirect(RedisReplyError("MOVED 3999 10.0.0.2:7001"), here) == (
        False, 3999, Node("10.0.0.2", 7001),
    )  # fmt: skip
    assert _redirect(RedisReplyError("ASK 1 :7002"), here) == (True, 1, Node("10.0.0.1", 7002))
    assert _redirect(RedisReplyError("MOVED x y"), here) is None
    assert _redirect(RedisReplyError("MOVED 12"), here) is None
    assert _redirect(RedisReplyError("ERR MOVED 1 h:1"), here) is None


async def test_a_seed_that_is_not_a_cluster_node_is_a_clear_broker_unavailable(
    redis_url: str,
) -> None:
    seed = redis_url.removeprefix("redis://").removesuffix("/0")
    async with open_redis_cluster(f"redis+cluster://{seed}", retries=1) as client:
        with pytest.raises(BrokerUnavailable, match="cluster support disabled"):
            await client.execute("GET", "a")


async def test_credentials_of_the_url_apply_to_every_node_and_a_refusal_is_final(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    for node in redis_cluster.nodes:
        node.command("ACL", "SETUSER", "alice", "on", ">al1ce-pw", "~*", "&*", "+@all")
    try:
        seeds = redis_cluster_url.removeprefix("redis+cluster://")
        url = f"redis+cluster://alice:al1ce-pw@{seeds}?client_name=cluster-test"
        async with open_redis_cluster(url) as client:
            for master in redis_cluster.masters():
                key = _key_on(redis_cluster, master, prefix="acl-")
                await client.execute("SET", key, "v")
                assert await client.execute("ACL", "WHOAMI", node=master.address) == b"alice"
        refused = f"redis+cluster://alice:wrong@{seeds}"
        async with open_redis_cluster(refused, retries=3) as client:
            started = trio.current_time()
            with pytest.raises(RedisAuthError, match="refused the credentials") as caught:
                await client.execute("GET", "a")
            assert "wrong" not in str(caught.value)
            assert trio.current_time() - started < 1  # not retried: waiting would not fix it
    finally:
        for node in redis_cluster.nodes:
            node.command("ACL", "DELUSER", "alice")


# -- URLs --------------------------------------------------------------------------------------


def test_parse_cluster_url_with_everything() -> None:
    url = parse_redis_cluster_url(
        "rediss+cluster://al%40ice:pw@10.0.0.1:7000,10.0.0.2,[::1]:7002/0"
        "?client_name=w1&ssl_cert_reqs=none"
    )
    assert [(s.host, s.port) for s in url.seeds] == [
        ("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002),
    ]  # fmt: skip
    assert all(s.tls and s.username == "al@ice" and s.password == "pw" for s in url.seeds)
    assert all(s.client_name == "w1" and s.ssl_cert_reqs == "none" for s in url.seeds)
    assert url.address == "10.0.0.1:7000,10.0.0.2:6379,[::1]:7002"
    assert "pw" not in repr(url)
    assert url.node("10.0.0.9", 7009).password == "pw"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://h:1", r"starts with redis\+cluster:// or rediss\+cluster://, not redis://"),
        ("redis+cluster://h1,,h2", "character 20: an empty seed"),
        ("redis+cluster://h1:7000,h2:70x0", "character 28: the port is not a number"),
        ("redis+cluster://h1:99999", "character 20: the port is out of range"),
        ("redis+cluster://h1/3", "character 20: a Redis Cluster has only database 0"),
        ("redis+cluster://h1?db=3", "character 20: an unknown option"),
        ("redis+cluster://u@h1", "character 17: a user name needs a password"),
        ("redis+cluster://u:p#ss@h1", "the host part ends here, before the last '@'"),
        ("redis+cluster://h1?ssl_cert_reqs=none", "ssl_\\* options need a rediss://"),
    ],
)
def test_bad_cluster_urls_are_one_clear_line(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        parse_redis_cluster_url(url)
    assert "\n" not in str(caught.value)
    assert "p#ss" not in str(caught.value)


def test_open_redis_points_a_cluster_url_to_open_redis_cluster() -> None:
    with pytest.raises(ConfigError, match="open_redis_cluster"):
        open_redis("redis+cluster://127.0.0.1:7000")
    with pytest.raises(ConfigError, match="max_redirects"):
        open_redis_cluster("redis+cluster://127.0.0.1:7000", max_redirects=0)


# -- routing -----------------------------------------------------------------------------------


async def test_keys_land_on_the_master_of_their_slot(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    async with open_redis_cluster(redis_cluster_url) as client:
        keys = [f"key-{i}" for i in range(60)]
        for key in keys:
            await client.execute("SET", key, f"v-{key}")
        for key in keys:
            owner = redis_cluster.owner(key_slot(key))
            assert owner.command("GET", key) == f"v-{key}".encode()
            assert client.node_for(key) == owner.address
        assert {client.node_for(key) for key in keys} == {
            node.address for node in redis_cluster.masters()
        }
        assert client.stats.refreshes == 1
        assert client.stats.moved == 0


async def test_same_tag_multi_key_commands_work_and_cross_slot_ones_are_refused(
    redis_cluster_url: str,
) -> None:
    async with open_redis_cluster(redis_cluster_url) as client:
        await client.execute("MSET", "{q}:a", "1", "{q}:b", "2")
        assert await client.execute("MGET", "{q}:a", "{q}:b") == [b"1", b"2"]
        with pytest.raises(RedisCrossSlotError, match="CROSSSLOT: the keys of MSET are in 2"):
            await client.execute("MSET", "a", "1", "b", "2")
        assert await client.execute("EXISTS", "a") == 0  # nothing was sent
        # A command the client's table does not know: its keys come from COMMAND GETKEYS.
        await client.execute("SET", "{q}:c", "abc")
        assert await client.execute("LCS", "{q}:b", "{q}:c") == b""
        with pytest.raises(RedisCrossSlotError, match="LCS"):
            await client.execute("LCS", "a", "b")
        with pytest.raises(RedisCrossSlotError):
            await client.pipeline([("GET", "a"), ("DEL", "a", "b")])
        assert isinstance(RedisCrossSlotError("X", [1, 2]), ConfigError)


async def test_keyless_commands_go_to_any_master_or_the_node_named(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    async with open_redis_cluster(redis_cluster_url) as client:
        assert await client.execute("PING") == b"PONG"
        for master in redis_cluster.masters():
            myid = await client.execute("CLUSTER", "MYID", node=master.address)
            assert myid.decode() == master.node_id
        with pytest.raises(ConfigError, match="host:port"):
            await client.execute("PING", node="nowhere")
        master = redis_cluster.masters()[1]
        async with client.dedicated(node=master.address) as conn:
            assert (await conn.execute("CLUSTER", "MYID")).decode() == master.node_id


async def test_pipeline_across_three_masters_returns_replies_in_caller_order(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    masters, keys = _key_per_master(redis_cluster, "p")
    async with open_redis_cluster(redis_cluster_url) as client:
        commands: list[tuple[Any, ...]] = []
        for round_ in range(5):
            for key in keys:
                commands += [("RPUSH", key, f"{key}-{round_}"), ("LLEN", key)]
        replies = await client.pipeline(commands)
        assert replies == [n for r in range(5) for _ in keys for n in (r + 1, r + 1)]
        batches = {m.address: 0 for m in masters}
        for master in masters:
            pool = await client.pool(master.address)
            batches[master.address] = sum(c.stats.batches for c in pool.connections)
        assert all(batches.values())  # every master got its share
        # Error replies stay in their slots; the first is raised with its index.
        await client.execute("SET", keys[1], "text")
        mixed = [("LLEN", keys[0]), ("LLEN", keys[1]), ("LLEN", keys[2])]
        got = await client.pipeline(mixed, raise_on_error=False)
        assert got[0] == got[2] == 5
        assert isinstance(got[1], RedisReplyError)
        with pytest.raises(RedisReplyError, match="WRONGTYPE") as caught:
            await client.pipeline(mixed)
        assert caught.value.index == 1
        assert await client.pipeline([]) == []


async def test_scripts_run_on_every_node_and_recover_from_a_script_flush(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    masters, keys = _key_per_master(redis_cluster, "s")
    async with open_redis_cluster(redis_cluster_url) as client:
        bump = client.script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
        for key in keys:
            assert await bump(keys=[key], args=[2]) == 2
        masters[0].command("SCRIPT", "FLUSH")  # that node forgets it: NOSCRIPT there only
        for key in keys:
            assert await bump(keys=[key], args=[3]) == 5
        masters[1].command("SCRIPT", "FLUSH")
        replies = await client.pipeline([bump.command([key], [1]) for key in keys])
        assert replies == [6, 6, 6]
        assert all(m.command("SCRIPT", "EXISTS", bump.sha) == [1] for m in masters)
        with pytest.raises(RedisCrossSlotError):
            await bump(keys=["a", "b"], args=[1])


async def test_dedicated_connection_on_the_node_of_a_key(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    async with open_redis_cluster(redis_cluster_url) as client:
        async with client.dedicated(key="{jobs}:ready") as conn:
            assert conn.url.port == redis_cluster.owner(key_slot("{jobs}:ready")).port
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.execute, "RPUSH", "{jobs}:ready", "job-1")
                reply = await conn.execute("BLPOP", "{jobs}:ready", 5, reply_timeout=10)
            assert reply == [b"{jobs}:ready", b"job-1"]
        assert not conn.healthy  # closed on exit


async def test_sharded_pub_sub_delivers_and_closes_quietly(redis_cluster_url: str) -> None:
    async with open_redis_cluster(redis_cluster_url) as client:
        async with client.ssubscribe("{news}:a", "{news}:b") as sub:
            assert await client.spublish("{news}:a", "one") == 1
            assert await client.spublish("{news}:b", b"two") == 1
            with trio.fail_after(5):
                assert await sub.receive() == (b"{news}:a", b"one")
                assert await sub.receive() == (b"{news}:b", b"two")
        with pytest.raises(RedisCrossSlotError):
            async with client.ssubscribe("a", "b"):
                pass
        # Closed by its owner while messages keep coming: the client is not disturbed.
        async with client.ssubscribe("{news}:a", buffer=1) as sub:
            for index in range(5):
                await client.spublish("{news}:a", f"m{index}")
            await trio.sleep(0.1)  # the forwarder waits on the full buffer
            sub.close()
            assert [message async for message in sub] == []
            for index in range(5):
                await client.spublish("{news}:a", f"n{index}")
            await trio.sleep(0.1)
        assert await client.execute("PING") == b"PONG"


# -- slots moving: MOVED and ASK -------------------------------------------------------------


async def test_ask_during_a_half_done_migration_is_followed(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    source, target, key, slot = _slot_to_move(redis_cluster, "ask-")
    async with open_redis_cluster(redis_cluster_url) as client:
        await client.execute("SET", key, "old")
        _begin_migration(slot, source, target)
        try:
            _move_keys(slot, source, target)  # the key is on the target now; the slot is not
            source_only = f"{{{key}}}:absent"
            assert await client.execute("GET", key) == b"old"  # ASK: to the target
            new = f"{{{key}}}:new"
            await client.execute("SET", new, "made-on-target")  # absent on the source: ASK
            assert _asking(target, "GET", new) == b"made-on-target"
            assert client.stats.asked >= 2
            # In a pipeline, only the redirected commands go again (to the target, ASKING).
            elsewhere = _key_on(redis_cluster, redis_cluster.masters()[2], prefix="else-")
            await client.execute("SET", elsewhere, "there")
            asked = client.stats.asked
            replies = await client.pipeline(
                [("GET", key), ("GET", elsewhere), ("GET", new), ("GET", source_only)]
            )
            assert replies == [b"old", b"there", b"made-on-target", None]
            assert client.stats.asked == asked + 3  # the three keys of the migrating slot
            assert client.stats.moved == 0
            assert client.node_for(key) == source.address  # ASK does not change the map
        finally:
            _end_migration(redis_cluster, slot, target)
        assert await client.execute("GET", key) == b"old"  # now MOVED
        assert client.stats.moved == 1
        assert client.node_for(key) == target.address  # at once, from the MOVED reply
        await _until(lambda: client.stats.refreshes >= 2, within=5)  # then the whole map
        assert client.slot_map.owners[slot] == Node("127.0.0.1", target.port)


async def test_map_refreshes_are_coalesced_when_many_calls_meet_moved(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    source, target, key, slot = _slot_to_move(redis_cluster, "many-")
    keys = [f"{{{key}}}:{i}" for i in range(40)]
    async with open_redis_cluster(redis_cluster_url) as client:
        for name in keys:
            await client.execute("SET", name, name)
        _begin_migration(slot, source, target)
        _move_keys(slot, source, target)
        _end_migration(redis_cluster, slot, target)
        results: dict[str, bytes] = {}

        async def get(name: str) -> None:
            results[name] = await client.execute("GET", name)

        async with trio.open_nursery() as nursery:
            for name in keys:
                nursery.start_soon(get, name)
        assert results == {name: name.encode() for name in keys}
        await _until(lambda: client.stats.refreshes >= 2, within=5)
        await trio.sleep(0.2)  # room for any extra refresh to show up
        # The first read, and one for all those 40 MOVED; at most one more: a map read from a
        # replica the cluster bus has not yet told of the slot's new owner (SETSLOT reached the
        # masters only) sends a command to the old one, whose MOVED asks again (seen in CI).
        assert 2 <= client.stats.refreshes <= 3


async def test_servers_without_cluster_shards_are_read_with_cluster_slots(
    redis_cluster: RedisCluster, redis_cluster_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    execute = Connection.execute

    async def before_redis_7(self: Connection, *args: Any, **kwargs: Any) -> Any:
        # Fault injection: answer CLUSTER SHARDS as Redis 6 does.
        if args[:2] == ("CLUSTER", "SHARDS"):
            raise RedisReplyError(
                "ERR Unknown subcommand or wrong number of arguments for 'SHARDS'"
            )
        return await execute(self, *args, **kwargs)

    monkeypatch.setattr(Connection, "execute", before_redis_7)
    async with open_redis_cluster(redis_cluster_url) as client:
        await client.execute("SET", "a", "1")
        assert client.node_for("a") == redis_cluster.owner(key_slot("a")).address
        assert set(client.slot_map.masters) == {
            Node("127.0.0.1", m.port) for m in redis_cluster.masters()
        }


async def test_commands_keep_working_while_a_slot_moves_under_load(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    source, target, key, slot = _slot_to_move(redis_cluster, "load-")
    done = 0
    async with open_redis_cluster(redis_cluster_url) as client:

        async def increment() -> None:
            nonlocal done
            while True:
                await client.execute("INCR", key)
                done += 1
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(increment)
            await trio.sleep(0.2)
            await trio.to_thread.run_sync(_begin_migration, slot, source, target)
            await trio.sleep(0.2)
            await trio.to_thread.run_sync(_move_keys, slot, source, target)
            await trio.sleep(0.2)
            await trio.to_thread.run_sync(_end_migration, redis_cluster, slot, target)
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()
        # Every INCR that returned ran exactly once, on whichever node held the key.
        assert int(await client.execute("GET", key)) in (done, done + 1)  # +1: cancelled mid-way
        assert client.node_for(key) == target.address
        assert client.stats.moved >= 1
        assert done > 50
    print(f"\nINCRs while the slot moved: {done} (ASK followed {client.stats.asked} times)")


async def test_sharded_subscription_follows_its_slot_when_it_moves(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    channel = "{bell}:ring"
    slot = key_slot(channel)
    source = redis_cluster.owner(slot)
    target = next(m for m in redis_cluster.masters() if m is not source)
    async with open_redis_cluster(redis_cluster_url) as client:
        async with client.ssubscribe(channel) as sub:
            await trio.to_thread.run_sync(_begin_migration, slot, source, target)
            await trio.to_thread.run_sync(_end_migration, redis_cluster, slot, target)
            await _until(lambda: sub.resubscribed > 0, within=10)
            await _until_async(lambda: client.spublish(channel, "hi"), within=10)
            with trio.fail_after(5):
                assert await sub.receive() == (channel.encode(), b"hi")
            assert client.node_for(channel) == target.address


async def test_ssubscribe_after_a_move_the_client_missed_follows_moved(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    source, target, key, slot = _slot_to_move(redis_cluster, "sub-")
    channel = f"{{{key}}}:bell"
    async with open_redis_cluster(redis_cluster_url) as client:
        await client.execute("PING")  # the map is read; then the slot moves behind its back
        _begin_migration(slot, source, target)
        _end_migration(redis_cluster, slot, target)
        async with client.ssubscribe(channel) as sub:
            assert client.stats.moved == 1
            assert await client.spublish(channel, "hi") == 1
            with trio.fail_after(5):
                assert await sub.receive() == (channel.encode(), b"hi")


# -- failover --------------------------------------------------------------------------------


@pytest.mark.chaos
async def test_after_a_master_is_killed_its_slots_are_served_again_by_themselves(
    redis_cluster: RedisCluster, redis_cluster_url: str
) -> None:
    await trio.to_thread.run_sync(redis_cluster.wait_replicas_synced)
    victim = redis_cluster.masters()[0]
    key = _key_on(redis_cluster, victim, prefix="fo-")
    channel = f"{{{key}}}:bell"
    async with open_redis_cluster(redis_cluster_url, retries=3) as client:
        await client.execute("SET", key, "before")
        await client.execute("WAIT", 1, 1000, node=victim.address)  # on the replica too
        async with client.ssubscribe(channel) as sub:
            victim.stop(kill=True)
            killed = time.monotonic()
            failures = 0
            with trio.fail_after(30):
                while True:
                    try:
                        value = await client.execute("GET", key)
                        break
                    except BrokerUnavailable:
                        failures += 1
                        await trio.sleep(0.05)
            recovered = time.monotonic() - killed
            print(f"\nkill -9 -> served again: {recovered:.2f}s ({failures} failed calls)")
            assert value == b"before"
            assert client.node_for(key) != victim.address
            await _until_async(lambda: client.spublish(channel, "after"), within=15)
            with trio.fail_after(5):
                assert await sub.receive() == (channel.encode(), b"after")
            assert sub.resubscribed >= 1
    await trio.to_thread.run_sync(redis_cluster.start)  # the victim comes back as a replica
    assert not victim.is_master


async def test_an_unreachable_cluster_is_broker_unavailable_within_a_bound() -> None:
    ports = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in ports)
    async with open_redis_cluster(url, retries=2, backoff_initial=0.01) as client:
        started = trio.current_time()
        with pytest.raises(BrokerUnavailable, match="did not serve the call after 3 attempts"):
            await client.execute("GET", "a")
        assert trio.current_time() - started < 5
        with pytest.raises(BrokerUnavailable):
            async with client.dedicated(key="a"):
                pass


# -- close -----------------------------------------------------------------------------------


async def test_close_is_idempotent_and_later_calls_raise_transport_closed(
    redis_cluster_url: str,
) -> None:
    client = open_redis_cluster(redis_cluster_url)
    with pytest.raises(TransportClosed):
        await client.execute("PING")  # never entered
    with trio.fail_after(5):
        async with client:
            await client.execute("SET", "a", "1")
            async with client.ssubscribe("{c}"):
                client.close()
                client.close()
            with pytest.raises(TransportClosed):
                await client.execute("GET", "a")
    with pytest.raises(RuntimeError, match="only once"):
        async with client:
            pass


async def test_body_exception_propagates_unwrapped(redis_cluster_url: str) -> None:
    async def body() -> None:
        async with open_redis_cluster(redis_cluster_url) as client:
            await client.execute("PING")
            raise KeyError("mine")

    with pytest.raises(KeyError):
        await body()
