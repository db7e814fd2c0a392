"""The Redis broker's operator calls (:class:`~durable_trio.brokers.SupportsFailedJobRepair`,
:class:`~durable_trio.brokers.SupportsQueueStats`), a base class of
:class:`~durable_trio.brokers.redis.RedisBroker` kept in a module of its own (the broker's
class stays under the size limit). Same key layout as the broker (see its module docstring).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Final, Protocol

import trio

from ._contract import FailedJob, QueueStats

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._redis import RedisArg, RedisClient, RedisClusterClient, Script

__all__ = [
    "MEMBER_ID",
    "OLDEST_READY",
    "REQUEUE_FAILED",
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
        self.push_keys = tuple(key(p) for p in ("seq", "ready", "delayed", "jobs", "meta", "armed"))


# KEYS: seq ready delayed jobs meta armed failed
# ARGV: record id data priority channel
# Requeue one failed record (the exact bytes read by the client): gone meanwhile -> 0.
REQUEUE_FAILED: Final = """
if redis.call('LREM', KEYS[7], 1, ARGV[1]) == 0 then
  return 0
end
local t = redis.call('TIME')
local seq = redis.call('INCR', KEYS[1])
local n = string.format('%d', seq)
-- (pushed now, as a fresh push: its age on the queue starts again)
redis.call('HSET', KEYS[4], n, ARGV[3], 't' .. n, t[1] .. ' ' .. t[2])
redis.call('HSET', KEYS[5], n, ARGV[4] .. ':0:0:' .. ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[4], string.format('%016d', seq) .. n)
if redis.call('DEL', KEYS[6]) == 1 then
  redis.call('PUBLISH', ARGV[5], '')
end
return 1
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
    """Requeue and delete of failed jobs, queue counts and the queue listing."""

    _client: RedisClient | RedisClusterClient
    _requeue_failed: Script

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
        args = (record, job.id, job.data, priority or 0, self._channel(queue))
        done = await self._requeue_failed(keys, args)
        return bool(done == 1)

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
