"""``memory://``: one process (tests, examples); everything is lost when it ends."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from .._redact import redact_url
from ..brokers.memory import MemoryBroker
from ..keys.memory import MemoryKeyStore
from ._backend import Backend, MemoryRunStores

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

__all__ = ["open_memory_backend"]


@asynccontextmanager
async def open_memory_backend(url: str = "memory://") -> AsyncIterator[Backend]:
    """A :class:`MemoryBroker`, a :class:`MemoryKeyStore` and in-process run stores.

    The run stores live on the backend: every engine on it shares the runs of a namespace.
    """
    backend = Backend(
        url=redact_url(url),
        broker=MemoryBroker(),
        keys=MemoryKeyStore(),
        run_stores=MemoryRunStores(),
    )
    try:
        yield backend
    finally:
        await backend.aclose()
