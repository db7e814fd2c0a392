"""Shared fixtures: the broker contract's parametrization (every broker runs the same suite)."""

from __future__ import annotations

import faulthandler
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import pytest
import trio.testing

from _every_store import *  # noqa: F403  (every_store, store_clock: exact times on each store)
from _postgres_server import *  # noqa: F403  (the private PostgreSQL server fixtures)
from _redis_cluster import *  # noqa: F403  (the private Redis Cluster fixture)
from _redis_sentinel import *  # noqa: F403  (the private sentinel group)
from _redis_server import *  # noqa: F403  (the private redis-server fixtures)
from durable_trio import _logs
from durable_trio._redis import open_redis, open_redis_cluster
from durable_trio.brokers.memory import MemoryBroker
from durable_trio.brokers.postgres import PostgresBroker
from durable_trio.brokers.redis import RedisBroker, RedisClusterBroker
from durable_trio.brokers.sqlite import SqliteBroker
from durable_trio.keys.memory import MemoryKeyStore

faulthandler.enable()

pytest_plugins = ["pytester"]  # (test_simulation runs the fixtures plugin in an inner session)

#: Every broker the contract suite runs against. Brokers that need a server or a file add
#: themselves here with a factory below.
BROKER_KINDS = ["memory", "sqlite", "redis", "redis-sentinel", "redis-cluster", "postgres"]

BrokerFactory = Callable[[], AbstractAsyncContextManager[Any]]


@pytest.fixture(autouse=True)
def _tracebacks_shown_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no broker error remembered as logged with its traceback
    (``_logs.log_failure`` logs one a place met lately in one line: not across tests)."""
    monkeypatch.setattr(_logs, "_shown", {})


@pytest.fixture(params=BROKER_KINDS)
def broker_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def contract_clock(broker_kind: str) -> trio.testing.MockClock | None:
    """Virtual time where the broker's clock is trio's (memory); the real clock elsewhere (a
    server's clock does not follow a MockClock)."""
    return trio.testing.MockClock(autojump_threshold=0) if broker_kind == "memory" else None


@pytest.fixture
def broker_factory(
    broker_kind: str, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> BrokerFactory:
    """A factory of fresh, empty brokers of ``broker_kind`` (usable from sync tests that run
    their own ``trio.run``)."""
    # The private redis-server, started only when the redis kind is asked for.
    redis_server = request.getfixturevalue("redis_server") if broker_kind == "redis" else None
    # The private sentinel group (1 master, 1 replica, 3 sentinels), likewise.
    group = request.getfixturevalue("redis_sentinel") if broker_kind == "redis-sentinel" else None
    # The private 6-node cluster (3 masters), likewise.
    cluster = request.getfixturevalue("redis_cluster") if broker_kind == "redis-cluster" else None
    # The private PostgreSQL server, likewise (each broker on a fresh schema of its own).
    pg_server = request.getfixturevalue("postgres_server") if broker_kind == "postgres" else None

    @asynccontextmanager
    async def memory() -> AsyncIterator[Any]:
        broker = MemoryBroker()
        try:
            yield broker
        finally:
            await broker.aclose()

    @asynccontextmanager
    async def sqlite() -> AsyncIterator[Any]:
        directory = tmp_path_factory.mktemp("sqlite-broker")
        broker = await SqliteBroker.open(directory / "broker.db")
        try:
            yield broker
        finally:
            await broker.aclose()

    @asynccontextmanager
    async def redis() -> AsyncIterator[Any]:
        assert redis_server is not None
        redis_server.start()  # running even if a test stopped it
        async with open_redis(redis_server.url) as client:
            # A fresh database for every broker (the model test opens one per example).
            await client.execute("FLUSHDB")
            async with RedisBroker(client) as broker:
                yield broker

    @asynccontextmanager
    async def redis_sentinel() -> AsyncIterator[Any]:
        assert group is not None
        await trio.to_thread.run_sync(group.wait_stable)  # whole again if a test killed a node
        async with open_redis(group.url()) as client:
            await client.execute("FLUSHDB")
            async with RedisBroker(client) as broker:
                yield broker

    @asynccontextmanager
    async def redis_cluster() -> AsyncIterator[Any]:
        assert cluster is not None
        cluster.reset()  # every node running, every master flushed
        async with (
            open_redis_cluster(cluster.url) as client,
            RedisClusterBroker(client) as broker,
        ):
            yield broker

    @asynccontextmanager
    async def postgres() -> AsyncIterator[Any]:
        assert pg_server is not None
        pg_server.start()  # running even if a test stopped it
        schema = f"t_{uuid.uuid4().hex[:16]}"
        async with PostgresBroker.open(pg_server.url, schema=schema, pool_size=4) as broker:
            try:
                yield broker
            finally:
                with trio.move_on_after(10, shield=True):
                    await broker.pool.execute(f"DROP SCHEMA {schema} CASCADE")

    factories = {
        "memory": memory,
        "sqlite": sqlite,
        "redis": redis,
        "redis-sentinel": redis_sentinel,
        "redis-cluster": redis_cluster,
        "postgres": postgres,
    }
    return factories[broker_kind]


@pytest.fixture
async def broker(broker_factory: BrokerFactory, contract_clock: object) -> AsyncIterator[Any]:
    async with broker_factory() as b:
        yield b


@pytest.fixture
def key_store() -> MemoryKeyStore:
    return MemoryKeyStore()


from hypothesis import HealthCheck, settings  # noqa: E402

# A loaded 2-core CI machine makes generation slow now and then: that is not a finding.
_RELAXED = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("default", max_examples=30, deadline=None, suppress_health_check=_RELAXED)
settings.register_profile(
    "thorough", max_examples=500, deadline=None, suppress_health_check=_RELAXED
)
settings.load_profile("default")
