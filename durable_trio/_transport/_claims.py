"""The claims a transport holds, from its pop to its finalize or handback (T8, T24 of
docs/spec.md): their states and the one table that moves them (:class:`ClaimTable`), the loops
and job workers that carry them, the levels of the nursery tree, and the errors the parts that
act on them report."""

from __future__ import annotations

import collections
import enum
import types
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING

import attrs
import trio

from .._attrs_shared import shared_repr
from .._errors import BrokerError, DamagedJob, JobError
from ..brokers import ClaimedJob, SupportsRateLimits
from ._slots import Slots

if TYPE_CHECKING:
    from ..brokers import Job, Lease

__all__ = [
    "Claim",
    "ClaimState",
    "ClaimTable",
    "JobWorker",
    "Level",
    "Loop",
    "NextClaim",
    "OnJob",
    "job_error",
    "quarantined",
    "unexpected",
]

OnJob = Callable[[ClaimedJob], Awaitable["Job | None"]]


class Level:
    """One level of the transport's nursery tree: the nursery its part starts tasks in, set
    by the tree (``_tree``) while the level is open."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.nursery: trio.Nursery


class ClaimState(enum.Enum):
    """Where a claim this instance holds stands, from its pop to its finalize or handback."""

    BUFFERED = "buffered"
    """Popped ahead of a free slot (prefetch), not started yet."""
    RUNNING = "running"
    """Its handler runs (or is about to, in a job worker)."""
    WAITING = "waiting"
    """A suspect (it stalled before) waiting to run alone in its job worker; not started
    (stored so, on a broker that claims ahead). Close hands it back, a lost lease drops it."""
    FINALIZING = "finalizing"
    """Its handler ended; its outcome is being written (shielded, bounded by close)."""
    ABANDONED = "abandoned"
    """Cancelled before it finished (close, a lost lease): kept for close's handback."""
    DROPPED = "dropped"
    """Buffered, then taken back by the broker before it started: the loop skips it."""


# The members as module globals, which the hot paths compare against (``claim.state is
# _RUNNING``) once or more per job: reading a member off its Enum class goes through a
# descriptor on Python 3.11, a global lookup does not.
_BUFFERED = ClaimState.BUFFERED
_RUNNING = ClaimState.RUNNING
_WAITING = ClaimState.WAITING
_FINALIZING = ClaimState.FINALIZING
_ABANDONED = ClaimState.ABANDONED
_DROPPED = ClaimState.DROPPED


@attrs.define(eq=False, repr=False)
class Claim:
    __repr__ = shared_repr

    queue: str
    job: ClaimedJob
    scope: trio.CancelScope | None = None
    """The scope of the job worker running it (cancelling it cancels exactly this handler)."""
    state: ClaimState = _RUNNING
    lost: bool = False
    lost_at: float | None = None
    """When the lease keeper found this claim's lease lost (trio clock), or ``None``."""
    ahead: bool = False
    """Stored as not started (popped ahead of a free slot, or a suspect) until its job worker
    marks it started, just before its handler runs (see ``SupportsClaimAhead``)."""

    def cancel(self) -> None:
        if self.scope is not None:
            self.scope.cancel()


@attrs.define(eq=False, repr=False)
class Loop:
    __repr__ = shared_repr

    queue: str
    on_job: OnJob
    slots: Slots
    backoff_max: int
    token: str | None = None
    """The routing token of a task loop (whose serving starts a liveness key)."""
    inbox: bool = False
    """This instance's own inbox: runs in the inboxes group and is never deferred (no other
    process could take its jobs)."""
    pop_scope: trio.CancelScope | None = None
    idle: list[JobWorker] = attrs.Factory(list)
    buffer: collections.deque[Claim] = attrs.Factory(collections.deque)
    """Claims popped ahead of a free slot (prefetch), renewed and handed back like any."""
    backlog: bool = False
    """The last claim of this loop (a pop, or a finalize that claimed) got all it asked for:
    the queue likely holds more, so a finishing job worker claims its next job in its
    finalize's round trip (``SupportsFinishAndClaim``)."""
    rate: SupportsRateLimits | None = None
    """The broker that keeps this queue's rate limit (``None``: no rate): each claim first
    takes starts from it (``take_starts``) and claims no more than granted; such a loop never
    claims ahead nor in a finalize (every claim goes through the rate)."""


class NextClaim:
    """A finishing job worker's ask for its next claim, answered by the finalize that claims
    (``JobRunner._hand_over``): ``claim`` is set when the reply lands; ``gone`` once the worker
    no longer waits for it (a claim landing after that is handed back, never left unrun)."""

    __slots__ = ("claim", "gone", "loop")

    def __init__(self, loop: Loop) -> None:
        self.loop = loop
        self.claim: Claim | None = None
        self.gone = False


@attrs.define(eq=False, repr=False)
class JobWorker:
    """A task that runs one loop's jobs one after another, parked while idle.

    One task per running handler, each in its own cancel scope (so a lost lease or close's
    deadline cancels exactly that handler, T8 and T24) — but the task and its scope outlive one
    job: rescheduling a parked worker is far cheaper than spawning a task and building a scope
    per job (docs/decisions.md, "Job workers are reused"). Cancelling the scope ends the worker
    with its job; the loop starts a fresh one when next needed.
    """

    __repr__ = shared_repr

    task: trio.lowlevel.Task
    scope: trio.CancelScope


class ClaimTable:
    """Every claim this instance holds, by lease token, and the one owner of their states.

    Each transition of a claim — popped ahead (buffered), begun, waiting to run alone,
    finalizing, dropped, lost, abandoned, handed back — is a method here; the consumers (which
    pop), the job runner (which runs and finalizes) and the lease keeper (which learns of lost
    leases) ask this table and never set a claim's state or edit the table themselves. The
    table is read through :attr:`view` (a read-only mapping).
    """

    __slots__ = ("_by_token", "view")

    def __init__(self) -> None:
        self._by_token: dict[str, Claim] = {}
        self.view: Mapping[str, Claim] = types.MappingProxyType(self._by_token)
        """The claims by lease token, read-only."""

    def __len__(self) -> int:
        return len(self._by_token)

    def __iter__(self) -> Iterator[Claim]:
        return iter(self._by_token.values())

    def lost_at(self, token: str) -> float | None:
        """When this instance learnt that its claim ``token`` was lost (``None``: it did not)."""
        claim = self._by_token.get(token)
        return None if claim is None else claim.lost_at

    def leases_by_queue(self) -> dict[str, list[Lease]]:
        """The lease of every claim held, by queue (what a renewal round renews)."""
        by_queue: dict[str, list[Lease]] = {}
        for claim in self._by_token.values():
            by_queue.setdefault(claim.queue, []).append(claim.job.lease)
        return by_queue

    # ------------------------------------------------------------------ from a pop

    def begin(self, queue: str, job: ClaimedJob) -> Claim:
        """A popped job that starts at once (its slot is free): tracked, running."""
        claim = Claim(queue, job, ahead=not job.started)
        self._by_token[job.lease.token] = claim
        return claim

    def buffer(self, queue: str, job: ClaimedJob, *, ahead: bool) -> Claim:
        """A job claimed ahead of a free slot (prefetch, or a finalize that claimed): tracked
        (renewed, handed back by close) but not started."""
        claim = Claim(queue, job, None, _BUFFERED, False, None, ahead)  # (every claim ahead)
        self._by_token[job.lease.token] = claim
        return claim

    def start_buffered(self, claim: Claim) -> bool:
        """A buffered claim starts (``False``: it was taken back or set aside meanwhile)."""
        if claim.state is not _BUFFERED:
            return False
        claim.state = _RUNNING
        return True

    # ------------------------------------------------------------------ in a job worker

    def wait_alone(self, claim: Claim) -> None:
        """A suspect waits to run alone (not started yet)."""
        claim.state = _WAITING

    def run_alone(self, claim: Claim) -> None:
        """A suspect's wait is over: it runs, alone."""
        claim.state = _RUNNING

    def hand_back_suspect(self, claim: Claim) -> None:
        """A suspect waited in vain: its handback is its final write (shielded, bounded)."""
        claim.state = _FINALIZING

    def drop_unstarted(self, claim: Claim) -> None:
        """Popped ahead and taken back before it started: never ran here, nothing to finalize."""
        claim.lost = True
        claim.state = _DROPPED

    def finalizing(self, claim: Claim) -> bool:
        """Its handler ended: ``True`` if its outcome is to be written (still running and
        ours); ``False`` if it was abandoned by close or its lease went to another worker (T8),
        so its outcome must not finalize someone else's claim."""
        if claim.state is _RUNNING and not claim.lost:
            claim.state = _FINALIZING
            return True
        return False

    def abandon(self, claim: Claim) -> None:
        """A claim that will not run here (close has begun): kept for close's handback."""
        claim.state = _ABANDONED

    def end(self, claim: Claim) -> None:
        """Its job worker is done with it: finalized (or dropped, or lost) claims leave the
        table; one cancelled before it finished (by close, a lost lease, or the whole transport
        from outside) is kept, abandoned, for close's handback."""
        if claim.state is _RUNNING or claim.state is _WAITING:
            claim.state = _ABANDONED
        if claim.state is not _ABANDONED or claim.lost:
            del self._by_token[claim.job.lease.token]

    def set_aside(self, claim: Claim) -> bool:
        """A claim a finalize made for a worker that no longer takes it: abandoned (to be
        handed back) if still buffered; ``False`` if the broker took it back meanwhile."""
        if claim.state is not _BUFFERED:
            return False
        claim.state = _ABANDONED
        return True

    def handed_back(self, claim: Claim) -> None:
        """Its handback landed: no longer held."""
        self._by_token.pop(claim.job.lease.token, None)

    # ------------------------------------------------------------------ lost leases (T8)

    def lose(self, token: str, now: float, *, cancel: bool) -> Claim | None:
        """The broker says the lease ``token`` was lost. A claim that never started here (a
        buffered one, or a suspect waiting to run alone) is dropped: no double run. A running
        one is marked lost at ``now`` and, with ``cancel``, its handler cancelled; it is
        returned (the duplicate to report). ``None``: nothing ran on it here, or it finished
        during the round trip (finalized, not lost)."""
        held = self._by_token.get(token)
        if held is None:
            return None
        if held.state is _BUFFERED:
            # Prefetched and taken back before it ever started: the loop skips it.
            held.state = _DROPPED
            del self._by_token[token]
            return None
        if held.state is _WAITING:
            # Its job worker drops it (the cancellation ends the wait).
            held.state = _DROPPED
            held.lost = True
            held.cancel()
            return None
        if held.state is not _RUNNING or held.lost:
            return None
        held.lost = True
        held.lost_at = now  # what a result it still makes says
        if cancel:
            held.cancel()
        return held

    # ------------------------------------------------------------------ close (T24)

    def bound_finalizes(self, bound: float) -> None:
        """The finalizes in flight land by ``bound`` (absolute time)."""
        for claim in self._by_token.values():
            if claim.state is _FINALIZING and claim.scope is not None:
                claim.scope.deadline = bound

    def abandon_waiting(self) -> None:
        """The suspects waiting to run alone never start; each keeps its claim for the
        handback (attempt-neutral, uncounted: their handlers never ran here)."""
        for claim in self._by_token.values():
            if claim.state is _WAITING:
                claim.state = _ABANDONED
                claim.cancel()

    def abandon_running(self) -> None:
        """Cancel every handler still running; each keeps its claim for the handback."""
        for claim in self._by_token.values():
            if claim.state is _RUNNING or claim.state is _WAITING:
                claim.state = _ABANDONED
                claim.cancel()
            elif claim.state is _BUFFERED:  # prefetched, never started
                claim.state = _ABANDONED

    def take_open(self) -> list[Claim]:
        """Every claim still open, leaving the table empty (close hands them back)."""
        claims = list(self._by_token.values())
        self._by_token.clear()
        return claims


def quarantined(queue: str, job: ClaimedJob) -> DamagedJob:
    """The report of an entry a pop could not tie to a job (``job.damage`` set, no lease): the
    broker already moved it to its quarantine, and there is nothing to finalize."""
    return DamagedJob(
        f"unreadable entry moved to the quarantine: {job.damage}", queue=queue, job_id=job.id
    )


def job_error(message: str, claim: Claim, cause: BaseException) -> JobError:
    error = JobError(message, queue=claim.queue, job_id=claim.job.id)
    error.__cause__ = cause
    return error


def unexpected(exc: Exception, doing: str) -> BrokerError:
    """A broker call that raised something other than a :class:`BrokerError` (a defect in a
    broker, or stored data it failed to validate), as the error the loops report and back off
    on: the loop goes on, the cause stays attached."""
    error = BrokerError(f"{doing} raised {exc!r} (reported, retried after a backoff)")
    error.__cause__ = exc
    return error
