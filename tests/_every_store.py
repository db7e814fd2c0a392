"""Exact virtual-time tests on every run store (issue 18): memory, SQLite (a real file), Redis
and PostgreSQL (the suite's private servers), each store following trio's clock.

A test takes the ``every_store`` fixture (the store's kind) and the ``store_clock`` fixture (a
``MockClock`` that jumps only after 250 ms of real idleness: a SQLite commit in its thread or a
Redis reply on its socket is real I/O, which a clock jumping at once would jump over), and
opens its backend and run store with :func:`open_store`. The other stores then read
trio's clock (``follow_trio_clock``), so durable timers wake at their exact virtual time, as on
memory; the brokers keep their own wall clock (nothing here waits on their delays).

PostgreSQL's kind is the private server's URL with a fresh ``schema`` of its own, its tables
made before the test, on the real clock.
"""

from __future__ import annotations

import uuid
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest
import trio.testing

import durable_trio as dt
from durable_trio._engine import open_run_store

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

__all__ = ["every_store", "open_store", "store_clock"]


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
        url = f"{url}?schema=t_{uuid.uuid4().hex[:16]}"
        # Its tables made here, on the real clock: the migrations' DDL can take longer than
        # ``store_clock``'s 250 ms on a loaded machine, and the clock then jumps over the
        # statement's 30 s timeout (a CI run failed so). The test's own open finds them current.
        trio.run(_migrated, url)
        return url
    return str(request.getfixturevalue("redis_url"))


#: The kinds of run store whose stored data a test can reach and damage by hand (a real SQLite
#: file, the private PostgreSQL and Redis servers): the params of a fixture that returns
#: :func:`stored_url`.
STORED_KINDS = [
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("redis", marks=pytest.mark.redis),
]


def stored_url(request: pytest.FixtureRequest, tmp_path: Path, schema_prefix: str) -> str:
    """The backend URL of ``request.param`` (one of :data:`STORED_KINDS`): PostgreSQL's in a
    fresh schema named ``schema_prefix`` and a random suffix, SQLite's a file in ``tmp_path``."""
    if request.param == "postgres":
        suffix = uuid.uuid4().hex[:12]
        return f"{request.getfixturevalue('postgres_url')}?schema={schema_prefix}{suffix}"
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    return "sqlite:///" + str(tmp_path / "runs.db")


async def _migrated(url: str) -> None:
    async with dt.open_backend(url):
        pass


@pytest.fixture
def store_clock() -> trio.testing.MockClock:
    """A virtual clock that jumps after 250 ms of real idleness (see the module docstring)."""
    return trio.testing.MockClock(autojump_threshold=0.25)


@asynccontextmanager
async def open_store(url: str, namespace: str) -> AsyncIterator[tuple[dt.Backend, Any]]:
    """The backend of ``url`` and its run store of ``namespace``, on trio's clock."""
    async with dt.open_backend(url) as backend, open_run_store(backend, namespace) as store:
        follow = getattr(store, "follow_trio_clock", None)
        if follow is not None:
            follow()
        yield backend, store
