"""The Redis broker's operator calls (:class:`~durable_trio.brokers.SupportsFailedJobRepair`,
:class:`~durable_trio.brokers.SupportsQueueStats`, the queue listing): an object the broker
owns (:class:`FailedJobRepair`). Same key layout as the broker (see
:mod:`durable_trio.brokers.redis`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Final, Protocol

import trio

from ..._errors import BrokerError
from .._contract import FailedJob, QuarantinedEntry, QueueStats
from .._limits import check_limit
from ._replies import read_failed, read_failed_key, read_quarantined

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from ..._redis import RedisArg, RedisClient, RedisClusterClient
    from ._queue import Queue
    from ._scripts import Scripts

__all__ = ["FailedJobRepair", "Scanner", "scan_queues"]

#: Priorities whose first ready job one run of :data:`OLDEST_READY` looks at.
OLDEST_READY_HEADS: Final = 1000


#: Parked jobs whose ages ``queue_stats`` reads (more: the oldest ready age is not known).
PARKED_LOOKED: Final = 10_000


def _limit(reply: Any) -> tuple[int, bool] | None:
    """A queue's limit as stored (``max``, ``per_key``), ``None``: none, or unreadable (the
    next claim moves it to the quarantine)."""
    if not isinstance(reply, list) or len(reply) != 2:
        return None
    limit, per_key = reply
    if not isinstance(limit, bytes) or not re.fullmatch(rb"[0-9]{1,15}", limit):
        return None
    if int(limit) < 1 or per_key not in (None, b"0", b"1"):
        return None
    return int(limit), per_key == b"1"


def _parked_id(entry: bytes) -> int | None:
    """The internal id of a parked entry (``<len>:<key>:`` then a sign byte and 16 digits of
    priority, then its ready member: 16 digits of place and the id), ``None``: unreadable."""
    length = re.match(rb"([0-9]{1,10}):", entry)
    if length is None:
        return None
    n = entry[len(length[0]) + int(length[1]) + 1 + 17 + 16 :]
    return int(n) if re.fullmatch(rb"[0-9]{1,16}", n) else None


#: A push time as the scripts store it: TIME's two parts, "<seconds> <microseconds>".
_PUSH_TIME = re.compile(rb"([0-9]{1,15}) ([0-9]{1,6})")


def _push_time(value: bytes | None) -> float | None:
    """A stored push time in seconds, ``None`` when missing or not in the scripts' format."""
    match = _PUSH_TIME.fullmatch(value) if value is not None else None
    if match is None:
        return None
    return int(match[1]) + int(match[2]) / 1e6


class Scanner(Protocol):
    """What a ``SCAN`` runs on: a client, or one master's pool."""

    async def execute(self, *args: RedisArg, reply_timeout: float | None = None) -> Any: ...


async def scan_queues(
    targets: Sequence[Scanner], prefix: str, suffixes: Sequence[str]
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
    """Requeue and delete of failed jobs, queue counts and the queue listing: an object the
    broker owns and hands these calls to.

    Args:
        client: the broker's client.
        scripts: the broker's scripts.
        queue: the broker's queue of a name (validated, cached).
        quarantine_retention: the broker's option.
        note_repair: the broker's report of a rebuilt sequence counter (see ``TAKE_SEQ``).
        scan_targets: what a ``SCAN`` of every key runs on: the one server (a Cluster: every
            master).
    """

    def __init__(
        self,
        client: RedisClient | RedisClusterClient,
        scripts: Scripts,
        queue: Callable[[str], Queue],
        *,
        quarantine_retention: int,
        note_repair: Callable[[str, object], None],
        scan_targets: Callable[[], Awaitable[list[Scanner]]],
    ) -> None:
        self._client = client
        self._scripts = scripts
        self._queue = queue
        self._quarantine_retention = quarantine_retention
        self._note_repair = note_repair
        self._scan_targets = scan_targets

    async def failed_jobs(self, queue: str, limit: int) -> list[FailedJob]:
        """The most recent failed jobs of ``queue``, newest first."""
        q = self._queue(queue)
        if limit < 1:
            await trio.lowlevel.checkpoint()
            return []
        records = await self._client.execute("LRANGE", q.failed_key, 0, limit - 1)
        return [read_failed(record) for record in records]

    async def quarantined(self, queue: str, limit: int) -> list[QuarantinedEntry]:
        """The newest entries of ``queue`` that could not be tied to a readable job (a member
        of ``ready``, ``delayed`` or ``active`` naming no job, a job without its meta, a stall
        history replaced, a sequence counter rebuilt), newest first, kept up to
        ``quarantine_retention``."""
        q = self._queue(queue)
        if limit < 1:
            await trio.lowlevel.checkpoint()
            return []
        records = await self._client.execute("LRANGE", q.quarantine_key, 0, limit - 1)
        return [read_quarantined(queue, record) for record in records]

    async def _find_failed(self, q: Queue, job_id: str) -> tuple[bytes, FailedJob] | None:
        for record in await self._client.execute("LRANGE", q.failed_key, 0, -1):
            job = read_failed(record)
            if job.id == job_id:
                return record, job
        return None

    async def requeue_failed(self, queue: str, job_id: str, *, priority: int | None = None) -> bool:
        """Put the newest failed job ``job_id`` back as ready, its counters reset (see
        :class:`~durable_trio.brokers.SupportsFailedJobRepair`). A failed record keeps no
        priority: ``None`` requeues at priority 0."""
        q = self._queue(queue)
        found = await self._find_failed(q, job_id)
        if found is None:
            return False
        record, job = found
        keys = (*q.push_keys, q.failed_key)
        args = (
            record, job.id, job.data, priority or 0, q.channel, self._quarantine_retention,
            read_failed_key(record) or "",
        )  # fmt: skip
        done = await self._scripts.requeue_failed(keys, args)
        self._note_repair(queue, done)
        return bool(done != 0)

    async def delete_failed(self, queue: str, job_id: str) -> bool:
        """Remove the newest failed job ``job_id`` of ``queue`` from its failed set."""
        q = self._queue(queue)
        found = await self._find_failed(q, job_id)
        if found is None:
            return False
        return bool(await self._client.execute("LREM", q.failed_key, 1, found[0]) == 1)

    async def queue_stats(self, queue: str) -> QueueStats:
        """``queue``'s counts (one pipeline) and its oldest ready job's age: the push time of
        the ready job with the lowest internal id (see the oldest-ready script), read with the
        server's ``TIME``. ``None``: none is ready, or that job's push time cannot be read
        (pushed by a version that kept none, or damaged). Not one snapshot: a job claimed
        meanwhile may be left out (it no longer waits)."""
        q = self._queue(queue)
        replies = await self._client.pipeline(
            [("ZCARD", q.ready_key), ("ZCARD", q.delayed_key), ("ZCARD", q.active_key),
             ("LLEN", q.failed_key), ("ZCARD", q.parked_key),
             ("HMGET", q.limit_key, "max", "per_key")],
            raise_on_error=False,
        )  # fmt: skip
        for reply in replies[:5]:
            if isinstance(reply, BrokerError):
                raise reply
        ready, delayed, claimed, failed, parked = (int(r) for r in replies[:5])
        limit = _limit(replies[5])  # (a limit key of another type: an error reply, no limit)
        age = await self._oldest_ready_age(q, parked) if ready + parked else None
        return QueueStats(
            ready + parked, delayed, claimed, failed, age,
            limit and limit[0], limit is not None and limit[1],
        )  # fmt: skip

    async def set_queue_limit(
        self, queue: str, limit: int | None, *, per_key: bool = False
    ) -> None:
        """Store ``queue``'s limit (``None``: none; one script run, see ``SET_LIMIT``): the
        live leases' ``held`` entries rebuilt (per key), every parked job ready again, the
        queue's waiters rung. The same limit stored again changes nothing.

        Raises:
            ConfigError: ``limit`` is not ``None`` or an int >= 1.
        """
        limit = check_limit(limit)
        q = self._queue(queue)
        args = ("" if limit is None else limit, "1" if per_key else "0", q.channel)
        await self._scripts.set_limit(q.limit_keys, args)

    async def _oldest_ready_age(self, q: Queue, parked: int) -> float | None:
        script = self._scripts.oldest_ready
        cursor: bytes = b""
        lowest: int | None = None
        if parked:
            # Jobs parked behind a full key (ready, waiting for a slot): looked at whole, up to
            # PARKED_LOOKED jobs (past that their age is not known: None).
            if parked > PARKED_LOOKED:
                return None
            for member in await self._client.execute("ZRANGE", q.parked_key, 0, -1):
                n = _parked_id(member)
                if n is None:
                    return None
                lowest = n if lowest is None else min(lowest, n)
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
        pushed, now = await self._client.pipeline([("HGET", q.jobs_key, f"t{lowest}"), ("TIME",)])
        at = _push_time(pushed)
        if at is None:
            return None
        return max(0.0, int(now[0]) + int(now[1]) / 1e6 - at)

    async def known_queues(self, prefix: str) -> list[str]:
        """The queues named ``prefix...`` holding any job (ready, delayed, claimed or failed
        keys; see :func:`scan_queues`)."""
        suffixes = ("ready", "delayed", "active", "failed", "parked")
        return await scan_queues(await self._scan_targets(), prefix, suffixes)
