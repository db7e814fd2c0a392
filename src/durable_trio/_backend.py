"""Backends: a queue broker and a worker-key store, chosen by URL."""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import attrs
import trio

from ._errors import ConfigError
from .adapters import QueueBroker
from .adapters.memory import MemoryBroker
from .keys import KeyStore
from .keys.memory import MemoryKeyStore

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

__all__ = ["Backend", "open_backend"]


@attrs.define(eq=False)
class Backend:
    """A queue broker plus (optionally) a worker-key store, opened together.

    Attributes:
        url: the URL it was opened from (credentials removed).
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


async def _open_sqlite(url: str, netloc: str, path: str) -> Backend:
    """``sqlite:///relative/file.db`` or ``sqlite:////absolute/file.db`` (SQLAlchemy's form)."""
    from .adapters.sqlite import SqliteBroker
    from .keys.sqlite import SqliteKeyStore

    if netloc or not path.startswith("/") or path == "/":
        raise ConfigError(f"a SQLite URL is sqlite:///rel.db or sqlite:////abs.db, not {url!r}")
    file = Path(path[1:])
    file.parent.mkdir(parents=True, exist_ok=True)
    broker = await SqliteBroker.open(file)
    try:
        keys = await SqliteKeyStore.attach(broker)
    except BaseException:
        with trio.CancelScope(shield=True):
            await broker.aclose()
        raise
    return Backend(url=url, broker=broker, keys=keys)


@asynccontextmanager
async def open_backend(url: str = "memory://") -> AsyncIterator[Backend]:
    """Open the backend ``url`` names, and close it on leaving the block.

    Args:
        url: ``memory://`` (one process, tests), ``sqlite:///path/file.db`` (embedded,
            durable), ``redis://host:port/db`` or ``rediss://...`` (many machines).

    Raises:
        ConfigError: an unknown scheme.
    """
    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme == "memory":
        backend = Backend(url=url, broker=MemoryBroker(), keys=MemoryKeyStore())
    elif scheme == "sqlite":
        backend = await _open_sqlite(url, parts.netloc, parts.path)
    elif scheme in ("redis", "rediss"):
        # imported here: the Redis backend needs hiredis (the `redis` extra) and imports Backend
        from ._redis_backend import open_redis_backend

        async with open_redis_backend(url) as redis_backend:
            yield redis_backend
        return
    else:
        raise ConfigError(f"unknown backend URL scheme {scheme!r} in {url!r}")
    try:
        yield backend
    finally:
        await backend.aclose()
