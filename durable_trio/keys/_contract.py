"""The worker-key store contract.

Keys expire after a time-to-live measured on the store's own clock (trio's clock in memory, the
server's on Redis): a ``ttl`` rather than an absolute ``expires_at``, so no two processes' clocks
ever need to agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import attrs

from .._attrs_shared import shared_eq, shared_hash, shared_repr

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["KeyEntry", "KeyStore"]


@attrs.frozen(repr=False, eq=False)
class KeyEntry:
    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    key: str
    value: bytes


class KeyStore(Protocol):
    async def put(self, key: str, value: bytes, ttl: float) -> None:
        """Write ``key`` so that it lives ``ttl`` seconds unless written again."""
        ...

    async def put_many(self, items: Sequence[tuple[str, bytes, float]]) -> None:
        """``put`` for every ``(key, value, ttl)``, in as few calls to the store as it can (a
        worker writes all its liveness keys at once)."""
        ...

    async def remove(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` now (missing keys are fine)."""
        ...

    async def entries(self, prefix: str) -> list[KeyEntry]:
        """Every live key starting with ``prefix``, sorted by key."""
        ...

    async def aclose(self) -> None:
        """Release resources. Idempotent."""
        ...
