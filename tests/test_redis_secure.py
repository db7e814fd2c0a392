"""TLS and AUTH/ACL on a real Redis Cluster and a real Sentinel group (issue 17: "TLS and AUTH/ACL
as on one node").

The cluster (``redis_secure_cluster``) runs with ``tls-cluster`` / ``tls-replication``, a
``requirepass`` and an ACL user; the client reaches it by ``rediss+cluster://`` with a CA file and
the ACL user's credentials, so every node it learns from the slot map must be reached on its TLS
port, with the same credentials. The Sentinel group (``redis_sentinel_auth``) has passwords on the
data nodes and on the sentinels, given in the URL. Real clock, bounded waits.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING
from urllib.parse import quote

import pytest
import trio

import durable_trio as dt
from _redis_cluster import *  # noqa: F403  (the fixture; harmless once conftest imports it too)
from _redis_cluster import SECURE_ACL_USER, SECURE_PASSWORD
from _redis_sentinel import *  # noqa: F403
from _redis_sentinel import AUTH_PASSWORD, AUTH_SENTINEL_PASSWORD
from durable_trio._engine import App, WorkflowContext, open_engine, open_worker
from durable_trio._redis import open_redis, open_redis_cluster
from durable_trio._redis._errors import RedisClusterTLSMismatch
from durable_trio._redis._keyslot import key_slot
from durable_trio._redis._topology import Node, parse_shards
from durable_trio.brokers import Job
from durable_trio.brokers.redis import RedisClusterBroker

if TYPE_CHECKING:
    from _redis_cluster import ClusterNode, RedisCluster
    from _redis_sentinel import SentinelGroup

pytestmark = pytest.mark.redis

USER, USER_PASSWORD = SECURE_ACL_USER
CREDENTIALS = f"{USER}:{quote(USER_PASSWORD, safe='')}"

app = App("secure")


@app.step("double")
async def double(n: int) -> int:
    return 2 * n


@app.workflow("three")
async def three(ctx: WorkflowContext, n: int) -> int:
    for _ in range(3):
        n = await ctx.step("double", n)
    return n


def _queue_per_master(cluster: RedisCluster) -> dict[str, ClusterNode]:
    """One queue name whose slot (``{name}``) each master serves."""
    queues: dict[str, ClusterNode] = {}
    seen: set[str] = set()
    n = 0
    while len(seen) < len(cluster.masters()):
        name = f"t:tasks:secure-{n}"
        owner = cluster.owner(key_slot(f"{{{name}}}"))
        if owner.address not in seen:
            seen.add(owner.address)
            queues[name] = owner
        n += 1
    return queues


@pytest.fixture
def secure_cluster(redis_secure_cluster: RedisCluster) -> RedisCluster:
    redis_secure_cluster.reset()
    return redis_secure_cluster


async def test_rediss_cluster_with_an_acl_user_runs_push_pop_complete_on_every_master(
    secure_cluster: RedisCluster,
) -> None:
    url = secure_cluster.tls_url(CREDENTIALS)
    tls_ports = {node.tls_port for node in secure_cluster.nodes}
    queues = _queue_per_master(secure_cluster)
    async with open_redis_cluster(url) as client, RedisClusterBroker(client) as broker:
        for n, queue in enumerate(queues):
            await broker.push_on(queue, Job(f"job-{n}", b'{"n":1}'))
        for n, queue in enumerate(queues):
            claimed = await broker.pop_from(queue, worker="w1")
            assert claimed is not None
            assert claimed.id == f"job-{n}"
            assert await broker.complete_job(claimed.lease, queue) is True
            assert await broker.pop_from(queue) is None
        # every master was reached on its TLS port (the map a TLS client reads names those),
        # logged in as the ACL user
        masters = client.slot_map.masters
        assert len(masters) == 3
        assert {node.port for node in masters} <= tls_ports
        for node in masters:
            pool = await client.pool(node.address)
            assert pool.url.tls
            assert await pool.execute("ACL", "WHOAMI") == USER.encode()


async def test_moved_redirects_are_followed_to_tls_ports(secure_cluster: RedisCluster) -> None:
    """A slot moved after the client read the map: the ``MOVED`` a node sends a TLS client
    names the new owner's TLS port, and the client follows it there."""
    key = "secure-moved"
    slot = key_slot(key)
    async with open_redis_cluster(secure_cluster.tls_url(CREDENTIALS)) as client:
        await client.execute("SET", key, "before")
        await client.execute("DEL", key)  # the slot must be empty to move it by SETSLOT alone
        source = secure_cluster.owner(slot)
        masters = secure_cluster.masters()
        target = masters[(masters.index(source) + 1) % len(masters)]
        await trio.to_thread.run_sync(_give_slot, secure_cluster, slot, target)
        moved_before = client.stats.moved
        await client.execute("SET", key, "after")
        assert client.stats.moved == moved_before + 1
        assert client.node_for(key) == f"127.0.0.1:{target.tls_port}"
        assert await client.execute("GET", key) == b"after"
    assert target.command("GET", key) == b"after"


def _give_slot(cluster: RedisCluster, slot: int, target: ClusterNode) -> None:
    """Give an empty ``slot`` to ``target`` (``SETSLOT NODE`` on it first, then everywhere)."""
    target_id = target.node_id
    for node in [target, *(n for n in cluster.masters() if n is not target)]:
        node.command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
    cluster.wait_ok()


async def test_requirepass_alone_logs_in_as_the_default_user(secure_cluster: RedisCluster) -> None:
    """The password holds ``@`` and a space: percent-encoded in the URL, decoded for ``AUTH``."""
    url = secure_cluster.tls_url(f":{quote(SECURE_PASSWORD, safe='')}")
    async with open_redis_cluster(url) as client:
        for node in secure_cluster.masters():
            pool = await client.pool(f"127.0.0.1:{node.tls_port}")
            assert await pool.execute("ACL", "WHOAMI") == b"default"


@pytest.mark.parametrize(
    "credentials",
    [
        pytest.param(f"{USER}:wrong-pw", id="acl-user"),
        pytest.param(":wrong-pw", id="requirepass"),
    ],
)
async def test_a_wrong_password_is_a_clear_error_naming_the_url_not_the_secret(
    secure_cluster: RedisCluster, credentials: str
) -> None:
    url = secure_cluster.tls_url(credentials)
    with trio.fail_after(10), pytest.raises(dt.BrokerError) as refused:
        async with dt.open_backend(url) as backend:
            await backend.broker.push_on("t:tasks:x", Job("j", b"{}"))
    text = str(refused.value)
    assert "WRONGPASS" in text or "password" in text.lower()
    assert "wrong-pw" not in text
    assert f"127.0.0.1:{secure_cluster.nodes[0].tls_port}" in text


async def test_an_engine_run_over_rediss_cluster(secure_cluster: RedisCluster) -> None:
    url = secure_cluster.tls_url(CREDENTIALS)
    async with (
        dt.open_backend(url) as backend,
        open_worker(app, backend, namespace="secure", concurrency=4),
        open_engine(app, backend, namespace="secure") as engine,
    ):
        with trio.fail_after(20):
            for n in range(3):
                await engine.start("three", n + 1, run_id=f"r{n}")
            assert [await engine.result(f"r{n}") for n in range(3)] == [8, 16, 24]


def _shards(*nodes: tuple[str, int, int | None]) -> list[list[object]]:
    """A ``CLUSTER SHARDS`` reply (Redis 7.0's shape) of one master per ``(host, port,
    tls_port)``, the slots split between them."""
    reply: list[list[object]] = []
    for index, (host, port, tls_port) in enumerate(nodes):
        fields: list[object] = [b"id", f"n{index}".encode(), b"port", port]
        if tls_port is not None:
            fields += [b"tls-port", tls_port]
        fields += [b"ip", host.encode(), b"endpoint", host.encode(), b"role", b"master"]
        fields += [b"replication-offset", 0, b"health", b"online"]
        first = index * 16384 // len(nodes)
        last = (index + 1) * 16384 // len(nodes) - 1
        reply.append([b"slots", [first, last], b"nodes", [fields]])
    return reply


def test_a_tls_client_sent_to_plain_ports_is_one_clear_line() -> None:
    """Nodes without ``tls-cluster yes`` answer ``CLUSTER SHARDS`` on their TLS port with their
    plain ports only (seen on Redis 7.0): refused at once, naming the setting (without the
    check, each plain port's TLS handshake timed out: 76 s to a "could not connect")."""
    plain = _shards(("127.0.0.1", 7001, None), ("127.0.0.1", 7002, None))
    with pytest.raises(RedisClusterTLSMismatch, match="needs tls-cluster yes") as refused:
        parse_shards(plain, asked="127.0.0.1", tls=True, asked_port=7101)
    assert "127.0.0.1:7101" in str(refused.value)
    assert isinstance(refused.value, dt.ConfigError)
    # with tls-cluster yes: the TLS ports
    announced = _shards(("127.0.0.1", 7001, 7101), ("127.0.0.1", 7002, 7102))
    parsed = parse_shards(announced, asked="127.0.0.1", tls=True, asked_port=7101)
    assert parsed.masters == (Node("127.0.0.1", 7101), Node("127.0.0.1", 7102))
    # TLS on the main port (hosted services), or announced addresses on other hosts: kept
    for asked, port in (("127.0.0.1", 7001), ("seed.example", 6379)):
        parsed = parse_shards(plain, asked=asked, tls=True, asked_port=port)
        assert parsed.masters == (Node("127.0.0.1", 7001), Node("127.0.0.1", 7002))
    # a plain client is never checked
    parse_shards(plain, asked="127.0.0.1", asked_port=7101)


# -- Sentinel with passwords on the data nodes and on the sentinels ------------------------------


@pytest.fixture
def auth_sentinel(redis_sentinel_auth: SentinelGroup) -> SentinelGroup:
    redis_sentinel_auth.reset()
    return redis_sentinel_auth


def _sentinel_url(group: SentinelGroup, password: str, sentinel_password: str) -> str:
    hosts = ",".join(f"127.0.0.1:{s.port}" for s in group.sentinels)
    return (
        f"redis+sentinel://:{quote(password, safe='')}@{hosts}/{group.master_name}/0"
        f"?sentinel_password={quote(sentinel_password, safe='')}"
    )


async def test_sentinel_with_passwords_runs_push_pop_complete_on_the_master(
    auth_sentinel: SentinelGroup,
) -> None:
    url = _sentinel_url(auth_sentinel, AUTH_PASSWORD, AUTH_SENTINEL_PASSWORD)
    async with dt.open_backend(url) as backend:
        broker = backend.broker
        await broker.push_on("t:tasks:s", Job("job-1", b"{}"))
        claimed = await broker.pop_from("t:tasks:s")
        assert claimed is not None
        assert await broker.complete_job(claimed.lease, "t:tasks:s") is True
    master = auth_sentinel.master()
    assert master.command("EXISTS", "{t:tasks:s}:meta") in (0, 1)  # reached, authenticated
    assert int(master.command("DBSIZE")) > 0  # the broker wrote on the master


@pytest.mark.parametrize(
    ("password", "sentinel_password", "secret", "says"),
    [
        pytest.param("wrong-data-pw", AUTH_SENTINEL_PASSWORD, "wrong-data-pw", "WRONGPASS",
                     id="data-nodes"),
        pytest.param(AUTH_PASSWORD, "wrong-sentinel-pw", "wrong-sentinel-pw", "sentinel_password",
                     id="sentinels"),
    ],
)  # fmt: skip
async def test_a_wrong_sentinel_or_data_password_is_a_clear_error(
    auth_sentinel: SentinelGroup, password: str, sentinel_password: str, secret: str, says: str
) -> None:
    url = _sentinel_url(auth_sentinel, password, sentinel_password)
    started = time.monotonic()
    with trio.fail_after(20), pytest.raises(dt.BrokerError) as refused:
        async with dt.open_backend(url) as backend:
            await backend.broker.push_on("t:tasks:s", Job("j", b"{}"))
    text = str(refused.value)
    print(f"\n{text} ({time.monotonic() - started:.2f}s)")
    assert says in text
    assert secret not in text


@pytest.mark.chaos
async def test_a_failover_with_passwords_everywhere_moves_the_writes(
    auth_sentinel: SentinelGroup,
) -> None:
    """SIGKILL the master: the sentinels (``auth-pass``, ``sentinel-pass``) still elect the
    replica, the client (credentials and ``sentinel_password`` from the URL) writes there, and
    the old master, restarted, rejoins as a replica (its ``masterauth``)."""
    url = _sentinel_url(auth_sentinel, AUTH_PASSWORD, AUTH_SENTINEL_PASSWORD)
    old = auth_sentinel.master()
    async with open_redis(url) as client:
        await client.execute("SET", "before", "1")
        await trio.to_thread.run_sync(auth_sentinel.kill, old)
        killed = time.monotonic()
        with trio.fail_after(30):
            while True:
                try:
                    await client.execute("SET", "after", "1")
                    break
                except dt.BrokerUnavailable:
                    await trio.sleep(0.05)
        recovered = time.monotonic() - killed
        new = auth_sentinel.master()
        assert new is not old
        assert await client.execute("GET", "after") == b"1"
    print(f"\nkill -> first write on the promoted replica: {recovered:.2f}s")
    assert new.command("GET", "after") == b"1"
    await trio.to_thread.run_sync(auth_sentinel.wait_stable)  # the old one back, a replica
    # On a loaded machine the sentinels may fail over a second time (1 s down-after) once the
    # old master has rejoined: they only promote a replica that synced, so the old one being
    # the master again also shows it rejoined with its masterauth.
    assert old.role() == "slave" or auth_sentinel.master() is old, old.role()
    assert {old.role(), new.role()} == {"master", "slave"}
