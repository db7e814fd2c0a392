"""Backends: a queue broker and a worker-key store, chosen by URL."""

from __future__ import annotations

from contextlib import asynccontextmanager
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


@asynccontextmanager
async def open_backend(url: str = "memory://") -> AsyncIterator[Backend]:
    """Open the backend ``url`` names, and close it on leaving the block.

    Args:
        url: ``memory://`` (one process, tests), ``sqlite:///path/file.db`` (embedded,
            durable), ``redis://host:port/db`` or ``rediss://...`` (many machines).

    Raises:
        ConfigError: an unknown scheme.
    """
    scheme = urlsplit(url).scheme
    if scheme == "memory":
        backend = Backend(url=url, broker=MemoryBroker(), keys=MemoryKeyStore())
    else:
        raise ConfigError(f"unknown backend URL scheme {scheme!r} in {url!r}")
    try:
        yield backend
    finally:
        await backend.aclose()
