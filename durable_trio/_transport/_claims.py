"""The claims a transport holds, from its pop to its finalize or handback (T8, T24 of
docs/spec.md): their states, the loops and job workers that carry them, the levels of the
nursery tree, and the errors the parts that act on them report."""

from __future__ import annotations

import collections
import enum
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import attrs
import trio

from .._errors import BrokerError, DamagedJob, JobError
from ..brokers import ClaimedJob
from ._slots import Slots

if TYPE_CHECKING:
    from ..brokers import Job

__all__ = ["ClaimState", "Level"]

_OnJob = Callable[[ClaimedJob], Awaitable["Job | None"]]


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


@attrs.define(eq=False)
class _Claim:
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


@attrs.define(eq=False)
class _Loop:
    queue: str
    on_job: _OnJob
    slots: Slots
    backoff_max: int
    token: str | None = None
    """The routing token of a task loop (whose serving starts a liveness key)."""
    inbox: bool = False
    """This instance's own inbox: runs in the inboxes group and is never deferred (no other
    process could take its jobs)."""
    pop_scope: trio.CancelScope | None = None
    idle: list[_JobWorker] = attrs.Factory(list)
    buffer: collections.deque[_Claim] = attrs.Factory(collections.deque)
    """Claims popped ahead of a free slot (prefetch), renewed and handed back like any."""
    backlog: bool = False
    """The last claim of this loop (a pop, or a finalize that claimed) got all it asked for:
    the queue likely holds more, so a finishing job worker claims its next job in its
    finalize's round trip (``SupportsFinishAndClaim``)."""


class _Next:
    """A finishing job worker's ask for its next claim, answered by the finalize that claims
    (``JobRunner._hand_over``): ``claim`` is set when the reply lands; ``gone`` once the worker
    no longer waits for it (a claim landing after that is handed back, never left unrun)."""

    __slots__ = ("claim", "gone", "loop")

    def __init__(self, loop: _Loop) -> None:
        self.loop = loop
        self.claim: _Claim | None = None
        self.gone = False


@attrs.define(eq=False)
class _JobWorker:
    """A task that runs one loop's jobs one after another, parked while idle.

    One task per running handler, each in its own cancel scope (so a lost lease or close's
    deadline cancels exactly that handler, T8 and T24) — but the task and its scope outlive one
    job: rescheduling a parked worker is far cheaper than spawning a task and building a scope
    per job (docs/decisions.md, "Job workers are reused"). Cancelling the scope ends the worker
    with its job; the loop starts a fresh one when next needed.
    """

    task: trio.lowlevel.Task
    scope: trio.CancelScope



def _quarantined(queue: str, job: ClaimedJob) -> DamagedJob:
    """The report of an entry a pop could not tie to a job (``job.damage`` set, no lease): the
    broker already moved it to its quarantine, and there is nothing to finalize."""
    return DamagedJob(
        f"unreadable entry moved to the quarantine: {job.damage}", queue=queue, job_id=job.id
    )


def _job_error(message: str, claim: _Claim, cause: BaseException) -> JobError:
    error = JobError(message, queue=claim.queue, job_id=claim.job.id)
    error.__cause__ = cause
    return error


def _unexpected(exc: Exception, doing: str) -> BrokerError:
    """A broker call that raised something other than a :class:`BrokerError` (a defect in a
    broker, or stored data it failed to validate), as the error the loops report and back off
    on: the loop goes on, the cause stays attached."""
    error = BrokerError(f"{doing} raised {exc!r} (reported, retried after a backoff)")
    error.__cause__ = exc
    return error
