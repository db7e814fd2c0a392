"""The Redis run store's dedup keys and debounced starts (issue 33, item 4).

Keys (``T`` = the hash tag of the key's shard, ``crc32(key) % shards``; ``N`` = the key's
length in bytes, so no key can forge another's):

=========================  ======  ===============================================================
``T:dedup``                hash    dedup key -> the run last created under it
``T:debounce:N:KEY``       hash    a debounced start not yet started: run_id, workflow, input,
                                   timeout, trace, deadline ('' = none)
``T:debounce-due``         zset    debounce keys, score = when their start is due
``T:debounce-ids``         hash    run id -> debounce key (``debounced_due``)
=========================  ======  ===============================================================

A run folded by a key gets an id of the key's shard (drawn until ``crc32(id) % shards`` is the
key's: one draw with one shard), so its creation and the key's change are one script on one
slot, as every change of the store is. Times are computed here and stored as the client's
``repr`` of them (Lua's number formatting would round them to 14 digits).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Final

import attrs
import orjson
import trio

from ..._logs import get_logger
from .._tags import tags_json
from ._redis_rows import fields as _fields
from ._redis_rows import read_run as _run
from ._redis_rows import tag_index

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ..._redis import RedisClient, RedisClusterClient, Script
    from .._records import RunRecord

__all__ = ["RedisStarts"]

logger = get_logger("durable_trio.redis")

# KEYS: dedup, run, seq, all. ARGV: dedup key, then _CREATE_RUN's ARGV (prefix, id, ...).
# Returns {1, id, repaired?} (created) or {0, id, fields} (the key's unfinished run, or the id's).
_DEDUP: Final = """
local prefix = ARGV[2]
local holder = redis.call('HGET', KEYS[1], ARGV[1])
if holder then
  local fields = redis.call('HGETALL', prefix .. ':run:' .. holder)
  local st = redis.call('HGET', prefix .. ':run:' .. holder, 'status')
  if st and st ~= 'completed' and st ~= 'failed' and st ~= 'cancelled' then
    return {0, holder, fields}
  end
end
local args = {}
for i = 2, #ARGV do args[#args + 1] = ARGV[i] end
local made = create_run({KEYS[2], KEYS[3], KEYS[4]}, args)
if made[1] == 1 then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
  redis.call('HSET', KEYS[2], 'dedup', ARGV[1])  -- (retention deletes the key with the run)
  return {1, ARGV[3], made[2]}
end
return {0, ARGV[3], made[2]}
"""

# KEYS: row, due, ids. ARGV: key, run id, workflow, input, timeout, trace, now + delay,
# now + max_wait ('' = none), tags ('' = none; the latest start's win). Returns the run id the
# start is folded into.
_DEBOUNCE: Final = """
local id = redis.call('HGET', KEYS[1], 'run_id')
local due = ARGV[7]
if id then
  local deadline = redis.call('HGET', KEYS[1], 'deadline')
  if deadline and deadline ~= '' and tonumber(deadline) < tonumber(due) then due = deadline end
  redis.call('HSET', KEYS[1], 'input', ARGV[4], 'timeout', ARGV[5], 'trace', ARGV[6],
    'tags', ARGV[9])
else
  id = ARGV[2]
  redis.call('HSET', KEYS[1], 'run_id', id, 'workflow', ARGV[3], 'input', ARGV[4],
    'timeout', ARGV[5], 'trace', ARGV[6], 'deadline', ARGV[8], 'tags', ARGV[9])
  redis.call('HSET', KEYS[3], id, ARGV[1])
end
redis.call('ZADD', KEYS[2], due, ARGV[1])
return id
"""

# KEYS: due, ids, seq, all. ARGV: prefix, now, limit. Returns {ids created, soonest due ('')}.
_START_DUE: Final = """
local prefix, now = ARGV[1], ARGV[2]
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[3]))
local out = {}
for _, key in ipairs(due) do
  local row = prefix .. ':debounce:' .. string.len(key) .. ':' .. key
  local f = redis.call('HMGET', row, 'run_id', 'workflow', 'input', 'timeout', 'trace', 'tags')
  redis.call('DEL', row)
  redis.call('ZREM', KEYS[1], key)
  if f[1] then
    redis.call('HDEL', KEYS[2], f[1])
    local args = {prefix, f[1], f[2], 'pending', f[3], 'null', 'null', '', '', now, f[4] or '',
      f[5] or '', '', '0', f[6] or ''}
    local ok, t = pcall(cjson.decode, f[6] or '')  -- (its tags' index keys, issue 34)
    if ok and type(t) == 'table' then
      for k, v in pairs(t) do args[#args + 1] = prefix .. ':tag:' .. k .. ':' .. tostring(v) end
    end
    local made = create_run({prefix .. ':run:' .. f[1], KEYS[3], KEYS[4]}, args)
    if made[1] == 1 then out[#out + 1] = f[1] end
  end
end
local soonest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {out, soonest[2] or ''}
"""


def _num(value: float | None) -> str:
    return "" if value is None else repr(float(value))


class RedisStarts:
    """What :class:`~.redis.RedisRunStore` does for dedup keys and debounced starts.

    Args:
        client: the store's client.
        prefixes: the hash tag of each shard.
        shard_of: the shard of a run id (and of a key: the same hash).
        create_run: the Lua function ``create_run(KEYS, ARGV)`` (the store's run creation).
    """

    def __init__(
        self,
        client: RedisClient | RedisClusterClient,
        prefixes: Sequence[str],
        shard_of: Callable[[str], int],
        create_run: str,
    ) -> None:
        self._client = client
        self._prefixes = prefixes
        self._shard_of = shard_of
        self._dedup: Script = client.script(create_run + _DEDUP)
        self._debounce: Script = client.script(_DEBOUNCE)
        self._start_due: Script = client.script(create_run + _START_DUE)

    def _beside(self, run: RunRecord, key: str) -> tuple[str, RunRecord]:
        """The key's shard's hash tag, and ``run`` under a fresh id of that shard."""
        shard = self._shard_of(key)
        run_id = run.run_id
        while self._shard_of(run_id) != shard:
            run_id = uuid.uuid4().hex
        return self._prefixes[shard], attrs.evolve(run, run_id=run_id)

    async def create_run_deduped(
        self, run: RunRecord, key: str, now: float
    ) -> tuple[RunRecord, bool]:
        prefix, run = self._beside(run, key)
        reply = await self._dedup(
            (f"{prefix}:dedup", f"{prefix}:run:{run.run_id}", f"{prefix}:seq", f"{prefix}:all"),
            (key, prefix, run.run_id, run.workflow, run.status.value, orjson.dumps(run.input),
             orjson.dumps(run.output), orjson.dumps(run.error), run.owner or "",
             _num(run.lease_until), _num(now), _num(run.timeout),
             b"" if run.trace is None else orjson.dumps(run.trace), run.parent or "", run.depth,
             tags_json(run.tags) or "",
             *(tag_index(prefix, k, v) for k, v in run.tags.items())),
        )  # fmt: skip
        run_id = reply[1].decode()
        if reply[0] == 1:
            if len(reply) > 2 and reply[2]:
                logger.warning("Redis run store: %s", reply[2].decode(errors="replace"))
            return attrs.evolve(run, created_at=now, updated_at=now), True
        return _run(run_id, _fields(reply[2])), False

    def _row(self, prefix: str, key: str) -> str:
        return f"{prefix}:debounce:{len(key.encode())}:{key}"

    async def debounce_run(
        self, key: str, run: RunRecord, now: float, delay: float, max_wait: float | None
    ) -> str:
        prefix, run = self._beside(run, key)
        reply = await self._debounce(
            (self._row(prefix, key), f"{prefix}:debounce-due", f"{prefix}:debounce-ids"),
            (key, run.run_id, run.workflow, orjson.dumps(run.input), _num(run.timeout),
             b"" if run.trace is None else orjson.dumps(run.trace), _num(now + delay),
             "" if max_wait is None else _num(now + max_wait), tags_json(run.tags) or ""),
        )  # fmt: skip
        return bytes(reply).decode()

    async def start_debounced(
        self, limit: int, now: float
    ) -> tuple[list[RunRecord], float | None]:
        ids: list[str] = []
        soonest: float | None = None
        for prefix in self._prefixes:
            created, next_due = await self._start_due(
                (f"{prefix}:debounce-due", f"{prefix}:debounce-ids", f"{prefix}:seq",
                 f"{prefix}:all"),
                (prefix, _num(now), limit - len(ids)),
            )  # fmt: skip
            ids += [i.decode() for i in created]
            if next_due:
                at = float(next_due)
                soonest = at if soonest is None else min(soonest, at)
            if len(ids) >= limit:
                break
        if not ids:
            await trio.lowlevel.checkpoint()
            return [], soonest
        replies = await self._client.pipeline(
            [("HGETALL", f"{self._prefixes[self._shard_of(i)]}:run:{i}") for i in ids]
        )
        runs = [_run(i, _fields(r)) for i, r in zip(ids, replies, strict=True) if r]
        return runs, soonest

    async def debounced_due(self, run_id: str) -> float | None:
        prefix = self._prefixes[self._shard_of(run_id)]
        key = await self._client.execute("HGET", f"{prefix}:debounce-ids", run_id)
        if key is None:
            return None
        due = await self._client.execute("ZSCORE", f"{prefix}:debounce-due", key)
        return None if due is None else float(due)


