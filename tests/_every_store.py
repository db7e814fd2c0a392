"""Exact virtual-time tests on every run store (issue 18): memory, SQLite (a real file), Redis
and PostgreSQL (the suite's private servers), each store following trio's clock.

A test takes the ``every_store`` fixture (the store's kind) and the ``store_clock`` fixture (a
``MockClock`` that jumps only after 250 ms of real idleness: a SQLite commit in its thread or a
Redis reply on its socket is real I/O, which a clock jumping at once would jump over), and
opens its backend and run store with :func:`open_store`. The other stores then read
trio's clock (``follow_trio_clock``), so durable timers wake at their exact virtual time, as on
memory; the brokers keep their own wall clock (nothing here waits on their delays).

PostgreSQL has no backend URL yet (``backends/postgres.py`` is another step's): its kind is
``postgres-store:SCHEMA:URL``, which :func:`open_store` opens as a memory backend whose key store
and run stores are PostgreSQL's, in a fresh schema of the private server, their wakes heard on a
real ``LISTEN`` connection (``_postgres_hub.py``).
"""

from __future__ import annotations

import uuid
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest
import trio.testing

import durable_trio as dt
from durable_trio._engine import open_run_store

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

__all__ = ["every_store", "open_store", "store_clock"]


#: The prefix of a PostgreSQL store's kind (see the module docs).
POSTGRES_STORE = "postgres-store:"


@pytest.fixture(
    params=["memory", "sqlite", "redis", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def every_store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The backend URL of each kind of run store."""
    if request.param == "memory":
        return "memory://"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'runs.db'}".replace("///", "////", 1)
    if request.param == "postgres":
        url = str(request.getfixturevalue("postgres_url"))
        return f"{POSTGRES_STORE}t_{uuid.uuid4().hex[:16]}:{url}"
    return str(request.getfixturevalue("redis_url"))


@pytest.fixture
def store_clock() -> trio.testing.MockClock:
    """A virtual clock that jumps after 250 ms of real idleness (see the module docstring)."""
    return trio.testing.MockClock(autojump_threshold=0.25)


@asynccontextmanager
async def _postgres_backend(kind: str) -> AsyncIterator[dt.Backend]:
    """A memory backend whose key store and run stores are PostgreSQL's (see the module docs)."""
    from _postgres_hub import open_listener_hub
    from durable_trio._engine._stores.postgres import PostgresRunStores
    from durable_trio._postgres import open_pool
    from durable_trio.keys.postgres import PostgresKeyStore

    schema, url = kind.removeprefix(POSTGRES_STORE).split(":", 1)
    async with (
        dt.open_backend("memory://") as memory,
        open_pool(url, size=8) as pool,
        open_listener_hub(url) as hub,
    ):
        backend = dt.Backend(
            url=f"postgresql (schema {schema})",
            broker=memory.broker,
            keys=await PostgresKeyStore.open(pool, schema),
            run_stores=PostgresRunStores(pool, schema, hub=hub),
        )
        try:
            yield backend
        finally:
            await backend.aclose()


def open_backend(url: str) -> AbstractAsyncContextManager[dt.Backend]:
    """:func:`dt.open_backend`, and the PostgreSQL stores' kind (see the module docs)."""
    return _postgres_backend(url) if url.startswith(POSTGRES_STORE) else dt.open_backend(url)


@asynccontextmanager
async def open_store(url: str, namespace: str) -> AsyncIterator[tuple[dt.Backend, Any]]:
    """The backend of ``url`` and its run store of ``namespace``, on trio's clock."""
    async with open_backend(url) as backend, open_run_store(backend, namespace) as store:
        follow = getattr(store, "follow_trio_clock", None)
        if follow is not None:
            follow()
        yield backend, store
