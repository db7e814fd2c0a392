"""The queue broker contract as ``typing.Protocol``\\ s.

A broker stores opaque job bytes (the transport's JSON envelope) in named queues. Popping a job
claims it under a *lease*: a token that every later call about that claim must present. When a
reclaim sweep re-delivers a claim, the old token stops working and every call made with it answers
``False`` ("lease lost, nothing changed") — so a slow worker can never finalize someone else's
claim.

Required: push, pop, complete, fail, retry. Optional capabilities, feature-detected by the
transport with ``isinstance`` against the ``Supports*`` protocols: renewal, stalled recovery,
size, failed-job inspection, and a wake-up signal.

Times are seconds as floats. Delays and thresholds are *relative*: each broker measures them on
its own clock (trio's clock in memory, the server's ``TIME`` on Redis), never on a client's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs

from .._attrs_shared import shared_eq, shared_hash, shared_repr

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._errors import StoreLost

__all__ = [
    "ClaimedJob",
    "FailedJob",
    "Job",
    "JobState",
    "Lease",
    "QuarantinedEntry",
    "QueueBroker",
    "QueueStats",
    "RateGrant",
    "Recovery",
    "RenewOutcome",
    "Stall",
    "SupportsBatchFinalize",
    "SupportsBatchPop",
    "SupportsClaimAhead",
    "SupportsFailedJobRepair",
    "SupportsFailedJobs",
    "SupportsJobState",
    "SupportsJobStates",
    "SupportsQuarantine",
    "SupportsQueueLimits",
    "SupportsQueueListing",
    "SupportsQueueStats",
    "SupportsRateLimits",
    "SupportsRecovery",
    "SupportsRenewal",
    "SupportsSize",
    "SupportsStoreIdentity",
    "SupportsSweepHint",
    "SupportsWakeup",
]


@attrs.frozen(repr=False, eq=False)
class Job:
    """A job to push: its id (unique per push) and its bytes."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    id: str
    data: bytes
    key: str | None = None
    """Its concurrency key (``@app.step(concurrency_key=...)``), or ``None``. Only a queue
    whose limit is per key (:class:`SupportsQueueLimits`) reads it; there a job without a key
    counts under the key ``""``."""


@attrs.frozen(repr=False, eq=False)
class Lease:
    """Proof of one claim on one job. Re-delivery issues a new token; the old one is dead."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    job_id: str
    token: str


@attrs.frozen(repr=False, eq=False)
class Stall:
    """One time a claim went silent past the threshold and the job was taken back."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    at: float
    """Broker clock, seconds."""
    worker: str
    """The ``worker`` that held the claim (its instance id), ``""`` if unknown."""
    counted: bool = True
    """Whether this stall counted toward ``max_stalled``: only a claim whose handler had
    started counts (a claim popped ahead and never started is taken back uncounted, see
    :class:`SupportsClaimAhead`)."""


@attrs.frozen(repr=False, eq=False)
class ClaimedJob:
    """A job popped under a lease."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    id: str
    data: bytes
    lease: Lease
    attempts: int = 0
    """Handler failures counted so far (``retry_job(count_attempt=True)``); 0 on first delivery."""
    stalled_count: int = 0
    """Times this job was reclaimed from a silent worker."""
    stalls: tuple[Stall, ...] = ()
    """The stall history, oldest first."""
    priority: int = 0
    started: bool = True
    """``False``: the broker stores this claim as *not started* (see
    :class:`SupportsClaimAhead`): it was popped ahead of a free slot, or its job is a
    *suspect* (``stalled_count > 0``: it stalled before, while its handler ran), which a broker
    that claims ahead always hands over not started. The transport calls ``mark_started`` just
    before its handler runs; until then a stall of this claim is not counted."""
    damage: str | None = None
    """Why a stored field of this claim could not be read, or ``None`` (the usual case).

    Every broker reads what it stores through one validating decode. A claim whose stored
    fields are damaged (unreadable meta or stall history, data of the wrong type, a vanished
    job body) is still handed over, with ``data`` holding the raw bytes that could be read and
    ``damage`` the reason: the transport then sets it aside unread (fails it with the reason,
    so it stays inspectable in the failed set) and reports a :class:`~durable_trio.DamagedJob`.
    A claim with an empty ``lease.token`` is a report only: the broker could not even read the
    job's id and has already moved what it found to its quarantine (see
    :class:`SupportsQuarantine`)."""


@attrs.frozen(repr=False, eq=False)
class QuarantinedEntry:
    """Stored data a broker found on a queue and could not tie to a readable job.

    Kept, never dropped: what the broker found (``raw``, the stored fields as they were) and
    why it was moved aside.
    """

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    queue: str
    reason: str
    raw: bytes
    """The stored fields, as found (for a person to read, not a format to parse)."""
    at: float
    """Broker clock, seconds."""


@attrs.frozen(repr=False, eq=False)
class FailedJob:
    """A job failed for good, kept for inspection (bounded retention)."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    id: str
    data: bytes
    error: str
    failed_at: float
    attempts: int = 0
    stalled_count: int = 0
    stalls: tuple[Stall, ...] = ()
    key: str | None = None
    """Its concurrency key, where the broker keeps it (a requeue keeps it too)."""


@attrs.frozen(repr=False, eq=False)
class Recovery:
    """What one stalled sweep did on one queue."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    recovered: int
    """Claims older than the threshold put back to pending."""
    exceeded: tuple[ClaimedJob, ...] = ()
    """Jobs past ``max_stalled``: re-leased to the caller, who fails them (poison)."""


@attrs.frozen(repr=False, eq=False)
class RenewOutcome:
    """What one renewal round did on one queue."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    renewed: int
    lost: tuple[Lease, ...] = ()
    """The leases that were no longer valid (re-delivered, or finalized meanwhile)."""


class QueueBroker(Protocol):
    """The required half of the contract."""

    async def push_on(
        self, queue: str, job: Job, *, priority: int | None = None, delay: float = 0.0
    ) -> None:
        """Enqueue ``job``. Lower ``priority`` first (``None`` = 0); FIFO within one priority
        (by a sequence, never a timestamp). ``delay`` > 0 holds it back that many seconds."""
        ...

    async def pop_from(self, queue: str, *, worker: str = "") -> ClaimedJob | None:
        """Claim the next ready job (promoting due delayed jobs first), or ``None``."""
        ...

    async def complete_job(self, lease: Lease, queue: str) -> bool:
        """Remove a finished job. ``False``: the lease was lost, nothing changed."""
        ...

    async def fail_job(self, lease: Lease, queue: str, error: str) -> bool:
        """Fail a job for good, keeping it inspectable. ``False``: lease lost."""
        ...

    async def retry_job(
        self, lease: Lease, queue: str, *, delay: float = 0.0, count_attempt: bool = True
    ) -> bool:
        """Hand a claim back for redelivery after ``delay`` seconds. ``count_attempt=False`` is
        the attempt-neutral handback of a close (neither a stall nor an attempt). ``False``:
        lease lost."""
        ...

    async def aclose(self) -> None:
        """Release the broker's resources. Idempotent."""
        ...


@runtime_checkable
class SupportsBatchPop(Protocol):
    async def pop_many(self, queue: str, count: int, *, worker: str = "") -> list[ClaimedJob]:
        """Claim up to ``count`` ready jobs in one call, in pop order (empty: none ready). One
        round trip instead of ``count`` is where a loop with free slots wins its throughput.
        Fewer jobs than asked means the queue was drained: for ``wait_for_work`` that counts as
        an empty pop (the caller may wait at once instead of popping again)."""
        ...


@runtime_checkable
class SupportsClaimAhead(Protocol):
    """Claims popped ahead of a free slot (prefetch) that the broker knows are not started.

    A claim from ``pop_from``/``pop_many`` is started (popped for a free slot), which costs
    nothing extra, with one exception: a *suspect*, a job with ``stalled_count > 0``, is
    stored as not started by every pop, so it may wait for the handlers beside it to finish
    (the transport runs a suspect alone in its worker) without its stall counting should that
    worker die meanwhile. The ``ahead`` claims of :meth:`pop_ahead` are stored as not started
    too. Each such claim is handed over with ``started=False``; :meth:`mark_started` flips
    them (one call for many) just before their handlers run. A stalled claim still not started
    is taken back at once by ``recover_stalled_jobs`` but its stall is recorded with
    ``counted=False`` and the job's ``stalled_count`` is left unchanged: a job a worker only
    held (in its buffer, or waiting to run alone) is no more a suspect than it was.
    """

    async def pop_ahead(
        self, queue: str, count: int, ahead: int, *, worker: str = ""
    ) -> list[ClaimedJob]:
        """``pop_many(queue, count + ahead)``: the first ``count`` claims (pop order) started,
        the rest (at most ``ahead``) stored as not started."""
        ...

    async def mark_started(self, queue: str, leases: Sequence[Lease]) -> list[bool]:
        """Mark each claim started (and renew it), in order. ``False``: the lease was lost."""
        ...


@runtime_checkable
class SupportsBatchFinalize(Protocol):
    """Many finalizes in one call: the transport coalesces the completes (and pushes) made in
    one scheduling round. On Redis that is one script run instead of N round trips' worth of
    commands; on SQLite one transaction instead of N. A broker whose calls cost less than a
    scheduling round sets ``coalesce_finalize = False`` and the transport calls it one by one."""

    async def complete_many(self, queue: str, leases: Sequence[Lease]) -> list[bool]:
        """``complete_job`` for each lease, in order; each answer as ``complete_job``'s."""
        ...

    async def push_many(
        self, queue: str, jobs: Sequence[Job], priorities: Sequence[int | None]
    ) -> None:
        """``push_on`` (no delay) for each job, in order, with its priority."""
        ...

    async def push_and_complete_many(
        self, push_queue: str, jobs: Sequence[Job], queue: str, leases: Sequence[Lease]
    ) -> list[bool]:
        """Push ``jobs`` (priority 0) onto ``push_queue``, THEN complete ``leases`` on
        ``queue``, in one round trip where the broker can: a worker's results and the
        acknowledgements of their tasks. No lease is completed unless the push landed: a push
        that fails (a full Redis refusing writes, a full disk) leaves every lease claimed and
        raises (memory, SQLite and single-server Redis: one atomic step, both or neither). Where
        the two queues cannot be written together (a Redis Cluster: two slots) the push is
        sent first and the completes only after it landed, so a failure between the two leaves
        the task claimed with its result published: redelivered, its result published twice —
        never lost. Answers per lease, as ``complete_job``'s."""
        ...


@runtime_checkable
class SupportsFinishAndClaim(Protocol):
    """A worker's finalize that claims the next jobs in the same round trip (as BullMQ's
    worker fetches its next job in the call that finishes the last). A worker whose queue has
    a backlog asks for as many claims as the finishing handlers will free slots: they run on
    without a pop of their own.

    The transport sends these finalizes in two halves (at most half of the loop's slots per
    call, a full one beside the call in flight), so one half is at the broker while the
    other's jobs run. A broker on which a second call in flight overlaps nothing (SQLite: one
    connection thread, one transaction after another) sets ``finalize_in_halves = False``:
    its finalizes then go one call at a time, in batches as large as the moment gives."""

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
        """``push_and_complete_many(push_queue, jobs, queue, leases)``, THEN ``pop_many(queue,
        count)``, in one round trip (a Redis Cluster: two, the push first, see
        ``push_and_complete_many``): (the answer per lease, the claims, started). The claims
        are as ``pop_many``'s, fewer than ``count`` meaning the queue was drained; with
        ``count`` 0 nothing is popped. A failure raises before any claim is handed over, and
        a pop that may have landed unanswered is a claim nobody runs, which the stalled sweep
        takes back (as for a lost ``pop_many`` reply)."""
        ...


@runtime_checkable
class SupportsFailAndPush(Protocol):
    """Fail a job and push another in one atomic step: the poison bridge fails a step task
    that stalled past the limit and publishes its failed result together, so no process can
    die between the two (the run would otherwise wait on a step whose answer was lost)."""

    async def fail_and_push(
        self, lease: Lease, queue: str, error: str, push_queue: str, job: Job
    ) -> bool:
        """``fail_job(lease, queue, error)`` and, only if the lease held, ``push_on(push_queue,
        job)`` (priority 0, no delay): both or neither. ``False``: the lease was lost, nothing
        changed."""
        ...


@runtime_checkable
class SupportsRenewal(Protocol):
    async def renew_jobs(self, queue: str, leases: Sequence[Lease]) -> RenewOutcome:
        """Refresh the age of every claim in ``leases`` still held under its token."""
        ...


@runtime_checkable
class SupportsRecovery(Protocol):
    async def recover_stalled_jobs(
        self, queue: str, threshold: float, max_stalled: int
    ) -> Recovery:
        """Take back claims older than ``threshold`` seconds (claims are indexed by age: the
        cost is O(log n + k), never a scan of every active claim). A job whose stall would be
        number ``max_stalled + 1`` is re-leased and returned in ``exceeded`` instead. A claim
        still not started (see :class:`SupportsClaimAhead`) is taken back uncounted: its stall
        is recorded with ``counted=False`` and never makes it exceed. A job already past
        ``max_stalled`` (re-leased to a sweep that died before failing it) is returned in
        ``exceeded`` again, its count and history unchanged: that lease was no delivery."""
        ...


@runtime_checkable
class SupportsSweepHint(Protocol):
    async def queues_with_claims(self, queues: Sequence[str]) -> list[str]:
        """Those of ``queues`` that may hold claims (a superset is fine; a queue left out must
        hold none), in one cheap call: the reclaim sweep skips idle queues. The transport still
        sweeps every queue now and then, so a lost hint costs time, never a job."""
        ...


@runtime_checkable
class SupportsSize(Protocol):
    async def size_of(self, queue: str) -> int:
        """Jobs waiting to be claimed (ready and delayed)."""
        ...


@runtime_checkable
class SupportsFailedJobs(Protocol):
    async def failed_jobs(self, queue: str, *, limit: int = 100) -> list[FailedJob]:
        """The most recent failed jobs of ``queue``, newest first."""
        ...


@runtime_checkable
class SupportsQuarantine(Protocol):
    async def quarantined(self, queue: str, *, limit: int = 100) -> list[QuarantinedEntry]:
        """The newest entries of ``queue`` that could not be tied to a readable job (a damaged
        ``ready`` member, a job body without its meta, an unreadable id), newest first."""
        ...


@runtime_checkable
class SupportsWakeup(Protocol):
    async def wait_for_work(self, queue: str) -> None:
        """Return when ``queue`` may have work: at once if it has ready jobs, else when a push
        (or a delayed job coming due) may have made some ready. May return spuriously (a slow
        safety poll); must not miss a push that follows this broker's last empty pop."""
        ...


@attrs.frozen(repr=False, eq=False)
class JobState:
    """Where one job stands on its queue (:class:`SupportsJobState`)."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    claimed: bool
    """``True``: a worker holds it under a lease; ``False``: it waits (ready or delayed)."""
    worker: str = ""
    """The claim's holder (its ``worker`` id), ``""`` when waiting or unknown."""


@runtime_checkable
class SupportsJobState(Protocol):
    async def job_state(self, queue: str, job_id: str) -> JobState | None:
        """Whether the job pushed with id ``job_id`` still waits on ``queue`` or is claimed;
        ``None``: it is not on the queue (finished, failed, or never pushed). Meant for a rare
        look at one job (a step's timeout expired), not the hot path: a broker may scan the
        queue to answer."""
        ...


@runtime_checkable
class SupportsJobStates(Protocol):
    async def job_states(self, queue: str, job_ids: Sequence[str]) -> list[JobState | None]:
        """:meth:`SupportsJobState.job_state` of many jobs of one queue in one broker call
        (the engine's loss audit, docs/engine.md): the states in ``job_ids``' order. A broker
        may scan the queue once to answer."""
        ...


@runtime_checkable
class SupportsQueueListing(Protocol):
    async def waiting_queues(self, prefix: str) -> list[str]:
        """The queues whose name starts with ``prefix`` that hold waiting (ready or delayed)
        jobs, sorted. For a health read (orphaned queues: waiting work that no live worker
        serves), not the hot path: a broker may scan its keys to answer."""
        ...


@runtime_checkable
class SupportsFailedJobRepair(Protocol):
    """An operator's repair of the failed set (``durable-trio jobs requeue | delete``)."""

    async def requeue_failed(self, queue: str, job_id: str, *, priority: int | None = None) -> bool:
        """Move the newest failed job ``job_id`` of ``queue`` back to pending (ready now), as
        a fresh push: its attempts, stalled count and stall history reset to none, its bytes
        unchanged, at ``priority`` (``None``: the priority it had, where the broker keeps it,
        else 0), at the back of its priority.

        Returns:
            Whether such a failed job was found (and requeued).
        """
        ...

    async def delete_failed(self, queue: str, job_id: str) -> bool:
        """Remove the newest failed job ``job_id`` of ``queue`` from its failed set.

        Returns:
            Whether such a failed job was found (and removed).
        """
        ...


@attrs.frozen(repr=False, eq=False)
class QueueStats:
    """Where one queue's jobs stand (:class:`SupportsQueueStats`)."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    ready: int
    delayed: int
    claimed: int
    failed: int
    """Set aside (kept for inspection, bounded by the broker's retention)."""
    oldest_ready_age: float | None = None
    """Seconds since the oldest ready job was pushed (broker clock, never below 0).

    Of the jobs ready now (not delayed, not claimed), the earliest *push time*: the time of
    its ``push_on`` (or ``push_many``), kept as it was while the job is retried, reclaimed
    from a stalled worker or held back by a delay. So a job pushed with a 60 s delay that came
    due 5 s ago is 65 s old, and a job retried three times is as old as its first push. A
    failed job requeued (:meth:`SupportsFailedJobRepair.requeue_failed`) counts as pushed
    again when requeued. ``None``: no job is ready, the broker keeps no push times, or a ready
    job's push time is unknown (stored before the broker kept one, or damaged: a value that is
    not a number), since that job may well be the oldest."""
    limit: int | None = None
    """The queue's fleet-wide concurrency limit (:class:`SupportsQueueLimits`), ``None``: none.
    Then ``claimed`` is the slots in use and ``ready`` the jobs waiting for one."""
    per_key: bool = False
    """``limit`` holds per concurrency key (:attr:`Job.key`), not for the whole queue."""
    rate: int | None = None
    """The queue's rate limit (:class:`SupportsRateLimits`): at most ``rate`` starts in any
    ``rate_per`` seconds; ``None``: none."""
    rate_per: float | None = None
    """The rate's window, seconds (``None``: no rate)."""
    window: int = 0
    """Starts in the current window (the last ``rate_per`` seconds); 0 without a rate. For a
    per-key rate (``rate_per_key``): the busiest key's starts in its window."""
    rate_per_key: bool = False
    """The rate holds per key (``dt.Rate(..., key=...)``): each key has its own window."""
    window_keys: int = 0
    """For a per-key rate: the keys with a start in their current window (0 otherwise)."""


@runtime_checkable
class SupportsQueueStats(Protocol):
    """Counts for an operator's view (``durable-trio queues``); not the hot path."""

    async def queue_stats(self, queue: str) -> QueueStats:
        """``queue``'s ready, delayed, claimed and failed jobs, and its oldest ready job's age."""
        ...

    async def known_queues(self, prefix: str) -> list[str]:
        """The queues named ``prefix...`` holding any job (ready, delayed, claimed or failed),
        sorted. A broker may scan its keys to answer."""
        ...


@runtime_checkable
class SupportsStoreIdentity(Protocol):
    """A broker that knows when its store was emptied or replaced under it (Redis and
    PostgreSQL: an identity stamped in the store, checked on every reconnection and
    periodically; see :mod:`~durable_trio.brokers.redis._identity` and
    :mod:`~durable_trio.brokers.postgres._identity`). Health and the console show the loss."""

    async def read_store_loss(self) -> StoreLost | None:
        """The loss of the store's data that stands (recorded in the store, or found by this
        broker and not recorded yet) until an operator acknowledges it; ``None``: none.

        Raises:
            BrokerError: the store did not answer.
        """
        ...

    async def acknowledge_store_loss(self) -> bool:
        """Clear the alarm (an operator has seen it). ``False``: none stood.

        Raises:
            BrokerError: the store did not answer.
        """
        ...


@runtime_checkable
class SupportsQueueLimits(Protocol):
    """A fleet-wide concurrency limit per queue, enforced by the broker at every claim
    (``pop_from``, ``pop_many``, ``pop_ahead``, ``finish_and_claim``), so it holds for any
    number of workers and survives their crashes.

    A claim holds a slot for as long as its lease lives (started or not): a claim's slot is
    counted from the claims themselves, never from a separate counter, so it comes back
    however the lease ends (``complete_job``, ``fail_job``, ``retry_job``, a reclaim by
    ``recover_stalled_jobs``). A pop hands out only the jobs that fit: fewer than asked (even
    none while ready jobs wait) when the queue is at its limit. With ``per_key`` the limit
    holds per concurrency key (:attr:`Job.key`; a job without one counts under ``""``), keys
    independent: a job whose key is full is skipped, and the jobs behind it of other keys
    are still claimed, in their order. A job re-leased to a sweep past ``max_stalled`` holds
    its slot until it is failed.

    ``wait_for_work`` (:class:`SupportsWakeup`) does not return at once for ready jobs none
    of which fits: a lease ending on a limited queue wakes its waiters (or a bounded safety
    poll does), so a worker at the limit waits instead of spinning.
    """

    async def set_queue_limit(
        self, queue: str, limit: int | None, *, per_key: bool = False
    ) -> None:
        """Store ``queue``'s limit (``None``: remove it), for every client of the broker (the
        last writer wins). Claims already held stay held: a lower limit only stops new claims
        until enough leases end.

        Raises:
            ConfigError: ``limit`` is not ``None`` or an int >= 1.
        """
        ...


@attrs.frozen(repr=False, eq=False)
class RateGrant:
    """What one :meth:`SupportsRateLimits.take_starts` granted."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    granted: int
    """Starts taken (at most the ``want`` asked)."""
    retry_after: float = 0.0
    """With none granted: seconds until one more start fits (broker clock); else 0."""
    at: float = 0.0
    """The broker time the starts were logged at (hand it to ``return_starts``)."""


@runtime_checkable
class SupportsRateLimits(Protocol):
    """A rate limit per queue: at most ``count`` starts in any window of ``per`` seconds,
    fleet-wide. The broker keeps a sliding-window log of each limited queue's start times
    (exact, not a token bucket). A worker takes starts (:meth:`take_starts`) before it claims,
    claims at most what it was granted, and gives back (:meth:`return_starts`) what the claim
    did not use; with none granted it waits ``retry_after`` without claiming, so the jobs past
    the rate wait in the broker, not in a worker's slot. A queue without a stored rate grants
    whatever is asked and logs nothing.

    With a ``key`` (a per-key rate, ``dt.Rate(..., key=...)``), :meth:`take_starts` and
    :meth:`return_starts` use one log per ``(queue, key)`` held to the queue's stored rate, each
    key independent of the others and of the queue's own (keyless) log; the caller decides
    which it uses. The stored ``per_key`` flag only tells the operator's view
    (``QueueStats``) which logs to count: the keyless one, or the keys' (``window_keys``, and
    the busiest key's ``window``).
    """

    async def set_queue_rate(
        self, queue: str, count: int | None, per: float = 1.0, *, per_key: bool = False
    ) -> None:
        """Store ``queue``'s rate (``count=None``: remove it), for every client of the broker
        (the last writer wins), and whether it holds per key. The log of starts is kept across
        changes.

        Raises:
            ConfigError: ``count``/``per`` is not a rate (``brokers._rates.check_rate``).
        """
        ...

    async def take_starts(self, queue: str, want: int, key: str | None = None) -> RateGrant:
        """Atomically log up to ``want`` starts now, as many as fit the stored rate (in the
        log of ``key`` when given)."""
        ...

    async def return_starts(
        self, queue: str, at: float, n: int, key: str | None = None
    ) -> None:
        """Remove ``n`` starts logged at ``at`` (a grant the claim did not use; in the log of
        ``key`` when given). Entries already gone (out of the window) are ignored."""
        ...
