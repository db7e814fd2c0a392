"""Retention on the Redis run store (issue 34): deleting finished runs, bounded, per run atomic.

Keys it adds to each shard's layout (``T`` = the shard's hash tag, see ``redis.py``):

=========================  ======  ===============================================================
``T:ended:WF``             zset    the finished runs of workflow ``WF``, score = their end time
                                   (written by the run's end, ``_FINISH``)
``T:ended-workflows``      set     the workflows with an entry in ``T:ended:WF``
``T:ended-backfill``       hash    progress of the one-time indexing of the runs that finished
                                   before this index existed (field ``done`` = ``1`` once over)
``T:signals:N:ID``         set     the names of the run's signal lists (written by each append)
=========================  ======  ===============================================================

A prune takes, per workflow, the oldest entries of ``T:ended:WF`` below the cut-off (never a
scan of every run), reads their parents (a child whose parent exists unfinished is held: its
entry is scored again at the prune's time, so it is looked at again a retention later, not at
every prune), then one script per shard deletes each run that is still finished and still
ended before the cut-off: its hash, its checkpoints, its signal lists, its events, its
entries in ``T:all``, ``T:status:ST`` and ``T:ended:WF``, and its dedup key in
``T:dedup`` (named by the run's ``dedup`` field) while that key still names it. A script is
atomic on the server, so a crash (of the engine or of Redis) leaves each run whole or gone.

Signal lists appended before the names set existed are not found by a prune (their run's other
keys are deleted): ``docs/operations.md`` ("Retention") says how to find them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import trio

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ..._redis import RedisClient, RedisClusterClient, Script

__all__ = ["RedisPruner"]

#: Finished runs indexed per backfill script call (the one-time indexing of older runs).
BACKFILL_CHUNK: Final = 1000

# KEYS: backfill state. ARGV: prefix, chunk. Indexes (by end time) up to ``chunk`` finished
# runs that finished before the index existed, walking each finished status's set by seq from
# where the last call stopped. Returns 1 once every one is indexed.
_BACKFILL: Final = """
local prefix, left = ARGV[1], tonumber(ARGV[2])
local state = KEYS[1]
if redis.call('HGET', state, 'done') == '1' then return 1 end
for _, st in ipairs({'completed', 'failed', 'cancelled'}) do
  local from = redis.call('HGET', state, st)
  if from ~= 'end' then
    local chunk = redis.call('ZRANGEBYSCORE', prefix .. ':status:' .. st,
      from and ('(' .. from) or '-inf', '+inf', 'WITHSCORES', 'LIMIT', 0, left)
    for i = 1, #chunk, 2 do
      local id = chunk[i]
      local f = redis.call('HMGET', prefix .. ':run:' .. id, 'workflow', 'updated')
      local ended = tonumber(f[2] or '')
      if f[1] and ended then
        redis.call('ZADD', prefix .. ':ended:' .. f[1], 'NX', ended, id)
        redis.call('SADD', prefix .. ':ended-workflows', f[1])
      end
    end
    local got = #chunk / 2
    if got > 0 then redis.call('HSET', state, st, chunk[#chunk]) end
    if got < left then
      redis.call('HSET', state, st, 'end')
    end
    left = left - got
    if left <= 0 then return 0 end
  end
end
redis.call('HSET', state, 'done', '1')
return 1
"""

# KEYS: the workflow's ended index. ARGV: prefix, workflow, cut-off, now, held count, held ids,
# then each id to delete and its length in characters (Python's ``len``, as the keys spell it;
# Lua counts bytes). Each is deleted only if it is still finished, ended before the cut-off,
# and its parent (in this shard) is not unfinished; an entry of a run gone, unfinished
# (reopened) or of an unreadable end is dropped from the index; a held child is scored ``now``.
_PRUNE: Final = """
local prefix, wf, cutoff, now = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local held = tonumber(ARGV[5])
local ended = KEYS[1]
local function finished(st) return st == 'completed' or st == 'failed' or st == 'cancelled' end
for i = 6, 5 + held do redis.call('ZADD', ended, 'XX', now, ARGV[i]) end
local out = {}
for i = 6 + held, #ARGV, 2 do
  local id = ARGV[i]
  local key = prefix .. ':run:' .. id
  local f = redis.call('HMGET', key, 'status', 'updated', 'parent', 'workflow')
  local st, at, parent = f[1], tonumber(f[2] or ''), f[3]
  if not st or not finished(st) or f[4] ~= wf or not at then
    redis.call('ZREM', ended, id)
  elseif at >= cutoff then
    redis.call('ZADD', ended, at, id)
  else
    local pst = parent and parent ~= '' and redis.call('HGET', prefix .. ':run:' .. parent,
      'status')
    if pst and not finished(pst) then
      redis.call('ZADD', ended, now, id)
    else
      local tail = ':' .. ARGV[i + 1] .. ':' .. id
      local steps = prefix .. ':steps' .. tail
      for _, step in ipairs(redis.call('ZRANGE', steps, 0, -1)) do
        redis.call('DEL', prefix .. ':step' .. tail .. ':' .. step)
      end
      local names = prefix .. ':signals' .. tail
      for _, name in ipairs(redis.call('SMEMBERS', names)) do
        redis.call('DEL', prefix .. ':signal' .. tail .. ':' .. name)
      end
      local gens = prefix .. ':gens' .. tail  -- (its previous generations, continue-as-new)
      for _, g in ipairs(redis.call('ZRANGE', gens, 0, -1)) do
        local ids = prefix .. ':gsteps' .. tail .. ':' .. g
        for _, step in ipairs(redis.call('ZRANGE', ids, 0, -1)) do
          redis.call('DEL', prefix .. ':gstep' .. tail .. ':' .. g .. ':' .. step)
        end
        redis.call('DEL', ids)
        redis.call('ZREM', prefix .. ':gended:' .. wf, g .. ':' .. id)
      end
      redis.call('DEL', gens)
      local tags = redis.call('HGET', key, 'tags')  -- (its tag index entries, issue 34)
      local ok, t = pcall(cjson.decode, tags or '')
      if ok and type(t) == 'table' then
        for k, v in pairs(t) do
          redis.call('ZREM', prefix .. ':tag:' .. k .. ':' .. tostring(v), id)
        end
      end
      local dedup = redis.call('HGET', key, 'dedup')  -- (its dedup key, if still its own)
      if dedup and redis.call('HGET', prefix .. ':dedup', dedup) == id then
        redis.call('HDEL', prefix .. ':dedup', dedup)
      end
      redis.call('DEL', key, steps, names, prefix .. ':events' .. tail)
      redis.call('ZREM', prefix .. ':all', id)
      redis.call('ZREM', prefix .. ':status:' .. st, id)
      redis.call('ZREM', prefix .. ':leases', id)
      redis.call('ZREM', ended, id)
      out[#out + 1] = id
    end
  end
end
if redis.call('ZCARD', ended) == 0 then redis.call('SREM', prefix .. ':ended-workflows', wf) end
return out
"""

_FINISHED: Final = frozenset({b"completed", b"failed", b"cancelled"})


class RedisPruner:
    """The retention calls of a :class:`~.redis.RedisRunStore` (its client and shards).

    Args:
        client: the store's client.
        prefixes: the store's shards' hash tags.
        prefix_of: the hash tag of a run id's shard.
    """

    def __init__(
        self,
        client: RedisClient | RedisClusterClient,
        prefixes: Sequence[str],
        prefix_of: Callable[[str], str],
    ) -> None:
        self._client = client
        self._prefixes = tuple(prefixes)
        self._prefix_of = prefix_of
        self._backfill: Script = client.script(_BACKFILL)
        self._prune: Script = client.script(_PRUNE)
        self._indexed: set[str] = set()  # the shards whose older runs are all indexed

    async def _index_older(self, prefix: str) -> bool:
        """One chunk of the one-time indexing of the shard's older finished runs; whether it
        is over (remembered: then no more round trips)."""
        if prefix in self._indexed:
            return True
        done = await self._backfill((f"{prefix}:ended-backfill",), (prefix, BACKFILL_CHUNK))
        if done == 1:
            self._indexed.add(prefix)
        return bool(done == 1)

    async def _workflows(self, prefix: str) -> list[str]:
        """The shard's workflows with a finished run (a name whose index a reopen emptied is
        in the set until the next prune of it: left out)."""
        reply = await self._client.execute("SMEMBERS", f"{prefix}:ended-workflows")
        names = sorted(bytes(name).decode("utf-8", "replace") for name in reply)
        if not names:
            return []
        sizes = await self._client.pipeline([("ZCARD", f"{prefix}:ended:{n}") for n in names])
        return [name for name, size in zip(names, sizes, strict=True) if int(size)]

    async def finished_workflows(self) -> list[str]:
        found: set[str] = set()
        for prefix in self._prefixes:
            await self._index_older(prefix)
            found.update(await self._workflows(prefix))
        return sorted(found)

    async def count_finished(self, ended_before: float, workflow: str | None) -> int:
        total = 0
        for prefix in self._prefixes:
            await self._index_older(prefix)
            names = [workflow] if workflow is not None else await self._workflows(prefix)
            if names:
                replies = await self._client.pipeline(
                    [("ZCOUNT", f"{prefix}:ended:{name}", "-inf", f"({ended_before!r}")
                     for name in names]
                )  # fmt: skip
                total += sum(int(n) for n in replies)
        return total

    async def prune_finished(
        self, ended_before: float, workflow: str | None, limit: int, now: float
    ) -> list[str]:
        pruned: list[str] = []
        for prefix in self._prefixes:
            await self._index_older(prefix)  # (a chunk per prune until it is over)
            names = [workflow] if workflow is not None else await self._workflows(prefix)
            for name in names:
                if len(pruned) >= limit:
                    return pruned
                left = limit - len(pruned)
                pruned += await self._prune_one(prefix, name, ended_before, left, now)
        if not pruned:
            await trio.lowlevel.checkpoint()
        return pruned

    async def _prune_one(
        self, prefix: str, workflow: str, ended_before: float, limit: int, now: float
    ) -> list[str]:
        ended = f"{prefix}:ended:{workflow}"
        reply = await self._client.execute(
            "ZRANGEBYSCORE", ended, "-inf", f"({ended_before!r}", "LIMIT", 0, limit
        )
        ids = [bytes(i).decode() for i in reply]
        if not ids:
            return []
        held = await self._held(prefix, ids)
        doomed = [i for i in ids if i not in held]
        args: list[Any] = [prefix, workflow, repr(float(ended_before)), repr(float(now)),
                           len(held), *sorted(held)]  # fmt: skip
        for run_id in doomed:
            args += [run_id, len(run_id)]
        deleted = await self._prune((ended,), args)
        return [bytes(i).decode() for i in deleted]

    async def _held(self, prefix: str, ids: Sequence[str]) -> set[str]:
        """The ids whose parent lives in another shard and is unfinished (a parent in the
        same shard is checked by the prune script itself, atomically)."""
        if len(self._prefixes) == 1:
            return set()
        parents = await self._client.pipeline(
            [("HGET", f"{prefix}:run:{i}", "parent") for i in ids]
        )
        elsewhere = {
            run_id: bytes(parent).decode()
            for run_id, parent in zip(ids, parents, strict=True)
            if parent and self._prefix_of(bytes(parent).decode()) != prefix
        }
        if not elsewhere:
            return set()
        statuses = await self._client.pipeline(
            [("HGET", f"{self._prefix_of(p)}:run:{p}", "status") for p in elsewhere.values()]
        )
        return {
            run_id
            for run_id, status in zip(elsewhere, statuses, strict=True)
            if status is not None and bytes(status) not in _FINISHED
        }
