"""The Redis broker (:class:`RedisBroker`, one server) and what it shares with the Cluster's
(:class:`RedisBrokerBase`): the contract's calls, each one script of :mod:`._scripts` on the
keys of :mod:`._queue`, its reply read by :mod:`._replies`. The broker owns its parts: the
doorbell listener (:mod:`._doorbell`), the operator's repair calls (:mod:`._repair`) and the
watch on the store's identity (:mod:`._identity`). See :mod:`durable_trio.brokers.redis`.
"""

from __future__ import annotations

import logging
import secrets
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, ClassVar, Final, Self

import attrs
import trio

from ..._attrs_shared import shared_eq, shared_hash, shared_repr
from ..._backoff import Backoff
from ..._errors import BrokerError, ConfigError, DamagedJob, TransportClosed
from ..._failures import report_through
from ..._logs import get_logger, log_failure
from ..._redis import RedisClient, is_cluster_client, open_redis
from .._contract import (
    ClaimedJob,
    FailedJob,
    Job,
    JobState,
    Lease,
    QuarantinedEntry,
    QueueStats,
    Recovery,
    RenewOutcome,
)
from ._doorbell import Doorbell, PubSubDoorbell
from ._identity import StoreIdentity
from ._queue import MAX_PRIORITY, MIN_PRIORITY, Queue
from ._rates import RedisRates
from ._repair import FailedJobRepair, Scanner, scan_queues
from ._replies import (
    read_claim,
    read_claims,
    read_job_state,
    read_job_states,
    read_seconds,
)
from ._scripts import Scripts

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence
    from types import TracebackType

    from ..._errors import StoreLost
    from ..._redis import RedisArg, RedisClusterClient
    from .._contract import RateGrant

__all__ = [
    "PROMOTE_BATCH",
    "EvictionPolicyWarning",
    "RedisBroker",
    "RedisBrokerBase",
    "RedisBrokerStatistics",
]

logger = get_logger("durable_trio.redis")

#: Due delayed jobs promoted per claim at most, so one pop never does unbounded work.
PROMOTE_BATCH: Final = 100

#: Stalled claims handled per recovery script run (a sweep runs as many as it needs).
RECOVER_BATCH: Final = 1000

#: Leases refreshed per renewal script run.
RENEW_BATCH: Final = 1000

#: Independent random token parts one call draws at most.
_SUFFIXES_MAX: Final = 256


def _suffixes(count: int) -> str:
    """The random parts of the lease tokens one call may issue: 64 bits (16 hex digits) per
    claim, for up to ``count`` claims (capped; a token stays unique past the cap, as it starts
    with the job's internal id, but then shares its random part with another of the call)."""
    return secrets.token_hex(8 * max(1, min(count, _SUFFIXES_MAX)))


async def _read_eviction_policy(
    client: RedisClient | RedisClusterClient, bound: float
) -> str | None:
    """The server's ``maxmemory-policy`` (one ``CONFIG GET``, bounded by ``bound``), or
    ``None`` when it cannot be read: a server that refuses ``CONFIG`` (managed Redis often
    does), or cannot be reached yet, is not checked (logged at debug level), and the broker
    starts all the same. A policy other than ``noeviction`` is warned of (log and
    ``on_error``) by the broker: queues are not a cache."""
    reply: Any = None
    try:
        with trio.move_on_after(bound):
            reply = await client.execute("CONFIG", "GET", "maxmemory-policy")
    except (BrokerError, TransportClosed) as exc:
        logger.debug("maxmemory-policy not checked: %s", exc)
        return None
    if isinstance(reply, dict):  # (a RESP3 map)
        reply = [item for pair in reply.items() for item in pair]
    if not isinstance(reply, list) or len(reply) != 2 or not isinstance(reply[1], bytes):
        logger.debug("maxmemory-policy not checked: %r", reply)
        return None
    return reply[1].decode(errors="replace")


def _check_options(
    failed_retention: int,
    quarantine_retention: int,
    promote_batch: int,
    safety_poll_interval: float,
    ping_timeout: float,
    store_check_interval: float,
    resubscribe_backoff: tuple[float, float],
) -> None:
    """Raise :class:`~durable_trio.ConfigError` for a broker option out of range."""
    if failed_retention < 1:
        raise ConfigError(f"failed_retention must be at least 1, not {failed_retention}")
    if quarantine_retention < 1:
        raise ConfigError(f"quarantine_retention must be at least 1, not {quarantine_retention}")
    if promote_batch < 1:
        raise ConfigError(f"promote_batch must be at least 1, not {promote_batch}")
    if not safety_poll_interval > 0:
        raise ConfigError(f"safety_poll_interval must be > 0, not {safety_poll_interval}")
    if not ping_timeout > 0 or not store_check_interval > 0:
        raise ConfigError(
            f"ping_timeout and store_check_interval must be > 0, not {ping_timeout}, "
            f"{store_check_interval}"
        )
    first, largest = resubscribe_backoff
    if not 0 < first <= largest:
        raise ConfigError("resubscribe_backoff must be (first, largest), 0 < first <= largest")


def _eviction_warning(policy: str) -> EvictionPolicyWarning:
    return EvictionPolicyWarning(
        f"Redis runs with maxmemory-policy {policy!r}: when it reaches maxmemory "
        "it may evict the keys of queued jobs (lost jobs, or entries moved to the "
        "quarantine). Run it with maxmemory-policy noeviction."
    )


@attrs.frozen(repr=False, eq=False)
class RedisBrokerStatistics:
    """Counters of one :class:`RedisBroker` (a snapshot)."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    claims_examined: int
    """Claims the recovery scripts looked at: the stalled ones only (never a scan)."""
    subscriptions: int
    """Doorbell subscriptions opened (1 + reconnections)."""
    subscription_failures: int
    """Doorbell subscriptions lost or refused (each reported through ``on_error``)."""
    maxmemory_policy: str | None
    """The server's ``maxmemory-policy`` as read when the broker was entered (anything but
    ``noeviction`` may evict jobs), ``None`` if it could not be read (``CONFIG`` refused)."""


class EvictionPolicyWarning(UserWarning):
    """The Redis server may evict keys (its ``maxmemory-policy`` is not ``noeviction``): a
    job whose key is evicted is lost. Reported once, through the broker's ``on_error`` hook and
    the log, when the broker is entered; not an error (the broker works on)."""


class RedisBrokerBase:
    """A :class:`~durable_trio.brokers.QueueBroker` on Redis: what :class:`RedisBroker` (one
    server, every optional capability) and
    :class:`~durable_trio.brokers.redis.RedisClusterBroker` share.

    Enter it (``async with``) before waiting on queues: it owns the task that listens to the
    doorbell. Every other call works on an entered or unentered broker alike.

    Args:
        client: an entered :class:`~durable_trio._redis.RedisClient` (not closed by the broker).
        failed_retention: failed jobs kept per queue for inspection (oldest dropped first).
        promote_batch: due delayed jobs promoted per claim at most.
        safety_poll_interval: seconds between two safety checks of a waiter (one ``EXISTS``
            of the queue's armed flag), and seconds of silence after which the subscription is
            ``PING``\\ ed; also how long a waiter waits for a subscription before returning.
        ping_timeout: seconds the subscription's ``PING`` may take before the connection is
            deemed dead and reopened.
        resubscribe_backoff: first and largest delay (seconds) between two attempts to reopen a
            lost subscription (doubled per failure, jittered down to half).
        quarantine_retention: entries kept per queue in the quarantine (stored data that names
            no readable job, see :meth:`quarantined`; oldest dropped first).
        store_check_interval: seconds between two checks of the store's identity (one script
            run; also after every reconnection): a store emptied or replaced under this broker
            raises the alarm (see :mod:`~durable_trio.brokers.redis._identity`).
        on_error: called with every error the doorbell listener meets, an
            :class:`EvictionPolicyWarning` when entered on a server that may evict keys, a
            :class:`~durable_trio.DamagedJob` when a retry finds a job's stored meta unreadable
            or a push, retry or requeue rebuilt a damaged sequence counter (a pop, a sweep: a
            report among its claims), a :class:`~durable_trio.StoreLost` (each also logged to
            ``durable_trio.redis``); it must not raise.

    Raises:
        ConfigError: an option out of range.
    """

    #: The command the scripts ring a doorbell with (a Cluster's broker: ``SPUBLISH``).
    _PUBLISH: ClassVar[str] = "PUBLISH"
    #: The doorbell listener (a Cluster's broker: one sharded subscription per queue).
    _DOORBELL: ClassVar[type[Doorbell]] = PubSubDoorbell

    def __init__(
        self,
        client: RedisClient | RedisClusterClient,
        *,
        failed_retention: int = 1000,
        promote_batch: int = PROMOTE_BATCH,
        safety_poll_interval: float = 30.0,
        ping_timeout: float = 5.0,
        resubscribe_backoff: tuple[float, float] = (0.1, 5.0),
        quarantine_retention: int = 1000,
        store_check_interval: float = 15.0,
        on_error: Callable[[Exception], object] | None = None,
    ) -> None:
        _check_options(
            failed_retention, quarantine_retention, promote_batch, safety_poll_interval,
            ping_timeout, store_check_interval, resubscribe_backoff,
        )  # fmt: skip
        first, largest = resubscribe_backoff
        if is_cluster_client(client) and self._PUBLISH == "PUBLISH":
            raise ConfigError("a Redis Cluster client needs a RedisClusterBroker")
        self._client = client
        self._db = client.url.db if isinstance(client, RedisClient) else 0
        self._failed_retention = failed_retention
        self._quarantine_retention = quarantine_retention
        self._maxmemory_policy: str | None = None
        self._promote_batch = promote_batch
        self._ping_timeout = ping_timeout
        self._on_error = on_error
        self._identity = StoreIdentity(client, store_check_interval, on_error, client.connected)
        self._scripts = Scripts(client, self._PUBLISH)
        self._doorbell = self._DOORBELL(
            client,
            safety_poll_interval=safety_poll_interval,
            ping_timeout=ping_timeout,
            # (jitter 0.5: each delay between half and all of it)
            backoff=Backoff(first, largest, jitter=0.5),
            report=self._report,
            read_flags=self._read_flags,
        )
        self._repair = FailedJobRepair(
            client,
            self._scripts,
            self._queue,
            quarantine_retention=quarantine_retention,
            note_repair=self._note_repair,
            scan_targets=self._scan_targets,
        )
        self._queues: dict[str, Queue] = {}
        self._rates = RedisRates(client, self._queue)
        self._claims_examined = 0
        self._stack: AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self._entered = False

    # -- lifetime ---------------------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def from_url(cls, url: str, **options: Any) -> AsyncIterator[Self]:
        """Open a client on ``url`` (two connections) and a broker on it; close both on leaving.

        Args:
            url: a ``redis://`` or ``rediss://`` URL (see :func:`~durable_trio._redis.open_redis`).
            **options: :class:`RedisBroker` options.

        Yields:
            the entered broker.
        """
        async with open_redis(url, pool_size=2) as client, cls(client, **options) as broker:
            yield broker

    async def __aenter__(self) -> Self:
        if self._entered:
            raise RuntimeError("a RedisBroker can be entered only once")
        self._entered = True
        stack = AsyncExitStack()
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self._stack = stack
        try:
            await self._nursery.start(self._doorbell.run)
            self._nursery.start_soon(self._identity.watch)
            policy = await _read_eviction_policy(self._client, self._ping_timeout)
            if policy is not None:
                self._maxmemory_policy = policy
                if policy != "noeviction":
                    self._report(_eviction_warning(policy), "eviction policy")
        except BaseException:  # cancelled while starting: leave the nursery before raising
            self._close_now()
            self._stack = None
            await stack.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close_now()  # no checkpoint before the nursery is left, even when cancelled
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    async def aclose(self) -> None:
        """Stop listening to the doorbell (the client stays open: it is the caller's).

        Idempotent, callable from any task; it does not wait (the listener ends at once when
        cancelled, and leaving the ``async with`` waits for it).
        """
        self._close_now()
        await trio.lowlevel.checkpoint()

    def _close_now(self) -> None:
        # The listener's own scope only (the doorbell's): the nursery's would cancel the
        # ``async with`` body.
        self._doorbell.close()
        self._identity.stop()

    @property
    def client(self) -> RedisClient | RedisClusterClient:
        """The Redis client this broker runs on (the run store shares it)."""
        return self._client

    def statistics(self) -> RedisBrokerStatistics:
        """A snapshot of the broker's counters."""
        return RedisBrokerStatistics(
            claims_examined=self._claims_examined,
            subscriptions=self._doorbell.subscriptions,
            subscription_failures=self._doorbell.subscription_failures,
            maxmemory_policy=self._maxmemory_policy,
        )

    # -- the contract -----------------------------------------------------------------------

    def _queue(self, name: str) -> Queue:
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = Queue.make(name, self._db)
        return q

    async def push_on(
        self, queue: str, job: Job, *, priority: int | None = None, delay: float = 0.0
    ) -> None:
        """Enqueue ``job`` (see :class:`~durable_trio.brokers.QueueBroker`).

        Raises:
            ValueError: ``priority`` outside ``[MIN_PRIORITY, MAX_PRIORITY]``, or a queue name
                that is empty or has braces.
        """
        q = self._queue(queue)
        priority = priority or 0
        if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be in [-2**53, 2**53], not {priority}")
        delay = delay if delay > 0 else 0
        args = (
            job.id, job.data, priority, delay, q.channel, self._quarantine_retention, job.key or ""
        )  # fmt: skip
        self._note_repair(queue, await self._scripts.push(q.push_keys, args))

    async def pop_from(self, queue: str, *, worker: str = "") -> ClaimedJob | None:
        """Claim the next ready job (promoting due delayed jobs first), or ``None``."""
        jobs = await self.pop_many(queue, 1, worker=worker)
        return jobs[0] if jobs else None

    async def pop_many(self, queue: str, count: int, *, worker: str = "") -> list[ClaimedJob]:
        """Claim up to ``count`` ready jobs in one round trip (one script run), in pop order."""
        return await self.pop_ahead(queue, count, 0, worker=worker)

    async def pop_ahead(
        self, queue: str, count: int, ahead: int, *, worker: str = ""
    ) -> list[ClaimedJob]:
        """:meth:`pop_many` of ``count + ahead`` jobs in one script run, the last ``ahead``
        stored as not started (see :class:`~durable_trio.brokers.SupportsClaimAhead`)."""
        q = self._queue(queue)
        total = count + ahead
        if total < 1:
            await trio.lowlevel.checkpoint()
            return []
        # Snapshot the doorbell before the command is sent: a ring counted after this may be
        # for an older push (a spurious wake-up), but no push after the pop can be missed.
        rings, epoch = self._doorbell.snapshot(q)
        reply = await self._scripts.claim(q.claim_keys, self._claim_argv(total, count, worker))
        return self._claims_of(q, reply, count, rings, epoch)

    def _claim_argv(self, total: int, count: int, worker: str) -> tuple[Any, ...]:
        return (
            total,
            worker,
            _suffixes(total),
            self._promote_batch,
            self._quarantine_retention,
            count,
        )

    def _claims_of(
        self, q: Queue, reply: list[Any], count: int, rings: int, epoch: int | None
    ) -> list[ClaimedJob]:
        """The claims of a claim script's ``reply`` (the first ``count`` started), noting a
        drained queue for the waiters (``rings``, ``epoch``: as of before it was sent)."""
        if len(reply) == 1 or reply[0] is not None:
            # (empty; or drained, armed: as good as an empty pop for a waiter)
            q.bell.note_empty(rings, epoch, read_seconds(reply[0]))
        else:
            q.bell.empty_epoch = None
        return read_claims(reply, count)

    async def mark_started(self, queue: str, leases: Sequence[Lease]) -> list[bool]:
        """Mark claims popped ahead started, and renew them, in one script run."""
        q = self._queue(queue)
        tokens = [lease.token for lease in leases]
        reply = (
            await self._scripts.mark_started((q.active_key, q.claim_keys[7]), tokens)
            if tokens
            else []
        )
        return [bool(answer) for answer in reply]

    async def complete_job(self, lease: Lease, queue: str) -> bool:
        """Remove a finished job. ``False``: the lease was lost, nothing changed."""
        q = self._queue(queue)
        # (complete_many's script, loaded by either: a finish_and_claim never runs it late)
        reply = await self._scripts.complete_many(q.complete_keys, (q.channel, lease.token))
        return bool(reply[0])

    async def complete_many(self, queue: str, leases: Sequence[Lease]) -> list[bool]:
        """``complete_job`` for each lease, in one script run."""
        q = self._queue(queue)
        if not leases:
            await trio.lowlevel.checkpoint()
            return []
        reply = await self._scripts.complete_many(
            q.complete_keys, [q.channel, *(lease.token for lease in leases)]
        )
        return [bool(answer) for answer in reply]

    async def push_many(
        self, queue: str, jobs: Sequence[Job], priorities: Sequence[int | None]
    ) -> None:
        """``push_on`` (no delay) for each job, in one script run."""
        q = self._queue(queue)
        args: list[Any] = [q.channel, self._quarantine_retention]
        for job, priority in zip(jobs, priorities, strict=True):
            value = priority or 0
            if not MIN_PRIORITY <= value <= MAX_PRIORITY:
                raise ValueError(f"priority must be in [-2**53, 2**53], not {value}")
            args += (job.id, job.data, value, job.key or "")
        if not jobs:
            await trio.lowlevel.checkpoint()
            return
        self._note_repair(queue, await self._scripts.push_many(q.push_keys, args))

    async def push_and_complete_many(
        self, push_queue: str, jobs: Sequence[Job], queue: str, leases: Sequence[Lease]
    ) -> list[bool]:
        """Push, then complete: both or neither on one server (one script), the complete only
        once the push landed on a Cluster (see :meth:`_finish_commands`)."""
        if not jobs and not leases:
            await trio.lowlevel.checkpoint()
            return []
        commands = await self._finish_commands(push_queue, jobs, queue, leases)
        replies = await self._client.pipeline(commands)
        return self._finish_answers(push_queue, leases, replies[-1])

    async def _finish_commands(
        self, push_queue: str, jobs: Sequence[Job], queue: str, leases: Sequence[Lease]
    ) -> list[tuple[RedisArg, ...]]:
        """The commands that push ``jobs`` (priority 0) and complete ``leases``, no lease
        completed unless the push landed (a push refused, say by a Redis out of memory, must
        not leave its task acknowledged with no result): ONE script on one server; on a
        Cluster the two queues are two slots, so the push is run first, here, and only the
        complete is returned (a failure after the push leaves the task claimed: its result
        may come twice, which the engine absorbs, never not at all)."""
        push: list[Any] = [
            job_field for job in jobs for job_field in (job.id, job.data, 0, job.key or "")
        ]
        pq, q = self._queue(push_queue), self._queue(queue)
        tokens = [lease.token for lease in leases]
        retention = self._quarantine_retention
        if not leases:
            args = [pq.channel, retention, *push]
            return [self._scripts.push_many.command(pq.push_keys, args)] if jobs else []
        if jobs and not is_cluster_client(self._client):
            args = [pq.channel, len(jobs), retention, q.channel, *push, *tokens]
            keys = (*pq.push_keys, *q.complete_keys)
            return [self._scripts.push_and_complete.command(keys, args)]
        if jobs:
            reply = await self._scripts.push_many(pq.push_keys, [pq.channel, retention, *push])
            self._note_repair(push_queue, reply)
        return [self._scripts.complete_many.command(q.complete_keys, [q.channel, *tokens])]

    async def finish_and_claim(
        self,
        push_queue: str,
        jobs: Sequence[Job],
        queue: str,
        leases: Sequence[Lease],
        count: int,
        *,
        worker: str = "",
    ) -> tuple[list[bool], list[ClaimedJob]]:
        """:meth:`push_and_complete_many`, then the claim script for ``count`` jobs, in ONE
        pipeline (one round trip; a Cluster's push goes first, alone; see
        :class:`~durable_trio.brokers.SupportsFinishAndClaim`)."""
        if count < 1:
            return await self.push_and_complete_many(push_queue, jobs, queue, leases), []
        q = self._queue(queue)
        commands = await self._finish_commands(push_queue, jobs, queue, leases)
        commands.append(
            self._scripts.claim.command(q.claim_keys, self._claim_argv(count, count, worker))
        )
        rings, epoch = self._doorbell.snapshot(q)
        replies = await self._client.pipeline(commands)
        answers = self._finish_answers(push_queue, leases, replies[-2]) if len(replies) > 1 else []
        return answers, self._claims_of(q, replies[-1], count, rings, epoch)

    async def fail_job(self, lease: Lease, queue: str, error: str) -> bool:
        """Fail a job for good, keeping the newest ``failed_retention``. ``False``: lease lost."""
        q = self._queue(queue)
        args = (lease.token, error, self._failed_retention, q.channel)
        return bool(await self._scripts.fail(q.fail_keys, args))

    async def retry_job(
        self, lease: Lease, queue: str, *, delay: float = 0.0, count_attempt: bool = True
    ) -> bool:
        """Hand a claim back for redelivery after ``delay`` seconds. ``False``: lease lost.

        A counted retry (or any delayed one) goes to the back of its priority; an immediate
        ``count_attempt=False`` handback keeps the place the job was popped from.
        """
        q = self._queue(queue)
        args = (
            lease.token,
            delay if delay > 0 else 0,
            "1" if count_attempt else "0",
            q.channel,
            self._failed_retention,
            self._quarantine_retention,
        )
        answer = await self._scripts.retry(q.retry_keys, args)
        self._note_repair(queue, answer)
        if answer == 2:
            self._report(
                DamagedJob(
                    "stored meta unreadable: the job could not be retried, it was failed "
                    "(kept as found in the failed set)",
                    queue=queue,
                    job_id=lease.job_id,
                ),
                "retrying a job",
            )
        return bool(answer)

    async def renew_jobs(self, queue: str, leases: Sequence[Lease]) -> RenewOutcome:
        """Refresh the age of every claim in ``leases`` still held under its token."""
        q = self._queue(queue)
        renewed = 0
        lost: list[Lease] = []
        for start in range(0, len(leases), RENEW_BATCH):
            chunk = leases[start : start + RENEW_BATCH]
            count, positions = await self._scripts.renew((q.active_key,), [x.token for x in chunk])
            renewed += count
            lost.extend(chunk[i - 1] for i in positions)
        if not leases:
            await trio.lowlevel.checkpoint()
        return RenewOutcome(renewed=renewed, lost=tuple(lost))

    async def recover_stalled_jobs(
        self, queue: str, threshold: float, max_stalled: int
    ) -> Recovery:
        """Take back claims older than ``threshold`` seconds (server clock), each to the place
        it was popped from.

        Each script run handles at most ``RECOVER_BATCH`` stalled claims, found in O(log n + k)
        on the age index; a sweep runs as many as it needs, all against the cutoff of the first
        (so a job re-leased as poison is never taken back twice in one sweep).
        """
        q = self._queue(queue)
        recovered = 0
        exceeded: list[ClaimedJob] = []
        cutoff = ""
        while True:
            reply = await self._scripts.recover(
                q.recover_keys,
                (
                    max(threshold, 0.0),
                    cutoff,
                    max_stalled,
                    _suffixes(16),
                    RECOVER_BATCH,
                    q.channel,
                    self._quarantine_retention,
                ),
            )
            recovered += reply[0]
            cutoff = reply[1].decode()
            examined = reply[2]
            self._claims_examined += examined
            exceeded.extend(read_claim(reply, i) for i in range(3, len(reply), 4))
            if examined < RECOVER_BATCH:
                return Recovery(recovered=recovered, exceeded=tuple(exceeded))

    async def queues_with_claims(self, queues: Sequence[str]) -> list[str]:
        """The queues that may hold claims, in ONE command (an ``MGET`` of the flags the claim
        script sets and a sweep that leaves no claim clears): a worker sweeping ten idle queues
        costs one command, not ten scripts (on a Cluster, one pipeline per master)."""
        if not queues:
            await trio.lowlevel.checkpoint()
            return []
        flags = await self._read_flags([self._queue(q).claimed_key for q in queues])
        return [queue for queue, flag in zip(queues, flags, strict=True) if flag]

    async def _scan_targets(self) -> list[Scanner]:
        """What a ``SCAN`` of every key runs on: the one server (a Cluster: every master)."""
        await trio.lowlevel.checkpoint()
        return [self._client]

    async def _read_flags(self, keys: list[str]) -> list[bool]:
        """Which of ``keys`` exist, in ONE ``MGET`` (one node: the keys' slots do not matter)."""
        values = await self._client.execute("MGET", *keys)
        return [value is not None for value in values]

    async def size_of(self, queue: str) -> int:
        """Jobs waiting to be claimed (ready and delayed)."""
        q = self._queue(queue)
        return int(await self._scripts.size(q.size_keys))

    async def waiting_queues(self, prefix: str) -> list[str]:
        """The queues named ``prefix...`` holding ready or delayed jobs: a ``SCAN`` for their
        ``{Q}:ready`` and ``{Q}:delayed`` keys (Redis deletes an empty sorted set, so a key
        found holds jobs), O(keys in the database), for a health read (see
        :class:`~durable_trio.brokers.SupportsQueueListing`)."""
        suffixes = ("ready", "delayed", "parked")
        return await scan_queues(await self._scan_targets(), prefix, suffixes)

    async def job_state(self, queue: str, job_id: str) -> JobState | None:
        """Whether job ``job_id`` waits on ``queue`` or is claimed: one script run, a scan of
        the queue's meta hash (for a rare look at one job: see
        :class:`~durable_trio.brokers.SupportsJobState`)."""
        keys = [f"{{{queue}}}:meta", f"{{{queue}}}:claims"]
        return read_job_state(await self._scripts.job_state(keys=keys, args=[job_id]))

    async def job_states(self, queue: str, job_ids: Sequence[str]) -> list[JobState | None]:
        """:meth:`job_state` of each of ``job_ids``: one script call, one scan of the queue's
        meta hash (see :class:`~durable_trio.brokers.SupportsJobStates`)."""
        if not job_ids:
            return []
        keys = [f"{{{queue}}}:meta", f"{{{queue}}}:claims"]
        found = await self._scripts.job_states(keys=keys, args=list(job_ids))
        return read_job_states(found, len(job_ids))

    async def failed_jobs(self, queue: str, *, limit: int = 100) -> list[FailedJob]:
        """The most recent failed jobs of ``queue``, newest first."""
        return await self._repair.failed_jobs(queue, limit)

    async def quarantined(self, queue: str, *, limit: int = 100) -> list[QuarantinedEntry]:
        """The newest entries of ``queue`` that could not be tied to a job (see :mod:`._repair`)."""
        return await self._repair.quarantined(queue, limit)

    # -- the operator's calls and the store's identity (the repair and identity parts) -------

    async def requeue_failed(self, queue: str, job_id: str, *, priority: int | None = None) -> bool:
        """Put the newest failed job ``job_id`` back as ready (see :mod:`._repair`)."""
        return await self._repair.requeue_failed(queue, job_id, priority=priority)

    async def delete_failed(self, queue: str, job_id: str) -> bool:
        """Remove the newest failed job ``job_id`` of ``queue`` from its failed set."""
        return await self._repair.delete_failed(queue, job_id)

    async def queue_stats(self, queue: str) -> QueueStats:
        """``queue``'s counts, oldest ready job's age and rate window (``SupportsQueueStats``)."""
        return await self._rates.with_window(queue, await self._repair.queue_stats(queue))

    async def set_queue_limit(
        self, queue: str, limit: int | None, *, per_key: bool = False
    ) -> None:
        """Store ``queue``'s fleet-wide limit (see :mod:`._slots`). Raises ConfigError."""
        await self._repair.set_queue_limit(queue, limit, per_key=per_key)

    async def set_queue_rate(
        self, queue: str, count: int | None, per: float = 1.0, *, per_key: bool = False
    ) -> None:
        """Store ``queue``'s rate limit (see :mod:`._rates`). Raises ConfigError."""
        await self._rates.store(queue, count, per, per_key)

    async def take_starts(self, queue: str, want: int, key: str | None = None) -> RateGrant:
        """Log up to ``want`` starts of ``queue`` (``key``'s) that fit its rate (one script)."""
        return await self._rates.take(queue, want, key)

    async def return_starts(self, queue: str, at: float, n: int, key: str | None = None) -> None:
        """Remove ``n`` starts of ``queue`` (of its ``key``) logged at ``at``."""
        await self._rates.give_back(queue, at, n, key)

    async def known_queues(self, prefix: str) -> list[str]:
        """The queues named ``prefix...`` with any job (ready, delayed, claimed, failed: SCAN)."""
        return await self._repair.known_queues(prefix)

    @property
    def store_loss(self) -> StoreLost | None:
        """The loss of the store's data this broker knows of (found by it or recorded by
        another process), until acknowledged; ``None``: none."""
        return self._identity.alarm

    async def read_store_loss(self) -> StoreLost | None:
        """The loss recorded in the store (or found by this broker and not recorded yet),
        ``None`` if none stands (one ``GET``). Raises BrokerError: Redis did not answer."""
        return await self._identity.read_loss()

    async def acknowledge_store_loss(self) -> bool:
        """Delete the loss alarm (an operator has seen it). ``False``: none stood. Raises
        BrokerError: Redis did not answer."""
        return await self._identity.acknowledge()

    def _note_repair(self, queue: str, reply: object) -> None:
        """Report, once, a repair of ``queue``'s sequence counter: a script that took sequence
        numbers replies with the reason (bytes) when ``take_seq`` rebuilt the counter (its
        quarantine entry is written), else with its usual reply."""
        if isinstance(reply, bytes):
            reason = reply.decode(errors="replace")
            self._report(
                DamagedJob(f"{reason} (recorded in the quarantine)", queue=queue, job_id=""),
                "sequence counter",
            )

    def _finish_answers(self, push_queue: str, leases: Sequence[Any], reply: Any) -> list[bool]:
        """One answer per lease from the last reply of the push-and-complete commands,
        reporting a repair of ``push_queue``'s sequence counter (a reason after the answers,
        or a push's whole reply when no lease was completed)."""
        if not leases:
            self._note_repair(push_queue, reply)
            return []
        self._note_repair(push_queue, reply[len(leases)] if len(reply) > len(leases) else None)
        return [bool(answer) for answer in reply[: len(leases)]]

    # -- wake-up ----------------------------------------------------------------------------

    async def wait_for_work(self, queue: str) -> None:
        """Return when ``queue`` may have work (see :mod:`durable_trio.brokers.redis`, Wake-up).

        Returns at once if a job is ready; else on a doorbell ring after this broker's last
        empty pop, when the earliest delayed job comes due, when a safety check finds the
        queue's armed flag gone, or when no subscription could be made within
        ``safety_poll_interval``.

        Error handling:
            Never raises :class:`~durable_trio.BrokerError`: a failed check is reported through
            ``on_error`` and the call returns (the caller's next pop meets the error itself).

        Raises:
            RuntimeError: the broker was not entered (``async with``).
        """
        q = self._queue(queue)
        if self._nursery is None:
            raise RuntimeError("enter the RedisBroker (async with) before waiting on it")
        await self._doorbell.wait(q, self._scripts.peek)

    def _report(self, exc: Exception, doing: str = "doorbell") -> None:
        log_failure(logger, logging.WARNING, exc, f"Redis {doing}")
        if self._on_error is not None:
            report_through(self._on_error, exc, logger)


class RedisBroker(RedisBrokerBase):
    """A :class:`~durable_trio.brokers.QueueBroker` on one Redis server, with every optional
    capability, the atomic :meth:`fail_and_push` included (a Cluster's queues live on two
    slots: :class:`~durable_trio.brokers.redis.RedisClusterBroker` has no such call).
    Options as :class:`RedisBrokerBase`'s."""

    async def fail_and_push(
        self, lease: Lease, queue: str, error: str, push_queue: str, job: Job
    ) -> bool:
        """:meth:`fail_job`, then (if the lease held) push ``job`` onto ``push_queue``, in one
        script. ``False``: the lease was lost, nothing changed."""
        q, pq = self._queue(queue), self._queue(push_queue)
        args = (
            lease.token, error, self._failed_retention, q.channel,
            job.id, job.data, 0, 0, pq.channel, self._quarantine_retention, job.key or "",
        )  # fmt: skip
        done = await self._scripts.fail_and_push((*q.fail_keys, *pq.push_keys), args)
        self._note_repair(push_queue, done)
        return bool(done)
