"""The Redis worker-key store: keys with a server-side time-to-live, listed by prefix without
``SCAN``, written in batches cheap enough for an idle worker.

Layout: ONE hash under one hash tag (``{durable-keys}:entries`` by default: one Cluster slot),
field = the key, value = ``<expiry in server milliseconds>:<the value>``.

Why this shape: a worker beats its liveness keys (one per served token, a descriptor, its last
status) every 10 s, and an idle worker must cost next to nothing (issue 3, S4: at most half a
command a second — and Redis counts the commands a script runs). :meth:`RedisKeyStore.put_many`
writes any number of keys with ONE ``HSET``, so a worker serving ten queues costs 0.1 command a
second for its liveness.

:meth:`RedisKeyStore.entries` is one script: ``TIME``, ``HGETALL``, then the live fields that
start with ``prefix``, sorted by key; expired fields are deleted on the way (a bounded batch).
Its cost grows with the store's keys (workers x tokens: hundreds, not millions), never with the
keyspace: no ``SCAN``, no ``KEYS``. Readers prune; writers never do, so an idle worker pays
nothing for it.

Expiry is on the server's clock; a ``ttl`` is relative seconds, rounded up to whole
milliseconds. A reader compares with ``TIME`` in its script. A writer reads the server's clock
(``TIME``, in a script on the entries' node) when it first writes, then every
:data:`CLOCK_EVERY` seconds and after a failed write (a failover may have brought another
machine's clock), and in between adds its own monotonic clock's progress to that reading: one
command per write instead of three, the expiries still in the server's time (off by the
monotonic clock's drift over two minutes and half a round trip: microseconds to milliseconds,
against lifetimes of seconds).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Final

import trio

from .._errors import BrokerError, ConfigError
from ._contract import KeyEntry

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._redis import RedisArg, RedisClient, RedisClusterClient, Script

__all__ = ["CLOCK_EVERY", "PRUNE_BATCH", "RedisKeyStore"]

#: Expired keys removed per listing at most.
PRUNE_BATCH: Final = 256
#: Keys per script call at most (Lua's unpack() has limits).
_CHUNK: Final = 1000

#: Seconds between two readings of the server's clock by a writer (see the module docs).
CLOCK_EVERY: Final = 120.0

_monotonic = time.monotonic  # (a test moves it)

# KEYS: entries (so the call goes to its node)   Returns the server's TIME.
_TIME: Final = """
return redis.call('TIME')
"""

# KEYS: entries   ARGV: key...
_REMOVE: Final = """
return redis.call('HDEL', KEYS[1], unpack(ARGV))
"""

# KEYS: entries   ARGV: prune_batch prefix
# Returns {key, value, key, value, ...} of the live keys starting with prefix, sorted by key.
_ENTRIES: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local prefix = ARGV[2]
local all = redis.call('HGETALL', KEYS[1])
local live, expired = {}, {}
for i = 1, #all, 2 do
  local name, stored = all[i], all[i + 1]
  local sep = string.find(stored, ':', 1, true)
  if tonumber(string.sub(stored, 1, sep - 1)) <= now then
    if #expired < tonumber(ARGV[1]) then
      expired[#expired + 1] = name
    end
  elseif string.sub(name, 1, #prefix) == prefix then
    live[#live + 1] = {name, string.sub(stored, sep + 1)}
  end
end
if #expired > 0 then
  redis.call('HDEL', KEYS[1], unpack(expired))
end
table.sort(live, function(a, b) return a[1] < b[1] end)
local out = {}
for _, pair in ipairs(live) do
  out[#out + 1] = pair[1]
  out[#out + 1] = pair[2]
end
return out
"""


class RedisKeyStore:
    """A :class:`~durable_trio.keys.KeyStore` on Redis (server clock, no ``SCAN``).

    Args:
        client: an entered :class:`~durable_trio._redis.RedisClient` or
            ``RedisClusterClient`` (the one hash tag keeps every entry in one slot; not closed
            by the store).
        tag: the hash tag of every key of the store (stores with different tags are disjoint).

    Raises:
        ConfigError: an empty tag, or one with braces.
    """

    def __init__(
        self, client: RedisClient | RedisClusterClient, *, tag: str = "durable-keys"
    ) -> None:
        if not tag or "{" in tag or "}" in tag:
            raise ConfigError(f"a key store tag is not empty and has no braces: {tag!r}")
        self._keys = (f"{{{tag}}}:entries",)
        self._client = client
        self._time: Script = client.script(_TIME)
        self._remove: Script = client.script(_REMOVE)
        self._entries: Script = client.script(_ENTRIES)
        self._clock: tuple[int, float] | None = None
        """(the server's clock in ms, this process's monotonic clock then), or ``None``."""

    async def _server_ms(self) -> int:
        """The server's clock now, in whole milliseconds (see the module docs)."""
        now = _monotonic()
        if self._clock is None or now - self._clock[1] >= CLOCK_EVERY:
            seconds, micros = await self._time(self._keys, ())
            after = _monotonic()
            # (the reading is taken somewhere in the round trip: its middle, at most half of
            # it off)
            self._clock = (int(seconds) * 1000 + int(micros) // 1000, (now + after) / 2)
            now = after
        server, at = self._clock
        return server + math.floor((now - at) * 1000)

    async def put(self, key: str, value: bytes, ttl: float) -> None:
        """Write ``key`` so that it lives ``ttl`` seconds (server clock) unless written again."""
        await self.put_many([(key, value, ttl)])

    async def put_many(self, items: Sequence[tuple[str, bytes, float]]) -> None:
        """Write every ``(key, value, ttl)`` in one ``HSET`` (a ``ttl`` <= 0: deleted, one
        ``HDEL``); a key given twice: the last."""
        if not items:
            await trio.lowlevel.checkpoint()
            return
        try:
            for start in range(0, len(items), _CHUNK):
                now = await self._server_ms()
                fields: dict[str, bytes] = {}
                gone: dict[str, None] = {}
                for key, value, ttl in items[start : start + _CHUNK]:
                    if ttl > 0:
                        gone.pop(key, None)
                        fields[key] = b"%d:%b" % (now + math.ceil(ttl * 1000), bytes(value))
                    else:
                        fields.pop(key, None)
                        gone[key] = None
                if fields:
                    args: list[RedisArg] = ["HSET", self._keys[0]]
                    for key, stored in fields.items():
                        args += (key, stored)
                    await self._client.execute(*args)
                if gone:
                    await self._client.execute("HDEL", self._keys[0], *gone)
        except BrokerError:
            self._clock = None  # (a failover may have brought another clock: read it again)
            raise

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
