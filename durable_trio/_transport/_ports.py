"""What the transport needs of a backend, as protocols of its own: a queue broker and
(optionally) a worker-key store.

The transport sits below the backends (``durable_trio.backends`` builds a ``Backend`` from a
URL and imports the engine's run stores): it must not import them. Any object with these
members will do — ``durable_trio.Backend`` is one, a test's wrapped broker another — and the
key stores of ``durable_trio.keys`` satisfy :class:`KeyStore` structurally.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..brokers import QueueBroker

__all__ = ["KeyEntry", "KeyStore", "TransportBackend"]


class KeyEntry(Protocol):
    """One live key of a key store, as its reads return it."""

    @property
    def key(self) -> str: ...

    @property
    def value(self) -> bytes: ...


class KeyStore(Protocol):
    """What the transport writes its liveness, descriptors and inbox registrations through:
    keys that expire after a time-to-live on the store's own clock."""

    async def put(self, key: str, value: bytes, ttl: float) -> None:
        """Write ``key`` so that it lives ``ttl`` seconds unless written again."""
        ...

    async def put_many(self, items: Sequence[tuple[str, bytes, float]]) -> None:
        """``put`` for every ``(key, value, ttl)``, in as few calls as the store can."""
        ...

    async def remove(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` now (missing keys are fine)."""
        ...

    async def entries(self, prefix: str) -> Sequence[KeyEntry]:
        """Every live key starting with ``prefix``, sorted by key."""
        ...


class TransportBackend(Protocol):
    """What a transport is opened over: a broker, a key store or ``None`` (then there is no
    liveness and no group health), and a check that it is still open."""

    @property
    def broker(self) -> QueueBroker: ...

    @property
    def keys(self) -> KeyStore | None: ...

    def check_open(self) -> None:
        """Refuse use after close.

        Raises:
            BrokerUnavailable: the backend is closed.
        """
        ...
