"""Backends: a queue broker and a worker-key store, chosen by URL."""

from __future__ import annotations

import os
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import SplitResult, urlsplit

import attrs
import trio

from ._errors import ConfigError
from ._redact import redact_url, url_scheme
from .adapters import QueueBroker
from .adapters.memory import MemoryBroker
from .keys import KeyStore
from .keys.memory import MemoryKeyStore

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

__all__ = ["Backend", "open_backend"]

_KNOWN = "memory://, sqlite:///, redis:// or rediss://"


@attrs.define(eq=False)
class Backend:
    """A queue broker plus (optionally) a worker-key store, opened together.

    Attributes:
        url: the URL it was opened from, its user name and password masked
            (``redis://***@host:6379/0``, see :func:`~durable_trio._redact.redact_url`).
        broker: the queue broker.
        keys: the worker-key store, or ``None`` (then there is no liveness and no group health).
    """

    url: str
    broker: QueueBroker
    keys: KeyStore | None = None
    _closed: bool = False

    async def aclose(self) -> None:
        """Close the broker and the key store (bounded, idempotent)."""
        if self._closed:
            return
        self._closed = True
        with trio.move_on_after(5.0, shield=True):
            if self.keys is not None:
                await self.keys.aclose()
            await self.broker.aclose()


def _sqlite_file(url: str) -> Path:
    """The database file a ``sqlite:///`` URL names, its folder created if missing.

    Raises:
        ConfigError: the URL is not of that form, or the file cannot be made there (a parent
            is a file, the folder is not writable, the path is a folder).
    """
    parts: SplitResult | None
    try:
        parts = urlsplit(url)
    except ValueError:
        parts = None  # urllib's message quotes the URL: not passed on
    if parts is None or parts.netloc or not parts.path.startswith("/") or parts.path == "/":
        raise ConfigError(
            f"a SQLite URL is sqlite:///rel.db or sqlite:////abs.db, not {redact_url(url)!r}"
        )
    file = Path(parts.path[1:])
    problem: str | None
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        problem = "a parent of it is a file, not a folder"
    except OSError as exc:
        problem = f"its folder cannot be created ({exc.strerror or type(exc).__name__})"
    else:
        problem = None
    if problem is None and file.is_dir():
        problem = "it is a folder"
    if problem is None and not os.access(file if file.exists() else file.parent, os.W_OK):
        problem = "it is not writable" if file.exists() else "its folder is not writable"
    if problem is not None:
        # Raised outside the except blocks: the OS error is said in words, not chained.
        raise ConfigError(f"cannot use {str(file)!r} as the SQLite database file: {problem}")
    return file


async def _open_sqlite(url: str) -> Backend:
    """``sqlite:///relative/file.db`` or ``sqlite:////absolute/file.db`` (SQLAlchemy's form)."""
    from .adapters.sqlite import SqliteBroker
    from .keys.sqlite import SqliteKeyStore

    broker = await SqliteBroker.open(_sqlite_file(url))
    try:
        keys = await SqliteKeyStore.attach(broker)
    except BaseException:
        with trio.CancelScope(shield=True):
            await broker.aclose()
        raise
    return Backend(url=redact_url(url), broker=broker, keys=keys)


@asynccontextmanager
async def open_backend(url: str = "memory://") -> AsyncIterator[Backend]:
    """Open the backend ``url`` names, and close it on leaving the block.

    Args:
        url: ``memory://`` (one process, tests), ``sqlite:///path/file.db`` (embedded,
            durable), ``redis://host:port/db`` or ``rediss://...`` (many machines).

    Raises:
        ConfigError: an unknown scheme, a malformed URL, a SQLite file that cannot be made.
        AuthenticationError: the server refused the URL's credentials (raised once, not
            retried).
        BrokerUnavailable: the server cannot be reached.

    Error handling: no message ever holds the URL's user name or password (see
    :func:`~durable_trio._redact.redact_url`); ``Backend.url`` is the URL with them masked.
    """
    scheme = url_scheme(url)
    if scheme == "memory":
        backend = Backend(url=redact_url(url), broker=MemoryBroker(), keys=MemoryKeyStore())
    elif scheme == "sqlite":
        backend = await _open_sqlite(url)
    elif scheme in ("redis", "rediss"):
        # imported here: the Redis backend needs hiredis (the `redis` extra) and imports Backend
        from ._redis_backend import open_redis_backend

        async with open_redis_backend(url) as redis_backend:
            yield redis_backend
        return
    elif scheme is None:
        raise ConfigError(f"a backend URL starts with {_KNOWN}")
    else:
        raise ConfigError(f"unknown backend URL scheme {scheme!r} (known: {_KNOWN})")
    try:
        yield backend
    finally:
        await backend.aclose()
