"""The Redis broker's operator calls (:class:`~durable_trio.adapters.SupportsFailedJobRepair`,
:class:`~durable_trio.adapters.SupportsQueueStats`), a base class of
:class:`~durable_trio.adapters.redis.RedisBroker` kept in a module of its own (the broker's
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

__all__ = ["REQUEUE_FAILED", "FailedJobRepair", "queue_keys", "scan_queues"]


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
        self.push_keys = tuple(key(p) for p in ("seq", "ready", "delayed", "jobs", "meta", "armed"))


# KEYS: seq ready delayed jobs meta armed failed
# ARGV: record id data priority channel
# Requeue one failed record (the exact bytes read by the client): gone meanwhile -> 0.
REQUEUE_FAILED: Final = """
if redis.call('LREM', KEYS[7], 1, ARGV[1]) == 0 then
  return 0
end
local seq = redis.call('INCR', KEYS[1])
local n = string.format('%d', seq)
redis.call('HSET', KEYS[4], n, ARGV[3])
redis.call('HSET', KEYS[5], n, ARGV[4] .. ':0:0:' .. ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[4], string.format('%016d', seq) .. n)
if redis.call('DEL', KEYS[6]) == 1 then
  redis.call('PUBLISH', ARGV[5], '')
end
return 1
"""


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
        """``queue``'s counts (no push times are kept: no oldest age)."""
        q = queue_keys(queue)
        replies = await self._client.pipeline(
            [("ZCARD", q.ready_key), ("ZCARD", q.delayed_key), ("ZCARD", q.active_key),
             ("LLEN", q.failed_key)]
        )  # fmt: skip
        return QueueStats(*(int(r) for r in replies))

    async def known_queues(self, prefix: str) -> list[str]:
        """The queues named ``prefix...`` holding any job (ready, delayed, claimed or failed
        keys; see :func:`scan_queues`)."""
        suffixes = ("ready", "delayed", "active", "failed")
        return await scan_queues(await self._scan_targets(), prefix, suffixes)
