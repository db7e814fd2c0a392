"""The Redis worker-key store: keys with a server-side time-to-live, listed by prefix without
``SCAN``, written in batches cheap enough for an idle worker.

Layout (two keys under one hash tag, ``{durable-keys}`` by default, so one Cluster slot):

=====================  ======  ==================================================================
``{tag}:values``       hash    key -> value
``{tag}:expiry``       zset    key -> its expiry (server milliseconds): the index of live keys
=====================  ======  ==================================================================

Why this shape: a worker beats its liveness keys (one per served token, a descriptor, its last
status) every 10 s, and an idle worker must cost next to nothing (issue 3, S4: at most half a
command a second, and Redis counts the commands a script runs). :meth:`RedisKeyStore.put_many`
writes any number of keys with four commands — the script call, ``TIME``, one ``HSET``, one
``ZADD`` — so a worker serving ten queues still costs 0.4 commands a second for its liveness.

:meth:`RedisKeyStore.entries` is one script: the live members of the expiry index (score above
now), those starting with ``prefix``, read with one ``HMGET``, sorted by key. Its cost grows with
the store's live keys (workers x tokens: hundreds, not millions), never with the keyspace: no
``SCAN``, no ``KEYS``. Readers prune a bounded batch of expired keys; writers never do, so an
idle worker pays nothing for it.

Expiry is on the server's clock (``TIME`` in the scripts); a ``ttl`` is relative seconds, rounded
up to whole milliseconds. A value outliving its index entry is never returned.
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

#: Expired keys removed per listing at most.
PRUNE_BATCH: Final = 256
#: Keys per script call at most (Lua's unpack() has limits).
_CHUNK: Final = 1000

# KEYS: values expiry   ARGV: (key, value, ttl_ms)...
_PUT_MANY: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local fields, scores, gone = {}, {}, {}
for i = 1, #ARGV, 3 do
  local ttl = tonumber(ARGV[i + 2])
  if ttl > 0 then
    fields[#fields + 1] = ARGV[i]
    fields[#fields + 1] = ARGV[i + 1]
    scores[#scores + 1] = now + ttl
    scores[#scores + 1] = ARGV[i]
  else
    gone[#gone + 1] = ARGV[i]
  end
end
if #fields > 0 then
  redis.call('HSET', KEYS[1], unpack(fields))
  redis.call('ZADD', KEYS[2], unpack(scores))
end
if #gone > 0 then
  redis.call('HDEL', KEYS[1], unpack(gone))
  redis.call('ZREM', KEYS[2], unpack(gone))
end
return #fields / 2
"""

# KEYS: values expiry   ARGV: key...
_REMOVE: Final = """
redis.call('HDEL', KEYS[1], unpack(ARGV))
redis.call('ZREM', KEYS[2], unpack(ARGV))
return #ARGV
"""

# KEYS: values expiry   ARGV: prune_batch prefix
# Returns {key, value, key, value, ...} of the live keys starting with prefix, sorted by key.
_ENTRIES: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
if #expired > 0 then
  redis.call('HDEL', KEYS[1], unpack(expired))
  redis.call('ZREM', KEYS[2], unpack(expired))
end
local prefix = ARGV[2]
local names = {}
for _, name in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. now, '+inf')) do
  if string.sub(name, 1, #prefix) == prefix then
    names[#names + 1] = name
  end
end
if #names == 0 then
  return {}
end
table.sort(names)
local values = redis.call('HMGET', KEYS[1], unpack(names))
local out = {}
for i, name in ipairs(names) do
  if values[i] then
    out[#out + 1] = name
    out[#out + 1] = values[i]
  end
end
return out
"""


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
        self._keys = (f"{base}:values", f"{base}:expiry")
        self._put_many: Script = client.script(_PUT_MANY)
        self._remove: Script = client.script(_REMOVE)
        self._entries: Script = client.script(_ENTRIES)

    async def put(self, key: str, value: bytes, ttl: float) -> None:
        """Write ``key`` so that it lives ``ttl`` seconds (server clock) unless written again."""
        await self.put_many([(key, value, ttl)])

    async def put_many(self, items: Sequence[tuple[str, bytes, float]]) -> None:
        """Write every ``(key, value, ttl)`` in one script call (four Redis commands)."""
        if not items:
            await trio.lowlevel.checkpoint()
            return
        for start in range(0, len(items), _CHUNK):
            args: list[RedisArg] = []
            for key, value, ttl in items[start : start + _CHUNK]:
                args += (key, value, math.ceil(ttl * 1000) if ttl > 0 else 0)
            await self._put_many(self._keys, args)

    async def remove(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` now (missing keys are fine)."""
        if not keys:
            await trio.lowlevel.checkpoint()
            return
        for start in range(0, len(keys), _CHUNK):
            await self._remove(self._keys, list(keys[start : start + _CHUNK]))

    async def entries(self, prefix: str) -> list[KeyEntry]:
        """Every live key starting with ``prefix``, sorted by key."""
        reply = await self._entries(self._keys, (PRUNE_BATCH, prefix))
        return [KeyEntry(reply[i].decode(), reply[i + 1]) for i in range(0, len(reply), 2)]

    async def aclose(self) -> None:
        """Nothing to release (the client is the caller's). Idempotent."""
        await trio.lowlevel.checkpoint()
