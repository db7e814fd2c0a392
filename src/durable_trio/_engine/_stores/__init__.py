"""Run stores: the contract (:class:`RunStore`) and one implementation per backend family.

:func:`open_run_store` picks the store that matches a backend's URL scheme: ``memory://`` ->
:class:`~.memory.MemoryRunStore` (one per broker, so engines sharing an in-process backend share
their runs), ``sqlite:///`` -> :class:`~.sqlite.SqliteRunStore` (tables in the same file, on
the broker's connection thread), ``redis://`` / ``rediss://`` -> :class:`~.redis.RedisRunStore`
(on the broker's Redis client).
"""

from __future__ import annotations

import weakref
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import trio

from ..._errors import ConfigError
from ._contract import RunStore
from .memory import MemoryRunStore

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from ..._backend import Backend

__all__ = ["MemoryRunStore", "RunStore", "open_run_store"]

#: In-process backends share one memory store per (broker, namespace): two engines on one
#: ``memory://`` backend see the same runs, as two engines on one SQLite file do.
_MEMORY_STORES: weakref.WeakKeyDictionary[Any, dict[str, MemoryRunStore]] = (
    weakref.WeakKeyDictionary()
)


def _memory_store(broker: Any, namespace: str) -> MemoryRunStore:
    try:
        by_namespace = _MEMORY_STORES.setdefault(broker, {})
    except TypeError:  # a broker that cannot be weakly referenced: a store of its own
        return MemoryRunStore()
    store = by_namespace.get(namespace)
    if store is None:
        store = by_namespace[namespace] = MemoryRunStore()
    return store


def _redis_client(broker: Any) -> Any:
    # The broker's own client (the Redis backend opens one client for broker and key store).
    client = getattr(broker, "client", None)
    if client is None:
        raise ConfigError("a redis:// backend whose broker exposes no Redis client")
    return client


@asynccontextmanager
async def open_run_store(backend: Backend, namespace: str) -> AsyncIterator[RunStore]:
    """Open the run store of ``backend`` for ``namespace``'s runs; close it on leaving.

    Args:
        backend: from :func:`~durable_trio.open_backend` (its URL scheme picks the store).
        namespace: whose runs (engines use their transport namespace, by default the app name).

    Raises:
        ConfigError: a backend URL scheme with no run store.
        BrokerError: the store could not be opened (its tables created, ...).
    """
    scheme = urlsplit(backend.url).scheme
    store: Any
    if scheme == "memory":
        store = _memory_store(backend.broker, namespace)
        yield store
        return
    if scheme == "sqlite":
        from ...adapters.sqlite import SqliteBroker
        from .sqlite import SqliteRunStore

        broker = backend.broker
        if isinstance(broker, SqliteBroker):
            store = await SqliteRunStore.attach(broker, namespace)
        else:  # a wrapped broker (tests): a connection of our own to the same file
            path = urlsplit(backend.url).path
            store = await SqliteRunStore.open(Path(path[1:]), namespace)
    elif scheme in ("redis", "rediss"):
        from .redis import RedisRunStore

        store = RedisRunStore(_redis_client(backend.broker), namespace)
    else:
        raise ConfigError(f"no run store for backend URL scheme {scheme!r} ({backend.url!r})")
    try:
        yield store
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()
