"""The Redis run store's previous generations (continue-as-new: see ``_generations.py``).

Keys (``T`` the run's shard prefix, ``N:ID`` as its steps' keys spell it, ``G`` a generation):

=========================  ======  ===============================================================
``T:gens:N:ID``            zset    the run's previous generations, score = number
``T:gsteps:N:ID:G``        zset    generation ``G``'s step ids, score = position
``T:gstep:N:ID:G:STEP``    hash    one of its checkpoints (renamed from ``T:step:N:ID:STEP``)
``T:gended:WF``            zset    the previous generations of runs of workflow ``WF``, member
                                   ``G:ID``, score = when it ended (retention of generations)
``T:gended-workflows``     set     the workflows with an entry in ``T:gended:WF``
=========================  ======  ===============================================================

The change is one script: the checkpoints' hashes are renamed (never copied), so it costs one
command per checkpoint of the generation ending. Retention's prune deletes them with the run
(``_redis_retention.py``); a previous generation that ended before a cut-off is deleted on
its own (``prune_generations``: one script per shard and workflow, each generation whole or
gone).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import orjson

from .._generations import CONTINUE_STEP_ID, expected_generation
from ._redis_rows import fields, read_step

if TYPE_CHECKING:
    from .._records import StepRecord
    from .redis import RedisRunStore

__all__ = ["RedisGenerations"]

# KEYS: run, steps, gens, the mark's step. ARGV: the step key base ('T:step:N:ID:'), the
# archived step key base ('T:gstep:N:ID:'), the archived ids' base ('T:gsteps:N:ID:'), the
# expected generation, the input, now, then the mark's fields as _BEGIN_STEP's ARGV[3..17],
# its step id (22), the ends index base ('T:gended:'), the ends' workflows set, the run id.
_CONTINUE: Final = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st or st == 'completed' or st == 'failed' or st == 'cancelled' then return 0 end
local current = 0
local held = redis.call('HGET', KEYS[4], 'input')
if held then
  local ok, m = pcall(cjson.decode, held)
  current = (ok and type(m) == 'table' and tonumber(m.generation)) or -1
end
if current ~= tonumber(ARGV[4]) then return 0 end
local g = ARGV[4]
local ids = ARGV[3] .. g
redis.call('DEL', ids)
local steps = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
for i = 1, #steps, 2 do
  local key = ARGV[1] .. steps[i]
  if redis.call('EXISTS', key) == 1 then
    redis.call('RENAME', key, ARGV[2] .. g .. ':' .. steps[i])
    redis.call('ZADD', ids, steps[i + 1], steps[i])
  end
end
redis.call('DEL', KEYS[2])
redis.call('ZADD', KEYS[3], g, g)
local wf = redis.call('HGET', KEYS[1], 'workflow') or ''
redis.call('ZADD', ARGV[23] .. wf, ARGV[6], g .. ':' .. ARGV[25])
redis.call('SADD', ARGV[24], wf)
redis.call('HSET', KEYS[4], 'kind', ARGV[7], 'name', ARGV[8], 'status', ARGV[9],
  'attempt', ARGV[10], 'input', ARGV[11], 'output', ARGV[12], 'error', ARGV[13],
  'retry', ARGV[14], 'wake_at', ARGV[15], 'dispatched', ARGV[16], 'priority', ARGV[17],
  'created', ARGV[6], 'updated', ARGV[6], 'hb_timeout', ARGV[19], 'heartbeat', ARGV[20],
  'attempts', ARGV[21])
redis.call('ZADD', KEYS[2], 0, ARGV[22])
redis.call('HSET', KEYS[1], 'input', ARGV[5], 'updated', ARGV[6])
return 1
"""


# KEYS: the workflow's ends index. ARGV: prefix, workflow, cut-off, then each member and its
# run's key tail (':N:ID', as Python spells the length). Deletes each generation still indexed
# as ended before the cut-off; returns how many.
_PRUNE: Final = """
local prefix, wf, cutoff = ARGV[1], ARGV[2], tonumber(ARGV[3])
local ended = KEYS[1]
local n = 0
for i = 4, #ARGV, 2 do
  local member, tail = ARGV[i], ARGV[i + 1]
  local at = tonumber(redis.call('ZSCORE', ended, member) or '')
  if at and at < cutoff then
    local g = string.match(member, '^(%d+):')
    local ids = prefix .. ':gsteps' .. tail .. ':' .. g
    for _, step in ipairs(redis.call('ZRANGE', ids, 0, -1)) do
      redis.call('DEL', prefix .. ':gstep' .. tail .. ':' .. g .. ':' .. step)
    end
    redis.call('DEL', ids)
    redis.call('ZREM', prefix .. ':gens' .. tail, g)
    redis.call('ZREM', ended, member)
    n = n + 1
  end
end
if redis.call('ZCARD', ended) == 0 then redis.call('SREM', prefix .. ':gended-workflows', wf) end
return n
"""


def _num(value: float | None) -> str:
    return "" if value is None else repr(float(value))


class RedisGenerations:
    """:class:`~._generations.Generations` of a :class:`~.redis.RedisRunStore`."""

    def __init__(self, store: RedisRunStore) -> None:
        self._store = store

    def _tail(self, run_id: str) -> tuple[str, str]:
        return self._store._prefix_of(run_id), f"{len(run_id)}:{run_id}"

    async def continue_run(self, run_id: str, mark: StepRecord, input: Any) -> bool:
        store = self._store
        prefix, tail = self._tail(run_id)
        dumps = orjson.dumps
        script = store._client.script(_CONTINUE)
        reply = await script(
            (store._run_key(run_id), store._steps_key(run_id), f"{prefix}:gens:{tail}",
             store._step_key(run_id, CONTINUE_STEP_ID)),
            (f"{prefix}:step:{tail}:", f"{prefix}:gstep:{tail}:", f"{prefix}:gsteps:{tail}:",
             str(expected_generation(mark)), dumps(input), _num(store.now()),
             # the mark, as _BEGIN_STEP's ARGV[3..17] (ARGV[18] unused: now is ARGV[6])
             mark.kind.value, mark.name, mark.status.value, mark.attempt, dumps(mark.input),
             dumps(mark.output), dumps(mark.error), dumps(mark.retry), _num(mark.wake_at),
             "1" if mark.dispatched else "0", "", "", "", b"", dumps(mark.attempts),
             mark.step_id, f"{prefix}:gended:", f"{prefix}:gended-workflows", run_id),
        )  # fmt: skip
        return bool(reply)

    async def get_generation(self, run_id: str, generation: int) -> list[StepRecord] | None:
        client = self._store._client
        prefix, tail = self._tail(run_id)
        ids = [i.decode() for i in await client.execute(
            "ZRANGE", f"{prefix}:gsteps:{tail}:{generation}", 0, -1
        )]  # fmt: skip
        if not ids:
            return None
        replies = await client.pipeline(
            [("HGETALL", f"{prefix}:gstep:{tail}:{generation}:{step_id}") for step_id in ids]
        )
        return [
            read_step(run_id, step_id, fields(reply))
            for step_id, reply in zip(ids, replies, strict=True)
            if reply
        ]

    async def list_generations(self, run_id: str) -> list[int]:
        prefix, tail = self._tail(run_id)
        reply = await self._store._client.execute("ZRANGE", f"{prefix}:gens:{tail}", 0, -1)
        return sorted(int(g) for g in reply)

    async def _workflows(self, prefix: str) -> list[str]:
        client = self._store._client
        reply = await client.execute("SMEMBERS", f"{prefix}:gended-workflows")
        return sorted(bytes(name).decode("utf-8", "replace") for name in reply)

    async def prune_generations(
        self, ended_before: float, *, workflow: str | None = None, limit: int = 100
    ) -> int:
        store = self._store
        client = store._client
        script = client.script(_PRUNE)
        pruned = 0
        for prefix in store._prefixes:
            names = [workflow] if workflow is not None else await self._workflows(prefix)
            for name in names:
                if pruned >= limit:
                    return pruned
                ended = f"{prefix}:gended:{name}"
                reply = await client.execute(
                    "ZRANGEBYSCORE", ended, "-inf", f"({ended_before!r}", "LIMIT", 0,
                    limit - pruned,
                )  # fmt: skip
                args: list[Any] = [prefix, name, repr(float(ended_before))]
                for member in (bytes(m).decode() for m in reply):
                    run_id = member.partition(":")[2]
                    args += [member, f":{len(run_id)}:{run_id}"]
                if len(args) > 3:
                    pruned += int(await script((ended,), args))
        return pruned

    async def count_generations(self, ended_before: float, *, workflow: str | None = None) -> int:
        client = self._store._client
        total = 0
        for prefix in self._store._prefixes:
            names = [workflow] if workflow is not None else await self._workflows(prefix)
            if names:
                replies = await client.pipeline(
                    [("ZCOUNT", f"{prefix}:gended:{name}", "-inf", f"({ended_before!r}")
                     for name in names]
                )  # fmt: skip
                total += sum(int(n) for n in replies)
        return total

    async def generation_workflows(self) -> list[str]:
        found: set[str] = set()
        for prefix in self._store._prefixes:
            found.update(await self._workflows(prefix))
        return sorted(found)
