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

    async def put(self, key: str, value: bytes, ttl: float) -> None:
        await trio.lowlevel.checkpoint()
        self._keys[key] = (value, trio.current_time() + ttl)

    async def put_many(self, items: Sequence[tuple[str, bytes, float]]) -> None:
        await trio.lowlevel.checkpoint()
        now = trio.current_time()
        for key, value, ttl in items:
            self._keys[key] = (value, now + ttl)

    async def remove(self, keys: Sequence[str]) -> None:
        await trio.lowlevel.checkpoint()
        for key in keys:
            self._keys.pop(key, None)

    async def entries(self, prefix: str) -> list[KeyEntry]:
        await trio.lowlevel.checkpoint()
        now = trio.current_time()
        expired = [k for k, (_, expires_at) in self._keys.items() if expires_at <= now]
        for key in expired:
            del self._keys[key]
        return [
            KeyEntry(key, value)
            for key, (value, _) in sorted(self._keys.items())
            if key.startswith(prefix)
        ]

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
