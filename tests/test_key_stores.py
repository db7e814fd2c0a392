"""ONE worker-key store contract suite, run against every key store: memory, SQLite, Redis,
PostgreSQL (the stores' own particulars stay in their modules' tests: test_sqlite.py,
test_redis_broker.py). Expiry is on each store's clock: real, short waits."""

from __future__ import annotations

import uuid
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import pytest
import trio

from durable_trio import BrokerUnavailable
from durable_trio._postgres import open_pool
from durable_trio._redis import open_redis
from durable_trio.keys.memory import MemoryKeyStore
from durable_trio.keys.postgres import PRUNE_BATCH, PostgresKeyStore
from durable_trio.keys.redis import RedisKeyStore
from durable_trio.keys.sqlite import SqliteKeyStore

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from durable_trio.keys import KeyStore

KEY_STORE_KINDS = [
    "memory",
    "sqlite",
    "redis",
    pytest.param("postgres", marks=pytest.mark.postgres),
]


@asynccontextmanager
async def _open(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[KeyStore]:
    if kind == "memory":
        yield MemoryKeyStore()
    elif kind == "sqlite":
        async with await SqliteKeyStore.open(tmp_path / "keys.db") as sqlite:
            yield sqlite
    elif kind == "redis":
        async with open_redis(request.getfixturevalue("redis_url")) as client:
            yield RedisKeyStore(client, tag=f"keys-{uuid.uuid4().hex}")
    else:
        async with open_pool(request.getfixturevalue("postgres_url"), size=4) as pool:
            async with await PostgresKeyStore.open(pool, f"k_{uuid.uuid4().hex[:16]}") as pg:
                yield pg


@pytest.fixture(params=KEY_STORE_KINDS)
async def keys(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[KeyStore]:
    async with _open(str(request.param), tmp_path, request) as store:
        yield store


async def test_put_remove_and_sorted_prefix_entries(keys: KeyStore) -> None:
    for key in ("w:b", "w:a", "x:c", "w", "w;", "w:é", "w:Z"):
        await keys.put(key, key.encode(), 10.0)
    assert [e.key for e in await keys.entries("w:")] == ["w:Z", "w:a", "w:b", "w:é"]
    assert [e.key for e in await keys.entries("")] == [
        "w", "w:Z", "w:a", "w:b", "w:é", "w;", "x:c"
    ]  # fmt: skip
    assert (await keys.entries("x:"))[0].value == b"x:c"
    await keys.put("w:a", b"new\x00\xff", 10.0)
    await keys.remove(["w:b", "missing"])
    assert [(e.key, e.value) for e in await keys.entries("w:a")] == [("w:a", b"new\x00\xff")]
    await keys.remove([])
    assert await keys.entries("nothing:") == []


async def test_put_many_writes_every_key_and_the_last_of_a_repeated_one(keys: KeyStore) -> None:
    await keys.put_many([(f"hb:{n:02}", str(n).encode(), 10.0) for n in range(12)])
    await keys.put_many([("hb:00", b"first", 10.0), ("hb:00", b"last", 10.0)])
    await keys.put_many([])
    found = await keys.entries("hb:")
    assert [e.key for e in found] == [f"hb:{n:02}" for n in range(12)]
    assert found[0].value == b"last"


async def test_keys_expire_after_their_ttl_and_a_write_renews_them(keys: KeyStore) -> None:
    await keys.put("k:short", b"1", 0.2)
    await keys.put("k:renewed", b"2", 0.2)
    await keys.put("k:long", b"3", 10.0)
    assert len(await keys.entries("k:")) == 3
    await trio.sleep(0.1)
    await keys.put("k:renewed", b"2", 0.4)
    await trio.sleep(0.15)
    assert [e.key for e in await keys.entries("k:")] == ["k:long", "k:renewed"]
    await trio.sleep(0.35)
    assert [e.key for e in await keys.entries("k:")] == ["k:long"]
    await keys.put("k:gone", b"4", 0)
    assert [e.key for e in await keys.entries("k:")] == ["k:long"]


# -- PostgreSQL's own ------------------------------------------------------------------------


@pytest.mark.postgres
async def test_postgres_prunes_expired_keys_a_bounded_batch_per_write(postgres_url: str) -> None:
    schema = f"k_{uuid.uuid4().hex[:16]}"
    async with open_pool(postgres_url, size=2) as pool:
        keys = await PostgresKeyStore.open(pool, schema)
        await keys.put_many([(f"k:{n:03}", b"", 0.05) for n in range(PRUNE_BATCH + 10)])
        await trio.sleep(0.1)
        await keys.put("k:live", b"", 10.0)
        left = await pool.fetchval(f'SELECT count(*) FROM "{schema}".worker_keys')
        assert left == 10 + 1  # a batch pruned by that write
        await keys.remove(["nothing"])
        assert [e.key for e in await keys.entries("k:")] == ["k:live"]
        assert await pool.fetchval(f'SELECT count(*) FROM "{schema}".worker_keys') == 1
        expires = await pool.fetchval(
            f"SELECT expires_at - extract(epoch FROM clock_timestamp())::float8 "
            f'FROM "{schema}".worker_keys'
        )
        assert 9.0 < expires <= 10.0  # on the server's clock
        await keys.aclose()
        await keys.aclose()
        with pytest.raises(BrokerUnavailable):
            await keys.entries("k:")
        with pytest.raises(BrokerUnavailable):
            await keys.put("k:late", b"", 1.0)
        again = await PostgresKeyStore.open(pool, schema)  # the migration is applied once
        assert [e.key for e in await again.entries("")] == ["k:live"]


@pytest.mark.postgres
async def test_postgres_prefix_entries_are_exact_for_any_unicode_prefix(postgres_url: str) -> None:
    top = chr(0x10FFFF)
    names = ["a", "a" + top, "a" + top + "z", "b", "é", "é1", "ê", "\ud7ff", "\ue000", top, top * 2]
    async with open_pool(postgres_url, size=2) as pool:
        keys = await PostgresKeyStore.open(pool, f"k_{uuid.uuid4().hex[:16]}")
        await keys.put_many([(key, b"", 10.0) for key in names])
        for prefix in ["", "a", "a" + top, "é", "\ud7ff", top, top * 2, "zz"]:
            expected = sorted(k for k in names if k.startswith(prefix))
            assert [e.key for e in await keys.entries(prefix)] == expected, prefix
