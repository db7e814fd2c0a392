"""The in-memory broker: one process, trio's clock, every contract capability.

Built for tests (everything runs under ``autojump_clock``) and as the reference implementation the
contract suite checks the others against. Operations finish without waiting on anything; each is a
cancellation point (``checkpoint_if_cancelled``) but, for speed, does not yield to the scheduler —
the transport's loops yield on their own when idle or when every slot is busy.

After :meth:`MemoryBroker.aclose` every call raises :class:`~durable_trio.TransportClosed`, as the
Redis broker's do once its client is closed: a closed ``memory://`` backend must not go on taking
dispatches that nothing will ever serve.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import TYPE_CHECKING

import attrs
import trio
from trio_util import RepeatedEvent

from .._errors import TransportClosed
from ._contract import (
    ClaimedJob,
    FailedJob,
    Job,
    JobState,
    Lease,
    QueueStats,
    RateGrant,
    Recovery,
    RenewOutcome,
    Stall,
)
from ._limits import check_limit
from ._rates import RateLogs

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

__all__ = ["MemoryBroker"]

#: Due delayed jobs promoted per pop at most, so one pop never does unbounded work.
PROMOTE_BATCH = 256


@attrs.define(eq=False)
class _Record:
    id: str
    data: bytes
    priority: int
    seq: int = 0
    attempts: int = 0
    stalled_count: int = 0
    stalls: tuple[Stall, ...] = ()
    token: str | None = None
    """Current lease token while claimed."""
    claimed_at: float = 0.0
    worker: str = ""
    started: bool = True
    """False while the current claim was popped ahead and its handler has not started."""
    pushed_at: float = 0.0
    """trio time of its push (``queue_stats``: the oldest ready job's age)."""
    key: str | None = None
    """Its concurrency key (``Job.key``)."""


@attrs.define(eq=False)
class _Queue:
    ready: list[tuple[int, int, _Record]] = attrs.Factory(list)
    delayed: list[tuple[float, int, _Record]] = attrs.Factory(list)
    active: dict[str, _Record] = attrs.Factory(dict)
    """By lease token."""
    by_age: list[tuple[float, str]] = attrs.Factory(list)
    """(claimed_at, token) heap; an entry is stale once its token is gone or was renewed."""
    failed: deque[FailedJob] = attrs.Factory(lambda: deque(maxlen=1000))
    wakeup: RepeatedEvent = attrs.Factory(RepeatedEvent)
    armed: bool = False
    """Someone waits on ``wakeup``: only then does a push pay for ringing it."""
    limit: int | None = None
    """The fleet-wide concurrency limit (``SupportsQueueLimits``): at most this many claims
    (per key with ``per_key``); the claims in ``active`` are the slots in use."""
    per_key: bool = False
    key_active: dict[str, int] = attrs.Factory(dict)
    """Per key (``per_key`` only): its claims in ``active``, kept by ``enter``/``leave``,
    the only two places a claim joins or leaves ``active``."""
    blocked: dict[str, list[tuple[int, int, _Record]]] = attrs.Factory(dict)
    """Per key: ready jobs a claim skipped because their key was full (``ready`` entries,
    order kept); one goes back to ``ready`` whenever a claim of its key ends."""
    blocked_count: int = 0

    def waiting(self) -> int:
        """Ready jobs, those set aside behind a full key included."""
        return len(self.ready) + self.blocked_count

    def waiting_records(self) -> Iterator[_Record]:
        for _, _, rec in itertools.chain(self.ready, *self.blocked.values()):
            yield rec

    def claimable(self) -> bool:
        """Whether a pop could claim now (ready jobs that fit; a per-key pop sets the full
        keys' jobs aside as it meets them, so ``ready`` is that answer once it has looked)."""
        return bool(self.ready) and (
            self.limit is None or self.per_key or len(self.active) < self.limit
        )

    def next_ready(self) -> _Record | None:
        """Take the next ready job a claim may have under the limit, or ``None``."""
        ready = self.ready
        limit = self.limit
        if limit is None:
            return heapq.heappop(ready)[2] if ready else None
        if not self.per_key:
            return heapq.heappop(ready)[2] if ready and len(self.active) < limit else None
        key_active = self.key_active
        while ready:
            entry = heapq.heappop(ready)
            key = entry[2].key or ""
            if key_active.get(key, 0) < limit:
                return entry[2]
            heapq.heappush(self.blocked.setdefault(key, []), entry)
            self.blocked_count += 1
        return None

    def enter(self, token: str, rec: _Record) -> None:
        """``rec`` claimed under ``token``: it holds a slot until :meth:`leave`."""
        self.active[token] = rec
        if self.per_key:
            key = rec.key or ""
            self.key_active[key] = self.key_active.get(key, 0) + 1

    def leave(self, token: str) -> _Record | None:
        """End the claim ``token`` (if held): its slot is free again, and the next job set
        aside behind its key (if any) is ready again."""
        rec = self.active.pop(token, None)
        if rec is None or self.limit is None:
            return rec
        if self.per_key:
            key = rec.key or ""
            left = self.key_active.get(key, 0) - 1
            if left > 0:
                self.key_active[key] = left
            else:
                self.key_active.pop(key, None)
            blocked = self.blocked.get(key)
            if blocked:
                heapq.heappush(self.ready, heapq.heappop(blocked))
                self.blocked_count -= 1
                if not blocked:
                    del self.blocked[key]
        return rec

    def set_limit(self, limit: int | None, per_key: bool) -> None:
        """Change the limit: every job set aside is ready again (the next pop looks anew) and
        the per-key counts are rebuilt from the claims held."""
        self.limit, self.per_key = limit, per_key and limit is not None
        for entries in self.blocked.values():
            for entry in entries:
                heapq.heappush(self.ready, entry)
        self.blocked.clear()
        self.blocked_count = 0
        self.key_active.clear()
        if self.per_key:
            for rec in self.active.values():
                key = rec.key or ""
                self.key_active[key] = self.key_active.get(key, 0) + 1


class MemoryBroker:
    """An in-memory :class:`~durable_trio.brokers.QueueBroker` with every optional capability.

    Args:
        failed_retention: failed jobs kept per queue for inspection (oldest dropped first).
    """

    def __init__(self, *, failed_retention: int = 1000) -> None:
        self._queues: dict[str, _Queue] = {}
        self._seq = itertools.count()
        self._tokens = itertools.count(1)
        self._failed_retention = failed_retention
        self._closed = False
        self._rates = RateLogs()

    def _queue(self, name: str) -> _Queue:
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = _Queue(failed=deque(maxlen=self._failed_retention))
        return q

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed("the memory broker is closed")

    def _ring(self, q: _Queue) -> None:
        if q.armed:
            q.armed = False
            q.wakeup.set()

    def _make_ready(self, q: _Queue, rec: _Record) -> None:
        rec.seq = next(self._seq)
        heapq.heappush(q.ready, (rec.priority, rec.seq, rec))

    def _promote(self, q: _Queue, now: float) -> None:
        delayed = q.delayed
        for _ in range(PROMOTE_BATCH):
            if not delayed or delayed[0][0] > now:
                return
            _, _, rec = heapq.heappop(delayed)
            self._make_ready(q, rec)

    async def push_on(
        self, queue: str, job: Job, *, priority: int | None = None, delay: float = 0.0
    ) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        self._push(queue, job, priority, delay)

    def _push(self, queue: str, job: Job, priority: int | None, delay: float) -> None:
        q = self._queues.get(queue) or self._queue(queue)
        rec = _Record(job.id, job.data, priority or 0, pushed_at=trio.current_time(), key=job.key)
        if delay > 0:
            heapq.heappush(q.delayed, (trio.current_time() + delay, next(self._seq), rec))
        else:
            rec.seq = seq = next(self._seq)
            heapq.heappush(q.ready, (rec.priority, seq, rec))
        if q.armed:
            self._ring(q)

    async def pop_from(self, queue: str, *, worker: str = "") -> ClaimedJob | None:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        q = self._queue(queue)
        now = trio.current_time()
        if q.delayed:
            self._promote(q, now)
        rec = q.next_ready() if q.ready else None
        return None if rec is None else self._claim(q, rec, now, worker)

    async def pop_many(self, queue: str, count: int, *, worker: str = "") -> list[ClaimedJob]:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        q = self._queue(queue)
        now = trio.current_time()
        if q.delayed:
            self._promote(q, now)
        return self._claim_many(q, now, worker, count, count)

    async def pop_ahead(
        self, queue: str, count: int, ahead: int, *, worker: str = ""
    ) -> list[ClaimedJob]:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        q = self._queue(queue)
        now = trio.current_time()
        if q.delayed:
            self._promote(q, now)
        return self._claim_many(q, now, worker, count + ahead, count)

    async def mark_started(self, queue: str, leases: Sequence[Lease]) -> list[bool]:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        q = self._queues.get(queue)
        now = trio.current_time()
        marked = []
        for lease in leases:
            rec = q.active.get(lease.token) if q is not None else None
            if rec is None:
                marked.append(False)
                continue
            assert q is not None
            rec.started = True
            rec.claimed_at = now
            heapq.heappush(q.by_age, (now, lease.token))
            marked.append(True)
        return marked

    def _claim_many(
        self, q: _Queue, now: float, worker: str, total: int, started: int
    ) -> list[ClaimedJob]:
        """Claim up to ``total`` jobs that fit the limit, the first ``started`` of them started."""
        claims: list[ClaimedJob] = []
        if q.limit is None:
            total = min(total, len(q.ready))  # (the common case: no check per claim)
        while len(claims) < total:
            rec = q.next_ready()
            if rec is None:
                break
            claims.append(self._claim(q, rec, now, worker, started=len(claims) < started))
        return claims

    def _claim(
        self, q: _Queue, rec: _Record, now: float, worker: str, *, started: bool = True
    ) -> ClaimedJob:
        token = f"{next(self._tokens)}"
        rec.token = token
        rec.claimed_at = now
        rec.worker = worker
        # A suspect (it stalled before) is handed over not started, like a claim popped ahead.
        rec.started = started = started and rec.stalled_count == 0
        q.enter(token, rec)
        heapq.heappush(q.by_age, (now, token))
        return ClaimedJob(
            id=rec.id,
            data=rec.data,
            lease=Lease(rec.id, token),
            attempts=rec.attempts,
            stalled_count=rec.stalled_count,
            stalls=rec.stalls,
            priority=rec.priority,
            started=started,
        )

    def _release(self, lease: Lease, queue: str) -> tuple[_Queue, _Record] | None:
        q = self._queues.get(queue)
        if q is None:
            return None
        rec = q.leave(lease.token)
        if rec is None:
            return None
        rec.token = None
        if q.limit is not None:
            self._ring(q)  # a slot is free: a worker waiting at the limit may claim
        if len(q.by_age) > 2 * len(q.active) + 64:
            self._compact(q)
        return q, rec

    @staticmethod
    def _compact(q: _Queue) -> None:
        """Rebuild the age heap from the open claims: a finalized or renewed claim leaves a
        stale entry that only the stalled sweep would drop, so without this a busy worker's heap
        holds every claim of the last stalled threshold (amortized O(1): a rebuild follows at
        least as many finalizes as it keeps claims)."""
        q.by_age = [(rec.claimed_at, token) for token, rec in q.active.items()]
        heapq.heapify(q.by_age)

    async def complete_job(self, lease: Lease, queue: str) -> bool:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        return self._release(lease, queue) is not None

    #: The transport coalesces finalizes only where a call costs more than a scheduling round:
    #: not here (see ``SupportsBatchFinalize``).
    coalesce_finalize = False

    async def complete_many(self, queue: str, leases: Sequence[Lease]) -> list[bool]:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        return [self._release(lease, queue) is not None for lease in leases]

    async def push_many(
        self, queue: str, jobs: Sequence[Job], priorities: Sequence[int | None]
    ) -> None:
        self._check_open()
        for job, priority in zip(jobs, priorities, strict=True):
            await self.push_on(queue, job, priority=priority)

    async def push_and_complete_many(
        self, push_queue: str, jobs: Sequence[Job], queue: str, leases: Sequence[Lease]
    ) -> list[bool]:
        self._check_open()
        await self.push_many(push_queue, jobs, [None] * len(jobs))
        return await self.complete_many(queue, leases)

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
        done = await self.push_and_complete_many(push_queue, jobs, queue, leases)
        return done, await self.pop_many(queue, count, worker=worker) if count > 0 else []

    async def fail_and_push(
        self, lease: Lease, queue: str, error: str, push_queue: str, job: Job
    ) -> bool:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        if not self._fail(lease, queue, error):
            return False
        self._push(push_queue, job, None, 0.0)
        return True

    async def fail_job(self, lease: Lease, queue: str, error: str) -> bool:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        return self._fail(lease, queue, error)

    def _fail(self, lease: Lease, queue: str, error: str) -> bool:
        released = self._release(lease, queue)
        if released is None:
            return False
        q, rec = released
        q.failed.append(
            FailedJob(
                id=rec.id,
                data=rec.data,
                error=error,
                failed_at=trio.current_time(),
                attempts=rec.attempts,
                stalled_count=rec.stalled_count,
                stalls=rec.stalls,
                key=rec.key,
            )
        )
        return True

    async def retry_job(
        self, lease: Lease, queue: str, *, delay: float = 0.0, count_attempt: bool = True
    ) -> bool:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        released = self._release(lease, queue)
        if released is None:
            return False
        q, rec = released
        if count_attempt:
            rec.attempts += 1
        if delay > 0:
            heapq.heappush(q.delayed, (trio.current_time() + delay, next(self._seq), rec))
        elif count_attempt:
            self._make_ready(q, rec)  # a retry goes to the back of its priority
        else:
            # an immediate, attempt-neutral handback keeps the job's place in its queue
            heapq.heappush(q.ready, (rec.priority, rec.seq, rec))
        self._ring(q)
        return True

    async def renew_jobs(self, queue: str, leases: Sequence[Lease]) -> RenewOutcome:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        q = self._queues.get(queue)
        now = trio.current_time()
        lost: list[Lease] = []
        renewed = 0
        for lease in leases:
            rec = q.active.get(lease.token) if q is not None else None
            if rec is None:
                lost.append(lease)
                continue
            rec.claimed_at = now
            renewed += 1
            assert q is not None
            heapq.heappush(q.by_age, (now, lease.token))
        if q is not None and len(q.by_age) > 2 * len(q.active) + 64:
            self._compact(q)  # renewals leave stale entries behind too
        return RenewOutcome(renewed=renewed, lost=tuple(lost))

    async def recover_stalled_jobs(
        self, queue: str, threshold: float, max_stalled: int
    ) -> Recovery:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        q = self._queues.get(queue)
        if q is None:
            return Recovery(recovered=0)
        now = trio.current_time()
        cutoff = now - threshold
        recovered = 0
        exceeded: list[ClaimedJob] = []
        requeue: list[_Record] = []
        by_age = q.by_age
        while by_age and by_age[0][0] < cutoff:
            claimed_at, token = heapq.heappop(by_age)
            rec = q.active.get(token)
            if rec is None or rec.claimed_at != claimed_at:
                continue  # finalized, or renewed since (a newer entry stands for it)
            q.leave(token)
            # Past the limit already: the lease of a sweep that found it exceeded and died
            # before failing it. No delivery, so no stall: exceeded again, as it was.
            again = rec.stalled_count > max_stalled
            # Only a claim whose handler started counts: one popped ahead and never started
            # comes back at once, uncounted (recorded as such in its history).
            counted = rec.started and not again
            if not again:
                rec.stalls = (*rec.stalls, Stall(at=now, worker=rec.worker, counted=counted))
            if counted:
                rec.stalled_count += 1
            if again or (counted and rec.stalled_count > max_stalled):
                new_token = f"{next(self._tokens)}"
                rec.token = new_token
                rec.claimed_at = now
                rec.started = True
                q.enter(new_token, rec)
                requeue.append(rec)  # re-indexed below, after the scan
                exceeded.append(
                    ClaimedJob(
                        id=rec.id,
                        data=rec.data,
                        lease=Lease(rec.id, new_token),
                        attempts=rec.attempts,
                        stalled_count=rec.stalled_count,
                        stalls=rec.stalls,
                        priority=rec.priority,
                    )
                )
            else:
                rec.token = None
                # a reclaimed job keeps its place: it waited its turn once already
                heapq.heappush(q.ready, (rec.priority, rec.seq, rec))
                recovered += 1
        for rec in requeue:
            assert rec.token is not None
            heapq.heappush(by_age, (rec.claimed_at, rec.token))
        if recovered:
            self._ring(q)
        return Recovery(recovered=recovered, exceeded=tuple(exceeded))

    async def size_of(self, queue: str) -> int:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        q = self._queues.get(queue)
        return 0 if q is None else q.waiting() + len(q.delayed)

    def queue_names(self) -> list[str]:
        """Every queue this broker has seen, sorted (for inspection, e.g. a test's checks)."""
        return sorted(self._queues)

    async def failed_jobs(self, queue: str, *, limit: int = 100) -> list[FailedJob]:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        q = self._queues.get(queue)
        if q is None:
            return []
        return list(itertools.islice(reversed(q.failed), limit))

    async def requeue_failed(self, queue: str, job_id: str, *, priority: int | None = None) -> bool:
        """Put the newest failed job ``job_id`` back as ready, its counters reset (see
        :class:`~durable_trio.brokers.SupportsFailedJobRepair`; priority 0 unless given)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        q = self._queues.get(queue)
        found = self._take_failed(q, job_id)
        if q is None or found is None:
            return False
        rec = _Record(
            found.id, found.data, priority or 0, pushed_at=trio.current_time(), key=found.key
        )
        self._make_ready(q, rec)
        self._ring(q)
        return True

    async def delete_failed(self, queue: str, job_id: str) -> bool:
        """Remove the newest failed job ``job_id`` of ``queue`` from its failed set."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        return self._take_failed(self._queues.get(queue), job_id) is not None

    @staticmethod
    def _take_failed(q: _Queue | None, job_id: str) -> FailedJob | None:
        if q is None:
            return None
        for job in reversed(q.failed):
            if job.id == job_id:
                q.failed.remove(job)
                return job
        return None

    async def queue_stats(self, queue: str) -> QueueStats:
        """``queue``'s counts (see :class:`~durable_trio.brokers.SupportsQueueStats`)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        q = self._queues.get(queue)
        rated = self._rates.window(queue, trio.current_time())
        if q is None:
            return QueueStats(0, 0, 0, 0, **rated)
        oldest = min((rec.pushed_at for rec in q.waiting_records()), default=None)
        age = None if oldest is None else max(0.0, trio.current_time() - oldest)
        return QueueStats(
            q.waiting(),
            len(q.delayed),
            len(q.active),
            len(q.failed),
            age,
            q.limit,
            q.per_key,
            **rated,
        )

    async def set_queue_rate(
        self, queue: str, count: int | None, per: float = 1.0, *, per_key: bool = False
    ) -> None:
        """Store ``queue``'s rate (see :class:`~durable_trio.brokers.SupportsRateLimits`)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        self._rates.set(queue, count, per, per_key)

    async def take_starts(self, queue: str, want: int, key: str | None = None) -> RateGrant:
        """Log up to ``want`` starts of ``queue`` that fit its rate."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        now = trio.current_time()
        granted, retry_after = self._rates.take(queue, want, now, key)
        return RateGrant(granted, retry_after, now)

    async def return_starts(
        self, queue: str, at: float, n: int, key: str | None = None
    ) -> None:
        """Remove ``n`` starts of ``queue`` (of its ``key``) logged at ``at``."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        self._rates.give_back(queue, at, n, key)

    async def set_queue_limit(
        self, queue: str, limit: int | None, *, per_key: bool = False
    ) -> None:
        """Store ``queue``'s fleet-wide limit (see
        :class:`~durable_trio.brokers.SupportsQueueLimits`)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        q = self._queue(queue)
        q.set_limit(check_limit(limit), per_key)
        self._ring(q)

    async def known_queues(self, prefix: str) -> list[str]:
        """The queues named ``prefix...`` holding any job (ready, delayed, claimed, failed)."""
        await trio.lowlevel.checkpoint()
        return sorted(
            name
            for name, q in self._queues.items()
            if name.startswith(prefix) and (q.waiting() or q.delayed or q.active or q.failed)
        )

    async def wait_for_work(self, queue: str) -> None:
        self._check_open()
        q = self._queue(queue)
        while True:
            self._check_open()  # (a close rings every waiter)
            now = trio.current_time()
            if q.claimable() or (q.delayed and q.delayed[0][0] <= now):
                await trio.lowlevel.checkpoint()
                return
            q.armed = True
            if not q.delayed:
                await q.wakeup.wait()  # no scope to build: the common idle case stays cheap
                continue
            with trio.move_on_at(q.delayed[0][0]):
                await q.wakeup.wait()

    async def job_state(self, queue: str, job_id: str) -> JobState | None:
        """Whether job ``job_id`` waits on ``queue`` or is claimed (a scan of the queue: for a
        rare look at one job, see :class:`~durable_trio.brokers.SupportsJobState`)."""
        await trio.lowlevel.checkpoint()
        q = self._queues.get(queue)
        if q is None:
            return None
        for rec in q.active.values():
            if rec.id == job_id:
                return JobState(claimed=True, worker=rec.worker)
        for rec in itertools.chain(q.waiting_records(), (r for _, _, r in q.delayed)):
            if rec.id == job_id:
                return JobState(claimed=False)
        return None

    async def job_states(self, queue: str, job_ids: Sequence[str]) -> list[JobState | None]:
        """:meth:`job_state` of each of ``job_ids``, in one scan of the queue (see
        :class:`~durable_trio.brokers.SupportsJobStates`)."""
        await trio.lowlevel.checkpoint()
        q = self._queues.get(queue)
        found: dict[str, JobState] = {}
        if q is not None:
            wanted = set(job_ids)
            for rec in itertools.chain(q.waiting_records(), (r for _, _, r in q.delayed)):
                if rec.id in wanted:
                    found[rec.id] = JobState(claimed=False)
            for rec in q.active.values():
                if rec.id in wanted:
                    found[rec.id] = JobState(claimed=True, worker=rec.worker)
        return [found.get(job_id) for job_id in job_ids]

    async def waiting_queues(self, prefix: str) -> list[str]:
        """The queues named ``prefix...`` holding ready or delayed jobs (see
        :class:`~durable_trio.brokers.SupportsQueueListing`)."""
        await trio.lowlevel.checkpoint()
        return sorted(
            name
            for name, q in self._queues.items()
            if name.startswith(prefix) and (q.waiting() or q.delayed)
        )

    async def aclose(self) -> None:
        """Close the broker (idempotent): waiters wake, and every later call raises
        :class:`~durable_trio.TransportClosed`."""
        self._closed = True
        for q in self._queues.values():
            q.armed = True
            self._ring(q)
        await trio.lowlevel.checkpoint()
