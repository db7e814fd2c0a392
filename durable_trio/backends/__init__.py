"""Backends, one module each: a broker, a worker-key store and run stores, chosen by URL.

:func:`open_backend` is the one place that switches on the URL scheme; :mod:`.memory`,
:mod:`.sqlite` and :mod:`.redis` each build their :class:`Backend` (its run-store provider
included, so nothing re-parses the URL later to find the run store).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from .._errors import ConfigError
from .._redact import url_scheme
from ._backend import Backend, MemoryRunStores, RunStores

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from .sqlite import ReadOnlyOption

__all__ = ["Backend", "MemoryRunStores", "RunStores", "open_backend"]

_KNOWN = (
    "memory://, sqlite:///, redis://, rediss://, redis+sentinel://, redis+cluster:// or "
    "postgresql://"
)
#: Schemes served by the Redis backend (one master, found through Sentinel for the sentinel
#: ones; a Redis Cluster for the cluster ones).
_REDIS_SCHEMES = (
    "redis", "rediss", "redis+sentinel", "rediss+sentinel", "redis+cluster", "rediss+cluster"
)  # fmt: skip


@asynccontextmanager
async def open_backend(
    url: str = "memory://",
    *,
    existing: bool = False,
    read_only: ReadOnlyOption = False,
) -> AsyncIterator[Backend]:
    """Open the backend ``url`` names, and close it on leaving the block.

    Args:
        url: ``memory://`` (one process, tests), ``sqlite:///path/file.db`` (embedded,
            durable), ``redis://host:port/db`` or ``rediss://...`` (many machines),
            ``redis+sentinel://s1:26379,s2:26379/MASTER/db`` (the master that Redis
            Sentinel names, followed through failovers; docs/deployment.md), or
            ``redis+cluster://host1:port1,host2:port2`` or ``rediss+cluster://...`` (a Redis
            Cluster: see docs/deployment.md for what runs on one), or
            ``postgresql://user:password@host:port/database[?schema=S&pool_size=N]``
            (PostgreSQL: the tables in one schema, ``durable_trio`` by default; the
            ``postgres`` extra).
        existing: a SQLite file (or a PostgreSQL schema's tables) must exist already:
            nothing is created, and a mistyped path (or schema) is a
            :class:`~durable_trio.ConfigError`, not a new empty database. What the
            commands that only read or repair (``health``, ``runs``, ``jobs``, ``queues``,
            ``console``) pass; no effect on the other schemes.
        read_only: ``True``: open a SQLite file read-only, creating and changing nothing
            (its tables read as they are; every change raises
            :class:`~durable_trio.BrokerError`); ``"if_needed"``: so only when this process
            cannot write the file or the folder SQLite needs beside it (what the commands
            that only read pass: ``runs list``, ``runs show``, ``jobs failed``, ``queues``,
            ``schedules list``, ``health``, a console without ``--allow-actions``); no
            effect on the other schemes (docs/decisions.md, "Read-only SQLite files").

    Raises:
        ConfigError: an unknown scheme, a malformed URL, a SQLite file that cannot be made
            (or, with ``existing``, does not exist).
        AuthenticationError: the server refused the URL's credentials (raised once, not
            retried).
        BrokerUnavailable: the server cannot be reached.

    Error handling: no message ever holds the URL's user name or password (see
    :func:`~durable_trio._redact.redact_url`); ``Backend.url`` is the URL with them masked.
    """
    scheme = url_scheme(url)
    # Each backend's module imported here, when its scheme is asked for: a process loads the
    # one backend it opens (the Redis ones need hiredis, the PostgreSQL one psycopg).
    if scheme == "memory":
        from .memory import open_memory_backend

        opened = open_memory_backend(url)
    elif scheme == "sqlite":
        from .sqlite import open_sqlite_backend

        opened = open_sqlite_backend(url, existing=existing, read_only=read_only)
    elif scheme in _REDIS_SCHEMES:
        # imported here: the Redis backend needs hiredis (the `redis` extra)
        try:
            from .redis import open_redis_backend
        except ModuleNotFoundError as exc:
            if exc.name != "hiredis":
                raise
            raise ConfigError(
                "a redis:// backend needs hiredis: pip install 'durable_trio[redis]'"
            ) from exc

        opened = open_redis_backend(url)
    elif scheme in ("postgresql", "postgres"):
        # imported here: the PostgreSQL backend needs psycopg (the `postgres` extra)
        try:
            from .postgres import open_postgres_backend
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith("psycopg"):
                raise
            raise ConfigError(
                "a postgresql:// backend needs psycopg: pip install 'durable_trio[postgres]'"
            ) from exc

        opened = open_postgres_backend(url, existing=existing)
    elif scheme is None:
        raise ConfigError(f"a backend URL starts with {_KNOWN}")
    else:
        raise ConfigError(f"unknown backend URL scheme {scheme!r} (known: {_KNOWN})")
    async with opened as backend:
        yield backend
