"""``open_backend("redis://...")``: one client, the Redis broker and key store on it.

Imported lazily by :func:`~durable_trio._backend.open_backend` (``hiredis`` is an optional
dependency, and this module imports ``_backend`` for the :class:`Backend` class).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from ._backend import Backend
from ._redact import redact_url
from ._redis import open_redis
from .adapters.redis import RedisBroker
from .keys.redis import RedisKeyStore

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

__all__ = ["open_redis_backend"]


@asynccontextmanager
async def open_redis_backend(
    url: str, *, key_tag: str = "durable-keys", pool_size: int = 2, **broker_options: Any
) -> AsyncIterator[Backend]:
    """Open a Redis client on ``url`` with a :class:`RedisBroker` and a :class:`RedisKeyStore`.

    Everything is closed on leaving the block (the backend first, bounded, then the client).

    Args:
        url: ``redis://[[user]:password@]host[:port][/db]`` or ``rediss://...``.
        key_tag: the key store's hash tag (see :class:`RedisKeyStore`).
        pool_size: shared connections of the client (plus one for the doorbell subscription).
        **broker_options: :class:`RedisBroker` options (``failed_retention`` ...).

    Yields:
        the backend.

    Raises:
        ConfigError: a bad URL or option.
        AuthenticationError: the server refused the credentials, or the user's ACL denies
            ``PING`` (raised once: a refusal is not retried).
        BrokerUnavailable: the server cannot be reached.
    """
    async with open_redis(url, pool_size=pool_size) as client:
        # One round trip before anything uses the backend, so a wrong password or an
        # unreachable server fails the open, once, instead of every loop of every transport
        # reporting it and backing off (and a worker announcing it serves meanwhile).
        await client.execute("PING")
        async with RedisBroker(client, **broker_options) as broker:
            backend = Backend(
                url=redact_url(url), broker=broker, keys=RedisKeyStore(client, tag=key_tag)
            )
            try:
                yield backend
            finally:
                await backend.aclose()
