"""The Redis worker-key store: keys with a server-side TTL, listed by prefix without ``SCAN``.

Layout (every key under one hash tag, ``{durable-keys}`` by default, so one Cluster slot):

=============================  ======  ======================================================
``{tag}:v:<key>``              string  the value, written with ``PX`` (Redis expires it)
``{tag}:names``                zset    every key, score 0: ``ZRANGEBYLEX`` finds a prefix
``{tag}:expiry``               zset    every key, score = its expiry (server milliseconds)
=============================  ======  ======================================================

:meth:`RedisKeyStore.entries` is one script: ``ZRANGEBYLEX [prefix (prefix\\xff`` on the name
index (O(log n + m): ``0xff`` never occurs in UTF-8, so the range is exactly the keys that start
with ``prefix``, in code-point order like Python's ``sorted``), each checked against its expiry
and read. No ``SCAN`` or ``KEYS``, whatever the size of the keyspace. Index members of expired
keys are pruned a bounded batch at a time by every write and every listing. The value keys are
named inside the scripts from the tag (not declared in ``KEYS``): they share the hash tag, so
Redis Cluster serves them from the same slot.

Expiry is on the server's clock (``TIME`` in the scripts, ``PX`` on the values); a ``ttl`` is
relative seconds, rounded up to whole milliseconds.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Final

import trio

from .._errors import ConfigError
from ._contract import KeyEntry

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._redis import RedisArg, RedisClient, Script

__all__ = ["PRUNE_BATCH", "RedisKeyStore"]

#: Expired index members removed per call at most.
PRUNE_BATCH: Final = 64

_REMOVE_BATCH: Final = 1000

_NOW_MS_AND_PRUNE: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
if #expired > 0 then
  redis.call('ZREM', KEYS[1], unpack(expired))
  redis.call('ZREM', KEYS[2], unpack(expired))
end
"""

# KEYS: names expiry value_key   ARGV: prune_batch key value ttl_ms
_PUT: Final = (
    _NOW_MS_AND_PRUNE
    + """
local ttl = tonumber(ARGV[4])
if ttl <= 0 then
  redis.call('DEL', KEYS[3])
  redis.call('ZREM', KEYS[1], ARGV[2])
  redis.call('ZREM', KEYS[2], ARGV[2])
  return 0
end
redis.call('SET', KEYS[3], ARGV[3], 'PX', ttl)
redis.call('ZADD', KEYS[1], 0, ARGV[2])
redis.call('ZADD', KEYS[2], now + ttl, ARGV[2])
return 1
"""
)

# KEYS: names expiry value_key...   ARGV: key...
_REMOVE: Final = """
redis.call('DEL', unpack(KEYS, 3))
redis.call('ZREM', KEYS[1], unpack(ARGV))
redis.call('ZREM', KEYS[2], unpack(ARGV))
return #ARGV
"""

# KEYS: names expiry   ARGV: prune_batch value_key_prefix range_min range_max
# Returns {key, value, key, value, ...} of the live keys in the range, sorted by key.
_ENTRIES: Final = (
    _NOW_MS_AND_PRUNE
    + """
local out = {}
for _, name in ipairs(redis.call('ZRANGEBYLEX', KEYS[1], ARGV[3], ARGV[4])) do
  local expires = redis.call('ZSCORE', KEYS[2], name)
  if expires and tonumber(expires) > now then
    local value = redis.call('GET', ARGV[2] .. name)
    if value then
      out[#out + 1] = name
      out[#out + 1] = value
    end
  end
end
return out
"""
)


class RedisKeyStore:
    """A :class:`~durable_trio.keys.KeyStore` on Redis (server clock, no ``SCAN``).

    Args:
        client: an entered :class:`~durable_trio._redis.RedisClient` (not closed by the store).
        tag: the hash tag of every key of the store (stores with different tags are disjoint).

    Raises:
        ConfigError: an empty tag, or one with braces.
    """

    def __init__(self, client: RedisClient, *, tag: str = "durable-keys") -> None:
        if not tag or "{" in tag or "}" in tag:
            raise ConfigError(f"a key store tag is not empty and has no braces: {tag!r}")
        base = f"{{{tag}}}"
        self._names = f"{base}:names"
        self._expiry = f"{base}:expiry"
        self._value_prefix = f"{base}:v:"
        self._put: Script = client.script(_PUT)
        self._remove: Script = client.script(_REMOVE)
        self._entries: Script = client.script(_ENTRIES)

    async def put(self, key: str, value: bytes, ttl: float) -> None:
        """Write ``key`` so that it lives ``ttl`` seconds (server clock) unless written again."""
        ttl_ms = math.ceil(ttl * 1000) if ttl > 0 else 0
        await self._put(
            (self._names, self._expiry, self._value_prefix + key),
            (PRUNE_BATCH, key, value, ttl_ms),
        )

    async def remove(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` now (missing keys are fine)."""
        if not keys:
            await trio.lowlevel.checkpoint()
            return
        for start in range(0, len(keys), _REMOVE_BATCH):  # bounded: Lua's unpack() has limits
            chunk = list(keys[start : start + _REMOVE_BATCH])
            value_keys = [self._value_prefix + key for key in chunk]
            await self._remove((self._names, self._expiry, *value_keys), chunk)

    async def entries(self, prefix: str) -> list[KeyEntry]:
        """Every live key starting with ``prefix``, sorted by key."""
        bounds: tuple[RedisArg, RedisArg]
        if prefix:
            raw = prefix.encode()
            bounds = (b"[" + raw, b"(" + raw + b"\xff")
        else:
            bounds = ("-", "+")
        reply = await self._entries(
            (self._names, self._expiry), (PRUNE_BATCH, self._value_prefix, *bounds)
        )
        return [KeyEntry(reply[i].decode(), reply[i + 1]) for i in range(0, len(reply), 2)]

    async def aclose(self) -> None:
        """Nothing to release (the client is the caller's). Idempotent."""
        await trio.lowlevel.checkpoint()
