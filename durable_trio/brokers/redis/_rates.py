"""The Redis broker's rate limits (``SupportsRateLimits``), each key under the queue's hash
tag (one slot on a Cluster):

- ``{Q}:rate``: a hash (``count``, ``per``), the queue's rate;
- ``{Q}:starts``: the sliding-window log, a sorted set of one member per start scored by its
  time on the server's clock (``TIME``). A take is one script run (it runs alone on the
  server, so its count is exact): it drops the members out of the window, counts the rest,
  and adds what fits, members unique per call (a random nonce and their place in it). The log
  expires a little after its window: an idle queue leaves nothing behind;
- ``{Q}:starts:<key>``: a key's log, for a per-key rate (``per_key`` in ``{Q}:rate``);
- ``{Q}:rate-keys``: the keys with a start in their window (a sorted set scored by each key's
  last start), kept by the per-key takes, so the operator's view finds the keys' logs
  without scanning; it expires with its newest log.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any, Final

import attrs

from .._contract import QueueStats, RateGrant
from .._rates import check_rate, window_fields

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..._redis import RedisClient, RedisClusterClient
    from ._queue import Queue

__all__ = ["RedisRates"]

_READ_RATE: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local r = redis.call('HMGET', KEYS[1], 'count', 'per')
local count, per = tonumber(r[1]), tonumber(r[2])
if count and (count < 1 or count ~= math.floor(count)) then count = nil end
if per and not (per > 0 and per < math.huge) then per = nil end
"""

# KEYS: rate starts [key-index]; ARGV: want nonce [key].
# Returns {granted, retry_after, at} (floats as %.17g).
_TAKE: Final = (
    _READ_RATE
    + """
local want = tonumber(ARGV[1])
local at = string.format('%.17g', now)
if not count or not per then
  return {want, '0', at}
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', string.format('%.17g', now - per))
local n = redis.call('ZCARD', KEYS[2])
if n < count then
  local granted = math.min(count - n, want)
  for i = 1, granted do
    redis.call('ZADD', KEYS[2], at, at .. ':' .. ARGV[2] .. ':' .. i)
  end
  redis.call('PEXPIRE', KEYS[2], math.ceil(per * 1000) + 1000)
  if KEYS[3] then
    redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', string.format('%.17g', now - per))
    redis.call('ZADD', KEYS[3], at, ARGV[3])
    redis.call('PEXPIRE', KEYS[3], math.ceil(per * 1000) + 1000)
  end
  return {granted, '0', at}
end
local oldest = redis.call('ZRANGE', KEYS[2], n - count, n - count, 'WITHSCORES')
return {0, string.format('%.17g', math.max(0, tonumber(oldest[2]) + per - now)), at}
"""
)

# KEYS: starts; ARGV: at n. Removes n members scored at.
_GIVE_BACK: Final = """
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[1], ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
if #gone > 0 then
  redis.call('ZREM', KEYS[1], unpack(gone))
end
return #gone
"""

#: The most keys of a per-key rate the operator's view counts.
MAX_WINDOW_KEYS: Final = 10_000

# KEYS: rate starts key-index; ARGV: max keys. Returns {} (no rate) or {count, per, starts in
# the keyless window, per_key, since, the keys with a start in their window...}.
_WINDOW: Final = (
    _READ_RATE
    + """
if not count or not per then
  return {}
end
local since = string.format('%.17g', now - per)
local starts = redis.call('ZCOUNT', KEYS[2], '(' .. since, '+inf')
local per_key = redis.call('HGET', KEYS[1], 'per_key') == '1'
local out = {count, string.format('%.17g', per), starts, per_key and 1 or 0, since}
if per_key then
  local keys = redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. since, '+inf',
    'LIMIT', 0, tonumber(ARGV[1]))
  for i = 1, #keys do out[#out + 1] = keys[i] end
end
return out
"""
)


class RedisRates:
    """The rate calls of one broker (``queue``: its queue of a name)."""

    def __init__(
        self, client: RedisClient | RedisClusterClient, queue: Callable[[str], Queue]
    ) -> None:
        self._client = client
        self._queue = queue
        self._take = client.script(_TAKE)
        self._give_back = client.script(_GIVE_BACK)
        self._window = client.script(_WINDOW)

    def _keys(self, queue: str, key: str | None = None) -> tuple[str, str]:
        """The rate's key and the log's: ``{Q}:starts``, or ``{Q}:starts:<key>`` for a key
        (under the same hash tag; each expires on its own when idle)."""
        tag = self._tag(queue)
        starts = f"{tag}:starts" if key is None else f"{tag}:starts:{key}"
        return f"{tag}:rate", starts

    def _tag(self, queue: str) -> str:
        return self._queue(queue).limit_key.removesuffix(":limit")  # ("{Q}": its hash tag)

    async def store(
        self, queue: str, count: int | None, per: float, per_key: bool = False
    ) -> None:
        rate_key, _ = self._keys(queue)
        if count is None:
            await self._client.execute("DEL", rate_key)
            return
        count, per = check_rate(count, per)
        await self._client.execute(
            "HSET", rate_key, "count", count, "per", repr(per), "per_key", int(per_key)
        )

    async def take(self, queue: str, want: int, key: str | None = None) -> RateGrant:
        nonce = secrets.token_hex(6)
        if key is None:
            reply: Any = await self._take(self._keys(queue), (want, nonce))
        else:
            keys = (*self._keys(queue, key), f"{self._tag(queue)}:rate-keys")
            reply = await self._take(keys, (want, nonce, key))
        return RateGrant(int(reply[0]), float(reply[1]), float(reply[2]))

    async def give_back(self, queue: str, at: float, n: int, key: str | None = None) -> None:
        _, starts_key = self._keys(queue, key)
        await self._give_back((starts_key,), (repr(at), n))

    async def with_window(self, queue: str, stats: QueueStats) -> QueueStats:
        """``stats`` with the queue's rate and its current window (for a per-key rate: each
        key's, at most :data:`MAX_WINDOW_KEYS` keys, counted in one pipeline on the queue's
        slot)."""
        reply: Any = await self._window(
            (*self._keys(queue), f"{self._tag(queue)}:rate-keys"), (MAX_WINDOW_KEYS,)
        )
        if not reply:
            return stats
        count, per = int(reply[0]), float(reply[1])
        if not int(reply[3]):
            return attrs.evolve(stats, **window_fields(count, per, False, [int(reply[2])]))
        since = reply[4].decode() if isinstance(reply[4], bytes) else str(reply[4])
        names = [k.decode() if isinstance(k, bytes) else str(k) for k in reply[5:]]
        counts = (
            await self._client.pipeline(
                [("ZCOUNT", self._keys(queue, k)[1], f"({since}", "+inf") for k in names]
            )
            if names
            else []
        )
        return attrs.evolve(stats, **window_fields(count, per, True, [int(c) for c in counts]))
