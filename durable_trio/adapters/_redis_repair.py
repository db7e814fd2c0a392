"""The Redis broker's operator calls (:class:`~durable_trio.adapters.SupportsFailedJobRepair`,
:class:`~durable_trio.adapters.SupportsQueueStats`), a base class of
:class:`~durable_trio.adapters.redis.RedisBroker` kept in a module of its own (the broker's
class stays under the size limit). Same key layout as the broker (see its module docstring).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final

from ._contract import FailedJob, QueueStats

if TYPE_CHECKING:
    from .._redis import RedisClient, Script

__all__ = ["MEMBER_ID", "READY_AGE", "REQUEUE_FAILED", "FailedJobRepair", "queue_keys"]

#: The internal id of a ``ready`` or ``delayed`` member (a Lua pattern): the digits after its
#: 16-byte place.
MEMBER_ID: Final = "'^" + "." * 16 + "(%d+)$'"

#: Ready members whose push times one run of :data:`READY_AGE` reads, about (a ``ZSCAN`` page):
#: a few milliseconds of the server's time per run, however long the queue.
READY_AGE_PAGE: Final = 1000


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


# KEYS: ready jobs
# ARGV: cursor page
# One page of a ZSCAN of ``ready``: {next cursor, now, the oldest push time found or false, how
# many members had none that can be read}. A push time is the ``t`` .. n field of the job hash,
# "<seconds> <microseconds>" (TIME's two parts); none (pushed before push times were kept, or a
# member naming no job) or another value (damaged) counts as unknown. Read only.
READY_AGE: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local page = redis.call('ZSCAN', KEYS[1], ARGV[1], 'COUNT', tonumber(ARGV[2]))
local items = page[2]
local oldest = false
local unknown = 0
for i = 1, #items, 2 do
  local n = string.match(items[i], MEMBER_ID)
  local at = n and redis.call('HGET', KEYS[2], 't' .. n)
  local s, us = false, false
  if at and #at <= 24 then
    s, us = string.match(at, '^(%d+) (%d+)$')
  end
  if s and #s <= 15 and #us <= 6 then
    at = tonumber(s) + tonumber(us) / 1000000
    if not oldest or at < oldest then
      oldest = at
    end
  else
    unknown = unknown + 1
  end
end
return {page[1], string.format('%.6f', now), oldest and string.format('%.6f', oldest) or false,
  unknown}
""".replace("MEMBER_ID", MEMBER_ID)


async def _known_queues(client: RedisClient, prefix: str) -> list[str]:
    """A ``SCAN`` for the queues ``prefix...`` holding any job (ready, delayed, claimed or
    failed keys): O(keys in the database), for an operator's view."""
    pattern = "{" + re.sub(r"([\\*?\[\]])", r"\\\1", prefix) + "*}:"
    found: set[str] = set()
    for suffix in ("ready", "delayed", "active", "failed"):
        cursor = b"0"
        while True:
            cursor, keys = await client.execute(
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

    _client: RedisClient
    _requeue_failed: Script

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
        :class:`~durable_trio.adapters.SupportsFailedJobRepair`). A failed record keeps no
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
        """``queue``'s counts (one pipeline) and its oldest ready job's age: the push times of
        every ready job, read a page (:data:`READY_AGE`) at a time, so a long queue never
        blocks the server for long. Not one snapshot: a job claimed meanwhile may be left out
        (it no longer waits); one ready through the whole read is always seen. ``None``: a
        ready job's push time cannot be read (pushed by a version that kept none, or
        damaged)."""
        q = queue_keys(queue)
        replies = await self._client.pipeline(
            [("ZCARD", q.ready_key), ("ZCARD", q.delayed_key), ("ZCARD", q.active_key),
             ("LLEN", q.failed_key)]
        )  # fmt: skip
        ready, delayed, claimed, failed = (int(r) for r in replies)
        age = await self._oldest_ready_age(q) if ready else None
        return QueueStats(ready, delayed, claimed, failed, age)

    async def _oldest_ready_age(self, q: _Keys) -> float | None:
        script = self._client.script(READY_AGE)
        cursor: bytes = b"0"
        oldest: float | None = None
        now = 0.0
        while True:
            cursor, at_now, found, unknown = await script(
                (q.ready_key, q.jobs_key), (cursor, READY_AGE_PAGE)
            )
            if int(unknown):
                return None  # (older than every known one, or damaged: no honest figure)
            now = float(at_now)
            if found is not None:
                oldest = float(found) if oldest is None else min(oldest, float(found))
            if cursor in (b"0", "0", 0):
                break
        return None if oldest is None else max(0.0, now - oldest)

    async def known_queues(self, prefix: str) -> list[str]:
        """The queues named ``prefix...`` holding any job (see :func:`_known_queues`)."""
        return await _known_queues(self._client, prefix)
