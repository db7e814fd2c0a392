"""The :class:`Backend` value: a broker, a worker-key store and a run-store provider.

Each backend module (:mod:`.memory`, :mod:`.sqlite`, :mod:`.redis`) builds one; this module
knows none of them, so they import it and nothing imports back.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Protocol

import attrs
import trio

from .._attrs_shared import shared_repr
from .._errors import BrokerUnavailable
from ..brokers import QueueBroker
from ..keys import KeyStore

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from contextlib import AbstractAsyncContextManager

    from .._engine._stores._contract import RunStore

    # (attrs keeps the field's annotation a string: nothing evaluates it at run time)
    from .._engine._stores.memory import MemoryRunStore  # noqa: TC004

__all__ = ["Backend", "MemoryRunStores", "RunStores"]


class RunStores(Protocol):
    """Opens a backend's run stores, one per namespace (what :func:`open_run_store` uses)."""

    def open(self, namespace: str) -> AbstractAsyncContextManager[RunStore]:
        """Open the store of ``namespace``'s runs; close it (if it is the opener's) on leaving.

        Raises:
            BrokerError: the store could not be opened (its tables created, ...).
        """
        ...

    async def namespaces(self) -> list[str]:
        """The namespaces that hold runs or schedules in this backend, sorted (what the
        ``durable-trio`` commands pick from when no namespace is given).

        Raises:
            BrokerError: the backend could not be read.
        """
        ...


@attrs.define(eq=False, repr=False)
class MemoryRunStores:
    """In-process run stores, one per namespace, held for as long as this object lives.

    Every open of a namespace yields the same :class:`~durable_trio._engine.MemoryRunStore`,
    so two engines on one ``memory://`` backend see the same runs, as two engines on one
    SQLite file do; leaving the block does not close it (the next engine still needs it).
    """

    __repr__ = shared_repr

    _by_namespace: dict[str, MemoryRunStore] = attrs.field(factory=dict, init=False)

    @asynccontextmanager
    async def open(self, namespace: str) -> AsyncIterator[RunStore]:
        """The namespace's memory store (made on first use)."""
        store = self._by_namespace.get(namespace)
        if store is None:
            # imported here: a backend that only carries jobs never loads the run stores
            from .._engine._stores.memory import MemoryRunStore

            store = self._by_namespace[namespace] = MemoryRunStore()
        yield store

    async def namespaces(self) -> list[str]:
        """The namespaces whose store holds a run or a schedule."""
        return sorted(
            [
                namespace
                for namespace, store in self._by_namespace.items()
                if await store.count_runs() or await store.get_schedules()
            ]
        )


@attrs.define(eq=False, repr=False)
class Backend:
    """A queue broker, (optionally) a worker-key store and the run stores, opened together.

    Built by :func:`~durable_trio.open_backend`; a backend built by hand (a wrapped broker in
    a test) gets in-process run stores of its own unless given ``run_stores`` (pass the
    opened backend's, ``run_stores=real.run_stores``, to share its runs). To drop the key
    store of an opened backend keep the rest: ``attrs.evolve(backend, keys=None)``.

    Attributes:
        url: the URL it was opened from, its user name and password masked
            (``redis://***@host:6379/0``, see :func:`~durable_trio._redact.redact_url`).
        broker: the queue broker.
        keys: the worker-key store, or ``None`` (then there is no liveness and no group health).
        run_stores: opens the engine's run stores (see :meth:`open_run_store`).
    """

    __repr__ = shared_repr

    url: str
    broker: QueueBroker
    keys: KeyStore | None = None
    run_stores: RunStores = attrs.field(factory=MemoryRunStores, kw_only=True)
    _closed: bool = attrs.field(default=False, init=False)

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called (then nothing opens on it any more)."""
        return self._closed

    def check_open(self) -> None:
        """Refuse use after close, on every backend alike (a closed ``memory://`` backend
        would otherwise take runs and tasks that nothing ever serves).

        Raises:
            BrokerUnavailable: the backend is closed.
        """
        if self._closed:
            raise BrokerUnavailable(f"the backend {self.url} is closed")

    def open_run_store(self, namespace: str) -> AbstractAsyncContextManager[RunStore]:
        """Open the run store of ``namespace``'s runs on this backend; close it on leaving.

        Raises:
            BrokerUnavailable: the backend is closed.
            BrokerError: the store could not be opened (its tables created, ...).
        """
        return self._open_run_store(namespace)

    @asynccontextmanager
    async def _open_run_store(self, namespace: str) -> AsyncIterator[RunStore]:
        await trio.lowlevel.checkpoint()
        self.check_open()
        async with self.run_stores.open(namespace) as store:
            yield store

    async def aclose(self) -> None:
        """Close the broker and the key store (bounded, idempotent)."""
        if self._closed:
            return
        self._closed = True
        with trio.move_on_after(5.0, shield=True):
            if self.keys is not None:
                await self.keys.aclose()
            await self.broker.aclose()
