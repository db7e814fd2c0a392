"""The engine's watch over the attempts it dispatched: start-to-close guard, schedule-to-start
timeout, and the report of an attempt waiting on a queue that no live worker serves.

Nothing here is on the hot path: a dispatch adds at most three entries to one heap
(:class:`StepChecks`, which the engine's services tell of every dispatch), and one task
(:class:`StepWatch`) sleeps until the earliest is due. Only an entry that comes due while its
attempt is still pending costs anything: one read of the checkpoint, then at most one broker call
(:class:`~durable_trio.brokers.SupportsJobState`: does the job still wait, or who holds it)
and one key-store read (the queue's live workers, shared for a second by every check of
that queue). So a step that ends before its timeouts
costs no call at all (docs/decisions.md, "Step timeouts").

What each entry does when it comes due (trio clock of the engine, from the moment the attempt
became ready: its dispatch, plus its backoff delay):

- ``guard`` (``timeout + step_timeout_grace``): the job still waits → not started, look again
  one ``timeout + grace`` later; claimed by a worker that has no live liveness key (killed,
  stopped) → fail the attempt as ``StepTimedOut`` (retryable: retried per its policy); claimed
  by a live worker → its own timer cancels the handler, look again later; gone → its result
  is on its way (or applied).
- ``start`` (``schedule_to_start_timeout``): the job still waits → fail the step
  (``ScheduleToStartTimeout``, not retryable: a retry would wait on the same queue), naming
  the queue and how long it waited.
- ``report`` (``unstarted_report_after``): the step is still pending and no live worker serves
  its queue → report :class:`StepNotStarted` through the error hook (with no broker call: a
  queue no live worker serves had its job taken by no live worker); the attempt keeps
  waiting. At most one report per queue per :data:`UNSTARTED_REPORT_INTERVAL`: the attempts
  that come due meanwhile are counted (``steps_unstarted_reported``) and the next report of
  that queue says how many it stands for, so a paused worker under load is a few lines, not
  one per attempt.

Failing an attempt goes through the result handler as a failed :class:`StepResult` would, so
it is the same compare-and-set: a real result that landed first wins, and a late real result
for the failed attempt is ignored as stale.

These timers live in the engine that dispatched the attempt. An engine that takes a run over
re-arms them for an attempt only when it dispatches it (a retry, a re-dispatch); an attempt
already on the broker keeps its worker-side ``timeout`` and the broker's stalled recovery.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Any

import attrs
import trio
from trio_util import RepeatedEvent

from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._errors import BrokerError, DurableTrioError, TransportClosed
from .._naming import sanitize_token
from .._transport._handler_timeout import STEP_TIMED_OUT
from .._transport._liveness import read_group_health
from .._wire import StepError, StepResult, StepStatus
from ..brokers import SupportsJobState
from ._errors import EngineError
from ._records import StepKind, StepState
from ._step_timeouts import StepTimeouts

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ..brokers import JobState
    from ._options import EngineOptions
    from ._records import StepRecord
    from ._services import EngineServices

__all__ = [
    "SCHEDULE_TO_START",
    "UNSTARTED_REPORT_INTERVAL",
    "StepChecks",
    "StepNotStarted",
    "StepWait",
    "StepWatch",
    "live_workers",
    "step_watch_options",
    "waiting",
]

#: The error code of a step no worker took within its ``schedule_to_start_timeout``.
SCHEDULE_TO_START = "ScheduleToStartTimeout"

_GUARD, _START, _REPORT = "guard", "start", "report"

#: Seconds a read of a queue's live workers is reused, and the step names it is kept for.
_LIVE_CACHE, _LIVE_CACHE_NAMES = 1.0, 1024
#: Seconds between two :class:`StepNotStarted` reports of one queue (the attempts due between
#: them are folded into the next report's ``suppressed``).
UNSTARTED_REPORT_INTERVAL = 10.0


class StepNotStarted(EngineError):
    """Reported (not raised): a step attempt has waited on a queue that no live worker serves
    (a misspelt step name, a worker not deployed or down). The run keeps waiting.

    One report per queue per :data:`UNSTARTED_REPORT_INTERVAL` (10 s): it stands for the
    attempts of that queue that came due since the previous one, unreported (``suppressed``).

    Attributes:
        run_id, step_id, name: the step.
        queue: the task queue it waits on (``{prefix}:tasks:{token}``).
        waited: seconds it has waited.
        suppressed: attempts on that queue found waiting the same way since the previous
            report, not reported one by one.
    """

    def __init__(
        self,
        run_id: str,
        step_id: str,
        name: str,
        queue: str,
        waited: float,
        suppressed: int = 0,
    ) -> None:
        more = ""
        if suppressed:
            more = (
                f" ({suppressed} more attempt(s) on this queue found waiting since the last "
                "report, not reported one by one)"
            )
        super().__init__(
            f"step {name!r} (run {run_id}, step {step_id}) has waited {waited:.1f} s on "
            f"queue {queue!r}, which no live worker serves: is the step name right, and is a "
            f"worker serving it running?{more}"
        )
        self.run_id = run_id
        self.step_id = step_id
        self.name = name
        self.queue = queue
        self.waited = waited
        self.suppressed = suppressed


@attrs.define(repr=False, eq=False)
class _Attempt:
    """One dispatched attempt the watch knows."""

    __repr__ = shared_repr
    __eq__ = shared_eq  # (and so unhashable, as attrs leaves a mutable class)

    run_id: str
    step_id: str
    attempt: int
    name: str
    queue: str
    job_id: str
    ready_at: float
    """Trio time it became ready (dispatch + backoff delay)."""
    timeouts: StepTimeouts
    due: int = 0
    """Checks of it still in the heap."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.run_id, self.step_id)


@attrs.frozen(repr=False, eq=False)
class StepWait:
    """A remote step a run waits on (:meth:`Engine.waiting`)."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    step_id: str
    name: str
    attempt: int
    queue: str
    """The task queue its attempt waits on (``{prefix}:tasks:{token}``)."""
    waited: float
    """Seconds since its current attempt was dispatched (or became ready)."""
    live_workers: int | None
    """Live workers serving that queue (``None``: the backend has no worker-key store)."""
    taken: bool | None
    """Whether a worker holds the attempt's job (``None``: not known here)."""

    def describe(self) -> str:
        """One line for a person: where it waits, for how long, and whether anyone serves it."""
        text = f"step {self.name!r} (id {self.step_id}, attempt {self.attempt}) "
        if self.taken:
            text += f"is running (taken from queue {self.queue!r}, {self.waited:.1f} s ago)"
        else:
            text += f"has waited {self.waited:.1f} s on queue {self.queue!r}"
        if self.live_workers == 0:
            text += "; no live worker serves it"
        elif self.live_workers is not None:
            text += f"; {self.live_workers} live worker(s) serve it"
        return text


class StepChecks:
    """The heap of due checks of the attempts dispatched here (see the module docstring): the
    engine's services tell it of every dispatch (:meth:`dispatched`); the watch
    (:class:`StepWatch`) runs the checks as they come due. Made by the engine before its
    services.

    Args:
        options: the engine's options (``unstarted_report_after``, ``step_timeout_grace``).
        task_queue: the task queue of a step name (the transport's names).
    """

    def __init__(self, options: EngineOptions, task_queue: Callable[[str], str]) -> None:
        self._options = options
        self._task_queue = task_queue
        self.heap: list[tuple[float, int, str, _Attempt]] = []
        """The checks due, soonest first."""
        self._seq = itertools.count()
        self.changed = RepeatedEvent()
        """Set when a check due sooner than every other was pushed."""
        self.attempts: dict[tuple[str, str], _Attempt] = {}
        """The latest dispatched attempt of each step, while it has a check due."""

    def dispatched(
        self, record: StepRecord, timeouts: StepTimeouts, job_id: str, delay: float
    ) -> None:
        """``record``'s current attempt went out as job ``job_id``, ready after ``delay``."""
        options = self._options
        report = options.unstarted_report_after or None
        start = timeouts.schedule_to_start
        if timeouts.timeout is None and start is None and report is None:
            return
        attempt = _Attempt(
            record.run_id,
            record.step_id,
            record.attempt,
            record.name,
            self._task_queue(record.name),
            job_id,
            trio.current_time() + delay,
            timeouts,
        )
        self.attempts[attempt.key] = attempt
        if timeouts.timeout is not None:
            guard = attempt.ready_at + timeouts.timeout + options.step_timeout_grace
            self.push(guard, _GUARD, attempt)
        if start is not None:
            self.push(attempt.ready_at + start, _START, attempt)
        if report is not None and (start is None or report < start):
            self.push(attempt.ready_at + report, _REPORT, attempt)

    def push(self, at: float, kind: str, attempt: _Attempt) -> None:
        """A check of ``kind`` for ``attempt`` comes due at ``at``."""
        first = not self.heap or at < self.heap[0][0]
        attempt.due += 1
        heapq.heappush(self.heap, (at, next(self._seq), kind, attempt))
        if first:
            self.changed.set()

    def pop(self) -> tuple[str, _Attempt]:
        """The check due soonest, taken off the heap."""
        _, _, kind, attempt = heapq.heappop(self.heap)
        attempt.due -= 1
        return kind, attempt

    def done(self, attempt: _Attempt) -> None:
        """A check of ``attempt`` ran: forget it once it has none due."""
        if not attempt.due and self.attempts.get(attempt.key) is attempt:
            del self.attempts[attempt.key]


class StepWatch:
    """Runs the checks of :class:`StepChecks` as they come due. Made by the engine; :meth:`run`
    runs in its loops nursery."""

    def __init__(
        self,
        services: EngineServices,
        checks: StepChecks,
        apply: Callable[[StepResult], Awaitable[None]],
    ) -> None:
        self.services = services
        self._checks = checks
        self._push = checks.push
        self._apply = apply
        self._live: dict[str, tuple[float, set[str] | None]] = {}
        self._last_report: dict[str, tuple[float, int]] = {}
        """Per queue: when it was last reported not served, and the reports held since."""

    async def run(self) -> None:
        """Run each check when it comes due, until cancelled (the engine closing)."""
        checks = self._checks
        heap = checks.heap
        while True:
            if not heap:
                await checks.changed.wait()
                continue
            at = heap[0][0]
            if trio.current_time() < at:
                with trio.move_on_at(at):
                    await checks.changed.wait()
                continue
            kind, attempt = checks.pop()
            try:
                await self._check(kind, attempt)
            except (BrokerError, TransportClosed) as exc:
                self.services.report(exc)
            checks.done(attempt)

    async def _current(self, attempt: _Attempt) -> bool:
        """Whether ``attempt`` is still its step's pending attempt, waited on here. A step no
        driver of this engine waits on any more (settled, or its run no longer driven here)
        costs nothing: the common case, a step that ended before its checks came due, reads
        no store. The result handler's compare-and-set has the last word anyway."""
        services = self.services
        waiter = services.waiters.get(attempt.key)
        if waiter is None:
            return False
        record = waiter.record
        if record is None:
            record = await services.store.get_step(attempt.run_id, attempt.step_id)
        return (
            record is not None
            and record.kind is StepKind.REMOTE
            and record.status is StepState.PENDING
            and record.attempt == attempt.attempt
        )

    async def _job(self, attempt: _Attempt) -> JobState | bool | None:
        """The job's state; ``False``: the broker cannot tell."""
        broker = self.services.transport.backend.broker
        if not isinstance(broker, SupportsJobState):
            return False
        return await broker.job_state(attempt.queue, attempt.job_id)

    async def live_workers(self, name: str, *, fresh: bool = False) -> set[str] | None:
        """The instances serving step ``name``'s queue (``None``: no worker-key store), read
        at most once a second per step name (many attempts come due together) unless
        ``fresh``."""
        now = trio.current_time()
        cached = self._live.get(name)
        if fresh or cached is None or now - cached[0] >= _LIVE_CACHE:
            cached = self._live[name] = (now, await live_workers(self.services, name))
            if len(self._live) > _LIVE_CACHE_NAMES:
                self._live = {name: cached}
        return cached[1]

    async def _check(self, kind: str, attempt: _Attempt) -> None:
        if not await self._current(attempt):
            return
        if kind == _REPORT:
            await self._report(attempt)
            return
        job = await self._job(attempt)
        if job is None or job is False:
            return  # gone (its result is on its way), or the broker cannot tell
        assert not isinstance(job, bool)
        now = trio.current_time()
        timeouts = attempt.timeouts
        if kind == _GUARD:
            assert timeouts.timeout is not None
            again = now + timeouts.timeout + self.services.options.step_timeout_grace
            if not job.claimed:
                self._push(again, _GUARD, attempt)
                return
            live = await self.live_workers(attempt.name, fresh=True)
            if live is None or sanitize_token(job.worker) in live:
                self._push(again, _GUARD, attempt)  # its worker's own timer applies
                return
            self.services.count("steps_timed_out")
            await self._fail(
                attempt,
                StepError(
                    message=f"StepTimedOut: step {attempt.name!r} did not finish within its "
                    f"timeout of {timeouts.timeout:g} s, and its worker {job.worker!r} is gone "
                    f"(no live liveness key): failed by the engine {now - attempt.ready_at:.1f} "
                    f"s after it became ready on queue {attempt.queue!r}",
                    code=STEP_TIMED_OUT,
                    retryable=True,
                    details={"queue": attempt.queue, "worker": job.worker},
                ),
            )
        else:  # _START
            if job.claimed:
                return
            live = await self.live_workers(attempt.name)
            served = "" if live else "; no live worker serves it"
            waited = now - attempt.ready_at
            self.services.count("steps_not_started")
            await self._fail(
                attempt,
                StepError(
                    message=f"ScheduleToStartTimeout: no worker took step {attempt.name!r} "
                    f"within its schedule_to_start_timeout of {timeouts.schedule_to_start:g} "
                    f"s: it waited {waited:.1f} s on queue {attempt.queue!r}{served}",
                    code=SCHEDULE_TO_START,
                    retryable=False,
                    details={"queue": attempt.queue, "waited": waited},
                ),
            )

    async def _report(self, attempt: _Attempt) -> None:
        """The default report: no broker call, one (cached) key-store read. A queue that no
        live worker serves cannot have had the job taken by a live worker."""
        live = await self.live_workers(attempt.name)
        if live is None or live:
            return  # no key store to tell, or a worker serves the queue (a backlog)
        self.services.count("steps_unstarted_reported")
        now = trio.current_time()
        last = self._last_report.get(attempt.queue)
        if last is not None and now - last[0] < UNSTARTED_REPORT_INTERVAL:
            self._last_report[attempt.queue] = (last[0], last[1] + 1)
            return
        if len(self._last_report) >= _LIVE_CACHE_NAMES:
            self._last_report.clear()
        self._last_report[attempt.queue] = (now, 0)
        self.services.report(
            StepNotStarted(
                attempt.run_id,
                attempt.step_id,
                attempt.name,
                attempt.queue,
                now - attempt.ready_at,
                suppressed=0 if last is None else last[1],
            )
        )

    async def _fail(self, attempt: _Attempt, error: StepError) -> None:
        result = StepResult(
            attempt.run_id, attempt.step_id, attempt.attempt, StepStatus.FAILED, error=error
        )
        try:
            await self._apply(result)
        except DurableTrioError as exc:
            self.services.report(exc)


async def waiting(services: EngineServices, checks: StepChecks, run_id: str) -> list[StepWait]:
    """The remote steps ``run_id`` waits on, each with its queue, how long its attempt has
    waited and whether a live worker serves it (see :meth:`Engine.waiting`).

    Raises:
        BrokerError: the store, the broker or the key store did not answer.
    """
    store = services.store
    now = store.now()
    out = []
    for record in await store.get_steps(run_id):
        if record.kind is not StepKind.REMOTE or record.status is not StepState.PENDING:
            continue
        queue = services.transport.names.task_queue(record.name)
        known = checks.attempts.get((run_id, record.step_id))
        taken: bool | None = None
        if known is not None and known.attempt == record.attempt:
            waited = max(0.0, trio.current_time() - known.ready_at)
            broker = services.transport.backend.broker
            if isinstance(broker, SupportsJobState):
                job = await broker.job_state(queue, known.job_id)
                taken = None if job is None else job.claimed
        else:
            since = record.wake_at if record.wake_at is not None else record.updated_at
            waited = max(0.0, now - since)
        live = await live_workers(services, record.name)
        out.append(
            StepWait(
                record.step_id,
                record.name,
                record.attempt,
                queue,
                waited,
                None if live is None else len(live),
                taken,
            )
        )
    return out


#: The engine options of the step watch, taken from ``open_engine``'s keywords.
WATCH_OPTIONS = ("step_timeout_grace", "unstarted_report_after", "audit_interval")


def step_watch_options(keywords: dict[str, Any]) -> dict[str, Any]:
    """Take the step watch's options out of ``keywords`` (``open_engine``'s)."""
    return {name: keywords.pop(name) for name in WATCH_OPTIONS if name in keywords}


async def live_workers(services: EngineServices, name: str) -> set[str] | None:
    """The instances serving step ``name``'s queue (``None``: no worker-key store)."""
    transport = services.transport
    keys = transport.backend.keys
    if keys is None:
        return None
    names = transport.names
    health = await read_group_health(keys, names, names.token_of(name), 0)
    return {w.instance for w in health.live_workers}
