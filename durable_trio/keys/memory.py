"""The in-memory worker-key store (trio's clock)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from ._contract import KeyEntry

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["MemoryKeyStore"]


class MemoryKeyStore:
    """An in-memory :class:`~durable_trio.keys.KeyStore`; expiry on ``trio.current_time()``."""

    def __init__(self) -> None:
        self._keys: dict[str, tuple[bytes, float]] = {}
        self._prune_at = 64  # drop expired keys once the store holds this many

    async def put(self, key: str, value: bytes, ttl: float) -> None:
        await trio.lowlevel.checkpoint()
        self._keys[key] = (value, trio.current_time() + ttl)
        if len(self._keys) >= self._prune_at:
            self._prune(trio.current_time())

    async def put_many(self, items: Sequence[tuple[str, bytes, float]]) -> None:
        await trio.lowlevel.checkpoint()
        now = trio.current_time()
        for key, value, ttl in items:
            self._keys[key] = (value, now + ttl)
        if len(self._keys) >= self._prune_at:
            self._prune(now)

    def _prune(self, now: float) -> None:
        """Drop expired keys. Reads drop them too, but a process that only writes (a worker's
        liveness beats; every transport leaves its last status for a day) would keep every
        instance's keys. Pruning when the store doubled keeps it amortized O(1) a write."""
        expired = [k for k, (_, expires_at) in self._keys.items() if expires_at <= now]
        for key in expired:
            del self._keys[key]
        self._prune_at = max(64, 2 * len(self._keys))

    async def remove(self, keys: Sequence[str]) -> None:
        await trio.lowlevel.checkpoint()
        for key in keys:
            self._keys.pop(key, None)

    async def entries(self, prefix: str) -> list[KeyEntry]:
        await trio.lowlevel.checkpoint()
        self._prune(trio.current_time())
        return [
            KeyEntry(key, value)
            for key, (value, _) in sorted(self._keys.items())
            if key.startswith(prefix)
        ]

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
