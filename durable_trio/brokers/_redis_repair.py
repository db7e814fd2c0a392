"""The Redis broker's operator calls (:class:`~durable_trio.brokers.SupportsFailedJobRepair`,
:class:`~durable_trio.brokers.SupportsQueueStats`), a base class of
:class:`~durable_trio.brokers.redis.RedisBroker` kept in a module of its own (the broker's
class stays under the size limit). Same key layout as the broker (see its module docstring).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Final, Protocol

import trio

from .._errors import DamagedJob
from ._contract import FailedJob, QueueStats

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._redis import RedisArg, RedisClient, RedisClusterClient, Script

__all__ = [
    "MEMBER_ID",
    "OLDEST_READY",
    "REQUEUE_FAILED",
    "TAKE_SEQ",
    "FailedJobRepair",
    "queue_keys",
    "scan_queues",
]

#: The internal id of a ``ready`` or ``delayed`` member (a Lua pattern): the digits after its
#: 16-byte place.
MEMBER_ID: Final = "'^" + "." * 16 + "(%d+)$'"

#: Priorities whose first ready job one run of :data:`OLDEST_READY` looks at.
OLDEST_READY_HEADS: Final = 1000


def queue_keys(queue: str) -> _Keys:
    """The keys of ``queue`` these calls use."""
    if not queue or "{" in queue or "}" in queue:
        raise ValueError(f"a Redis queue name is not empty and has no braces: {queue!r}")
    return _Keys(queue)


class _Keys:
    def __init__(self, name: str) -> None:
        def key(part: str) -> str:
            return f"{{{name}}}:{part}"

        self.failed_key = key("failed")
        self.active_key = key("active")
        self.ready_key = key("ready")
        self.delayed_key = key("delayed")
        self.jobs_key = key("jobs")
        self.moved_key = key("moved")
        self.push_keys = tuple(key(p) for p in PUSH_KEYS)


#: The keys of a push script (see :data:`TAKE_SEQ`: the last four are read or written only to
#: repair a damaged sequence counter).
PUSH_KEYS: Final = (
    "seq", "ready", "delayed", "jobs", "meta", "armed", "claims", "moved", "active", "quarantine"
)  # fmt: skip

#: The largest sequence number: the scripts' numbers are Lua doubles (exact to 2**53), and a
#: place is 16 digits.
SEQ_MAX: Final = 2**53

# Lua: ``take_seq(k, count, retention)`` takes ``count`` sequence numbers from the counter
# ``k.seq`` and returns the last one, and a damage reason (or nil): every script that numbers
# jobs or places takes them here. ``k`` names the queue's keys (seq ready delayed jobs meta
# claims moved active quarantine). A counter that is not a number (junk, past INCRBY's range),
# negative, past SEQ_MAX, or missing while the queue holds jobs (evicted, deleted) would raise,
# reuse a live job's id or order new work ahead of old: it is rebuilt from the highest number
# the queue holds (internal ids, places), set, and recorded once in the quarantine (what was
# found, the reason, the server time). The rebuild reads the whole queue: O(queue size), only
# on damage (a missing counter on an empty queue, its first push, reads empty keys). Every read
# comes before the first write; a wrong-type counter fails the script (the conventions').
TAKE_SEQ: Final = """
local function take_seq(k, count, retention)
  local taken = redis.pcall('INCRBY', k.seq, count)
  local reason, found
  if type(taken) == 'table' then
    if string.find(taken['err'] or '', 'WRONGTYPE', 1, true) then
      return error(taken)
    end
    reason = 'sequence counter unreadable'
    found = redis.call('GET', k.seq)  -- (INCRBY refused it: unchanged)
  elseif taken > count and taken <= SEQ_MAX then
    return taken  -- (the one test of the hot path)
  elseif taken == count then
    reason = 'sequence counter missing'  -- (or a fresh queue: damage only if it holds jobs)
    found = false
  else
    reason = taken < count and 'sequence counter negative' or 'sequence counter past 2**53'
    found = string.format('%d', taken - count)
  end
  local top = 0
  local function see(value)
    value = tonumber(value)
    if value and value > top and value <= SEQ_MAX then
      top = value
    end
  end
  local function see_ids(hash)
    local cursor = '0'
    repeat
      local page = redis.call('HSCAN', hash, cursor, 'COUNT', 1000)
      cursor = page[1]
      for i = 1, #page[2], 2 do
        local id = page[2][i]
        see(#id <= 16 and string.match(id, '^%d+$'))
        if hash == k.claims then
          see(string.match(page[2][i + 1], PLACE))
        end
      end
    until cursor == '0'
  end
  see_ids(k.jobs)
  see_ids(k.meta)
  see_ids(k.claims)
  for _, zset in ipairs({k.ready, k.delayed, k.moved, k.active}) do
    local total = redis.call('ZCARD', zset)
    for start = 0, total - 1, 1000 do
      for _, member in ipairs(redis.call('ZRANGE', zset, start, start + 999)) do
        if zset == k.active then
          see(string.match(member, '^(%d+):'))  -- a lease token: n:random
        else
          local n = string.match(member, MEMBER_ID)
          see(n and #n <= 16 and n)
          see(string.match(member, PLACE))
        end
      end
    end
  end
  if reason == 'sequence counter missing' and top == 0 then
    return taken  -- a fresh queue
  end
  if top + count > SEQ_MAX then
    return error({err = 'ERR sequence exhausted: ' .. k.seq .. ' would pass 2**53 (damaged store)'})
  end
  local kind = redis.call('TYPE', k.quarantine)['ok']
  if kind ~= 'list' and kind ~= 'none' then
    return error({err = 'WRONGTYPE ' .. k.quarantine .. ' holds a ' .. kind .. ', not a list' ..
      ' (damaged store)'})
  end
  taken = top + count
  redis.call('SET', k.seq, string.format('%d', taken))
  local t = redis.call('TIME')
  local raw = 'sequence counter: (none, or 0)\\n'
  if found then
    raw = 'sequence counter (' .. #found .. ' bytes): ' .. found .. '\\n'
  end
  raw = raw .. 'highest number held by the queue: ' .. string.format('%d', top) .. '\\n'
  reason = reason .. ', rebuilt from the queue'
  redis.call('LPUSH', k.quarantine, t[1] .. '.' .. string.format('%06d', tonumber(t[2])) .. ' ' ..
    #reason .. '\\n' .. reason .. raw)
  redis.call('LTRIM', k.quarantine, 0, tonumber(retention) - 1)
  return taken, reason
end
""".replace("SEQ_MAX", str(SEQ_MAX)).replace("PLACE", "'^(" + "%d" * 16 + ")'").replace(
    "MEMBER_ID", MEMBER_ID
)


# KEYS: PUSH_KEYS, failed
# ARGV: record id data priority channel quarantine_retention
# Requeue one failed record (the exact bytes read by the client): gone meanwhile -> 0; else 1,
# or the reason the sequence counter was repaired (see TAKE_SEQ).
REQUEUE_FAILED: Final = TAKE_SEQ + """
if redis.call('LREM', KEYS[11], 1, ARGV[1]) == 0 then
  return 0
end
local t = redis.call('TIME')
local seq, repaired = take_seq({seq = KEYS[1], ready = KEYS[2], delayed = KEYS[3], jobs = KEYS[4],
  meta = KEYS[5], claims = KEYS[7], moved = KEYS[8], active = KEYS[9], quarantine = KEYS[10]},
  1, ARGV[6])
local n = string.format('%d', seq)
-- (pushed now, as a fresh push: its age on the queue starts again)
redis.call('HSET', KEYS[4], n, ARGV[3], 't' .. n, t[1] .. ' ' .. t[2])
redis.call('HSET', KEYS[5], n, ARGV[4] .. ':0:0:' .. ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[4], string.format('%016d', seq) .. n)
if redis.call('DEL', KEYS[6]) == 1 then
  redis.call('PUBLISH', ARGV[5], '')
end
return repaired or 1
"""


# KEYS: ready moved
# ARGV: priority cursor ("": from the lowest) heads
# The lowest internal id n among the ready jobs: {n or false, next cursor or false, unreadable}.
# Ids are handed out in push order (INCR), and a job keeps its id and its push time through
# delays, retries and reclaims, so the lowest id is the oldest push (on a server whose clock
# does not step back). A job at its push's place in ``ready`` has its id as its place, so in
# each priority it is behind any job pushed before it: only the head of each priority, and the
# lowest of ``moved`` (the ready jobs at another place), can be the lowest. So a run costs
# O(priorities * log n), never a walk of the queue. ``unreadable``: a head that names no id.
OLDEST_READY: Final = """
local lowest = false
local function consider(n)
  n = tonumber(n)
  if n and (not lowest or n < lowest) then
    lowest = n
  end
end
local first
if ARGV[1] == '' then
  -- (an entry whose member left ready meanwhile is stale: skipped, a bounded number of them)
  for _, member in ipairs(redis.call('ZRANGE', KEYS[2], 0, 99)) do
    if redis.call('ZSCORE', KEYS[1], member) then
      consider(string.match(member, MEMBER_ID))
      break
    end
  end
  first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
else
  first = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[1], '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
end
local unreadable = 0
local visited = 0
local cursor = false
while #first > 0 do
  if visited == tonumber(ARGV[2]) then
    break
  end
  local n = string.match(first[1], MEMBER_ID)
  if n then
    consider(n)
  else
    unreadable = unreadable + 1
  end
  visited = visited + 1
  cursor = first[2]
  first = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. cursor, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
end
if #first == 0 then
  cursor = false
end
return {lowest and string.format('%d', lowest) or false, cursor, unreadable}
""".replace("MEMBER_ID", MEMBER_ID)


#: A push time as the scripts store it: TIME's two parts, "<seconds> <microseconds>".
_PUSH_TIME = re.compile(rb"([0-9]{1,15}) ([0-9]{1,6})")


def _push_time(value: bytes | None) -> float | None:
    """A stored push time in seconds, ``None`` when missing or not in the scripts' format."""
    match = _PUSH_TIME.fullmatch(value) if value is not None else None
    if match is None:
        return None
    return int(match[1]) + int(match[2]) / 1e6


class _Scanner(Protocol):
    async def execute(self, *args: RedisArg, reply_timeout: float | None = None) -> Any: ...


async def scan_queues(
    targets: Sequence[_Scanner], prefix: str, suffixes: Sequence[str]
) -> list[str]:
    """The queues ``Q`` named ``prefix...`` with a ``{Q}:<suffix>`` key for any of ``suffixes``,
    by a ``SCAN`` of each of ``targets`` (one server, or every master of a Cluster): O(keys in
    the database), for an operator's view or a health read, never the hot path."""
    pattern = "{" + re.sub(r"([\\*?\[\]])", r"\\\1", prefix) + "*}:"
    found: set[str] = set()
    for target in targets:
        for suffix in suffixes:
            cursor = b"0"
            while True:
                cursor, keys = await target.execute(
                    "SCAN", cursor, "MATCH", pattern + suffix, "COUNT", 1000
                )
                for key in keys:
                    text = key.decode() if isinstance(key, bytes) else str(key)
                    found.add(text[1 : -len("}:" + suffix)])
                if cursor in (b"0", "0", 0):
                    break
    return sorted(found)


class FailedJobRepair:
    """Requeue and delete of failed jobs, queue counts and the queue listing, and the reports
    of a repaired sequence counter (see :data:`TAKE_SEQ`)."""

    _client: RedisClient | RedisClusterClient
    _requeue_failed: Script
    _quarantine_retention: int

    async def _scan_targets(self) -> list[_Scanner]:
        """What a ``SCAN`` of every key runs on: the one server (a Cluster: every master)."""
        await trio.lowlevel.checkpoint()
        return [self._client]

    def _channel(self, queue: str) -> bytes:
        """The queue's doorbell channel (the broker's)."""
        raise NotImplementedError

    def _read_failed(self, record: bytes) -> FailedJob:
        """A failed record read (the broker's)."""
        raise NotImplementedError

    def _report(self, exc: Exception, doing: str = "doorbell") -> None:
        """Log ``exc`` and hand it to the ``on_error`` hook (the broker's)."""
        raise NotImplementedError

    def _finish_answers(self, push_queue: str, leases: Sequence[Any], reply: Any) -> list[bool]:
        """One answer per lease from the last reply of the broker's push-and-complete
        commands, reporting a repair of ``push_queue``'s sequence counter (a reason after the
        answers, or a push's whole reply when no lease was completed)."""
        if not leases:
            self._note_repair(push_queue, reply)
            return []
        self._note_repair(push_queue, reply[len(leases)] if len(reply) > len(leases) else None)
        return [bool(answer) for answer in reply[: len(leases)]]

    def _note_repair(self, queue: str, reply: object) -> None:
        """Report, once, a repair of ``queue``'s sequence counter: a script that took sequence
        numbers replies with the reason (bytes) when :data:`TAKE_SEQ` rebuilt the counter (its
        quarantine entry is written), else with its usual reply."""
        if isinstance(reply, bytes):
            reason = reply.decode(errors="replace")
            self._report(
                DamagedJob(f"{reason} (recorded in the quarantine)", queue=queue, job_id=""),
                "sequence counter",
            )

    async def _find_failed(self, q: _Keys, job_id: str) -> tuple[bytes, FailedJob] | None:
        for record in await self._client.execute("LRANGE", q.failed_key, 0, -1):
            job = self._read_failed(record)
            if job.id == job_id:
                return record, job
        return None

    async def requeue_failed(self, queue: str, job_id: str, *, priority: int | None = None) -> bool:
        """Put the newest failed job ``job_id`` back as ready, its counters reset (see
        :class:`~durable_trio.brokers.SupportsFailedJobRepair`). A failed record keeps no
        priority: ``None`` requeues at priority 0."""
        q = queue_keys(queue)
        found = await self._find_failed(q, job_id)
        if found is None:
            return False
        record, job = found
        keys = (*q.push_keys, q.failed_key)
        args = (
            record, job.id, job.data, priority or 0, self._channel(queue),
            self._quarantine_retention,
        )  # fmt: skip
        done = await self._requeue_failed(keys, args)
        self._note_repair(queue, done)
        return bool(done != 0)

    async def delete_failed(self, queue: str, job_id: str) -> bool:
        """Remove the newest failed job ``job_id`` of ``queue`` from its failed set."""
        q = queue_keys(queue)
        found = await self._find_failed(q, job_id)
        if found is None:
            return False
        return bool(await self._client.execute("LREM", q.failed_key, 1, found[0]) == 1)

    async def queue_stats(self, queue: str) -> QueueStats:
        """``queue``'s counts (one pipeline) and its oldest ready job's age: the push time of
        the ready job with the lowest internal id (see :data:`OLDEST_READY`), read with the
        server's ``TIME``. ``None``: none is ready, or that job's push time cannot be read
        (pushed by a version that kept none, or damaged). Not one snapshot: a job claimed
        meanwhile may be left out (it no longer waits)."""
        q = queue_keys(queue)
        replies = await self._client.pipeline(
            [("ZCARD", q.ready_key), ("ZCARD", q.delayed_key), ("ZCARD", q.active_key),
             ("LLEN", q.failed_key)]
        )  # fmt: skip
        ready, delayed, claimed, failed = (int(r) for r in replies)
        age = await self._oldest_ready_age(q) if ready else None
        return QueueStats(ready, delayed, claimed, failed, age)

    async def _oldest_ready_age(self, q: _Keys) -> float | None:
        script = self._client.script(OLDEST_READY)
        cursor: bytes = b""
        lowest: int | None = None
        while True:
            found, cursor, unreadable = await script(
                (q.ready_key, q.moved_key), (cursor, OLDEST_READY_HEADS)
            )
            if int(unreadable):
                return None  # (a head naming no job: the one behind it may be the oldest)
            if found is not None:
                lowest = int(found) if lowest is None else min(lowest, int(found))
            if cursor is None:
                break
        if lowest is None:
            return None
        pushed, now = await self._client.pipeline(
            [("HGET", q.jobs_key, f"t{lowest}"), ("TIME",)]
        )
        at = _push_time(pushed)
        if at is None:
            return None
        return max(0.0, int(now[0]) + int(now[1]) / 1e6 - at)

    async def known_queues(self, prefix: str) -> list[str]:
        """The queues named ``prefix...`` holding any job (ready, delayed, claimed or failed
        keys; see :func:`scan_queues`)."""
        suffixes = ("ready", "delayed", "active", "failed")
        return await scan_queues(await self._scan_targets(), prefix, suffixes)
