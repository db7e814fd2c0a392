"""Fault injection: a queue broker and a key store wrapped so that one process's view of them
can be delayed, dropped, paused, stalled or killed, from a seeded random generator.

Each simulated process (a worker, the engine) gets its own :class:`FaultyBroker` and
:class:`FaultyKeyStore` over the ONE shared broker and key store, driven by its own
:class:`Injector`: faults are per process, as they are in production (one worker's network
partition is not everyone's).

What each fault models:

- **delay**: a call waits ``[0, delay_max)`` seconds (virtual) before it reaches the broker;
- **drop**: the request is lost: the call raises :class:`~durable_trio.BrokerUnavailable` and
  the broker never sees it;
- **lost reply**: the broker DID perform the call, then the reply was lost: the call raises.
  (A push whose reply is lost is pushed again by whoever retries it: a duplicate task.)
- **pause renewal**: every lease renewal raises for a while, so claims age past the stalled
  threshold and are re-delivered elsewhere (the duplicate execution at-least-once allows);
- **stall**: every call of the process waits until the stall ends (from outside, a process
  whose event loop is frozen looks exactly like this);
- **kill**: every call raises at once, forever (the process is gone; nothing it does reaches
  the broker any more);
- **lost write**: a push of step tasks or step results is acknowledged, then lost (it never
  reaches the broker; a completion pushed with it still happens), as a Redis master killed
  before it replicated an acknowledged write loses it (no ``min_replicas``): the engine's loss
  audit must find every such loss and dispatch its step again;
- **key-store write failure**: a ``put``/``put_many``/``remove`` raises (before reaching the
  store);
- **damaged claim**: a claim a pop hands over comes flagged as damaged
  (:attr:`~durable_trio.brokers.ClaimedJob.damage`), as a broker hands over an entry whose
  stored fields it could not read: the transport must set it aside unread, and its run must
  still complete (the step is answered with a retryable failure and tried again).

Fault injection is the one kind of test double this project uses: everything behind it is the
real broker and the real key store.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import attrs
import trio

from .._codec import decode_envelope
from .._errors import BrokerUnavailable, PayloadError
from .._wire import JobKind, RemoteTask, StepResult
from ..brokers import (
    ClaimedJob,
    SupportsBatchFinalize,
    SupportsBatchPop,
    SupportsClaimAhead,
    SupportsFailAndPush,
    SupportsFailedJobs,
    SupportsFinishAndClaim,
    SupportsJobState,
    SupportsJobStates,
    SupportsQueueLimits,
    SupportsRateLimits,
    SupportsRecovery,
    SupportsRenewal,
    SupportsSize,
    SupportsSweepHint,
    SupportsWakeup,
)

if TYPE_CHECKING:
    import random

    from ..brokers import (
        FailedJob,
        Job,
        JobState,
        Lease,
        QueueBroker,
        RateGrant,
        Recovery,
        RenewOutcome,
    )
    from ..keys import KeyEntry, KeyStore

__all__ = ["BrokerFaults", "FaultyBroker", "FaultyKeyStore", "Injector", "wrap_broker"]

T = TypeVar("T")

#: Calls that write: a lost reply means the write happened.
_PUSHES = frozenset(
    {"push_on", "push_many", "push_and_complete_many", "fail_and_push", "finish_and_claim"}
)


@attrs.frozen
class BrokerFaults:
    """Per-call fault probabilities (each call draws once from its process's generator)."""

    delay_probability: float = 0.0
    """A call is delayed ..."""
    delay_max: float = 1.0
    """... by up to this many seconds."""
    drop_probability: float = 0.0
    """A call's request is lost (the broker never sees it; the call raises)."""
    lost_reply_probability: float = 0.0
    """A call is performed but its reply is lost (the call raises)."""
    key_write_failure_probability: float = 0.0
    """A key-store write (put, put_many, remove) fails (raises, nothing written)."""
    damage_probability: float = 0.0
    """A claim a pop hands over comes flagged as damaged (its stored fields unreadable)."""
    lost_write_probability: float = 0.0
    """A push of step tasks or results is acknowledged but lost (never reaches the broker)."""

    @property
    def quiet(self) -> bool:
        return not (
            self.delay_probability
            or self.drop_probability
            or self.lost_reply_probability
            or self.key_write_failure_probability
            or self.damage_probability
            or self.lost_write_probability
        )


#: Receives every fault injected: ``(kind, details)``.
FaultRecorder = Callable[[str, dict[str, Any]], None]


class Injector:
    """One process's fault state: what its :class:`FaultyBroker` and :class:`FaultyKeyStore`
    do to each call. Driven by a seeded generator, so a seed replays the same faults.

    Args:
        name: the process (a worker's instance id, ``"engine"``), as recorded.
        rng: where per-call faults are drawn from.
        faults: the per-call fault probabilities.
        record: called with every fault injected (default: nothing).
    """

    def __init__(
        self,
        name: str,
        rng: random.Random,
        faults: BrokerFaults | None = None,
        record: FaultRecorder | None = None,
    ) -> None:
        self.name = name
        self.rng = rng
        self.faults = faults or BrokerFaults()
        self._record = record or (lambda kind, details: None)
        self.dead = False
        """Killed: every call raises at once."""
        self.renewal_paused_until = -float("inf")
        self.stalled_until = -float("inf")
        self.injected = 0
        """Faults injected so far (every kind)."""
        self.pushed: Callable[[list[list[Any]]], None] | None = None
        """Told the ``[run, step, attempt]`` of the step tasks of every push that reached the
        broker (its reply lost or not), if set."""

    # ------------------------------------------------------------------ scheduled faults

    def kill(self) -> None:
        """From now on every call raises (the process is gone)."""
        self.dead = True

    def pause_renewal(self, seconds: float) -> None:
        """Lease renewals raise for ``seconds`` (from now)."""
        self.renewal_paused_until = trio.current_time() + seconds

    def stall(self, seconds: float) -> None:
        """Every call (and every call in flight) waits ``seconds`` from now."""
        self.stalled_until = max(self.stalled_until, trio.current_time() + seconds)

    @property
    def stalled(self) -> bool:
        return trio.current_time() < self.stalled_until

    async def wait_out_stall(self) -> None:
        """Return once the process is not stalled (at once if it is not)."""
        # A loop, not an event: a stall may be extended while calls wait it out.
        while trio.current_time() < self.stalled_until:  # noqa: ASYNC110
            await trio.sleep_until(self.stalled_until)

    def quiet_down(self) -> None:
        """No more per-call faults (scheduled ones already over stay over)."""
        self.faults = BrokerFaults()

    # ------------------------------------------------------------------ per call

    def note(self, kind: str, **details: Any) -> None:
        self.injected += 1
        self._record(kind, {"process": self.name, **details})

    def _gone(self, op: str) -> BrokerUnavailable:
        return BrokerUnavailable(f"injected: {self.name} is dead ({op})")

    async def before(self, op: str) -> None:
        """Apply the faults that strike before ``op`` reaches the store (may raise)."""
        if self.dead:
            raise self._gone(op)
        if trio.current_time() < self.stalled_until:
            await self.wait_out_stall()
            if self.dead:
                raise self._gone(op)
        if op == "renew_jobs" and trio.current_time() < self.renewal_paused_until:
            raise BrokerUnavailable(f"injected: {self.name}'s renewal is paused")
        faults = self.faults
        if faults.quiet:
            await trio.lowlevel.checkpoint()
            return
        rng = self.rng
        if faults.delay_probability and rng.random() < faults.delay_probability:
            seconds = rng.random() * faults.delay_max
            self.note("delay", op=op, seconds=seconds)
            await trio.sleep(seconds)
            if self.dead:
                raise self._gone(op)
        else:
            await trio.lowlevel.checkpoint()
        if faults.drop_probability and rng.random() < faults.drop_probability:
            self.note("drop", op=op)
            raise BrokerUnavailable(f"injected: {op} from {self.name} was lost")

    def lose_reply(self, op: str) -> bool:
        """Whether ``op``'s reply is lost (the call happened)."""
        p = self.faults.lost_reply_probability
        return bool(p) and self.rng.random() < p

    def damage(self, op: str, queue: str, jobs: list[ClaimedJob]) -> list[ClaimedJob]:
        """``jobs`` as the pop hands them over: each flagged as damaged with
        ``damage_probability`` (drawn only when it is set, so other seeds replay unchanged)."""
        p = self.faults.damage_probability
        if not p:
            return jobs
        out = []
        for job in jobs:
            if self.rng.random() < p:
                details: dict[str, Any] = {"op": op, "queue": queue, "job": job.id}
                task = _task_keys([job])
                if task:
                    details["task"] = task[0]
                self.note("damage", **details)
                job = attrs.evolve(job, damage=f"injected: {self.name} read it damaged")
            out.append(job)
        return out

    def lose_write(self, op: str, jobs: Sequence[Job]) -> bool:
        """Whether ``op``'s push of ``jobs`` (step tasks or results only) is acknowledged and
        lost; drawn only when ``lost_write_probability`` is set (other seeds replay
        unchanged)."""
        p = self.faults.lost_write_probability
        if not p or not jobs or not _lossy(jobs) or self.rng.random() >= p:
            return False
        self.note(
            "lost-write",
            op=op,
            jobs=[job.id for job in jobs],
            lost_tasks=_task_keys(jobs),
            lost_results=_result_keys(jobs),
        )
        return True

    def fail_key_write(self) -> bool:
        p = self.faults.key_write_failure_probability
        return bool(p) and self.rng.random() < p


def _task_keys(jobs: Sequence[Job | ClaimedJob]) -> list[list[Any]]:
    """The ``[run, step, attempt]`` of the step tasks among ``jobs`` (what a duplicate push of
    them will run twice)."""
    keys = []
    for job in jobs:
        try:
            envelope = decode_envelope(job.data)
        except PayloadError:
            continue
        if envelope.kind is JobKind.TASK:
            task = cast("RemoteTask", envelope.payload)
            keys.append([task.run_id, task.step_id, task.attempt])
    return keys


def _claimed_in(reply: object) -> list[ClaimedJob]:
    """The claimed jobs in a broker call's reply (a pop's, a batch pop's, a
    finish-and-claim's)."""
    if isinstance(reply, tuple) and len(reply) == 2 and isinstance(reply[1], list):
        reply = reply[1]
    items = reply if isinstance(reply, list) else [reply]
    return [c for c in items if isinstance(c, ClaimedJob)]


def _result_keys(jobs: Sequence[Job | ClaimedJob]) -> list[list[Any]]:
    """The ``[run, step, attempt]`` of the step results among ``jobs``."""
    keys = []
    for job in jobs:
        try:
            envelope = decode_envelope(job.data)
        except PayloadError:
            continue
        if envelope.kind is JobKind.RESULT:
            result = cast("StepResult", envelope.payload)
            keys.append([result.run_id, result.step_id, result.attempt])
    return keys


def _lossy(jobs: Sequence[Job]) -> bool:
    """Whether every one of ``jobs`` is a step task or a step result (what a lost write may
    lose here: the engine's audit covers exactly those)."""
    for job in jobs:
        try:
            envelope = decode_envelope(job.data)
        except PayloadError:
            return False
        if envelope.kind not in (JobKind.TASK, JobKind.RESULT):
            return False
    return True


class FaultyBroker:
    """A :class:`~durable_trio.brokers.QueueBroker` that forwards every call to ``inner``
    through an :class:`Injector`. Build one with :func:`wrap_broker`, which gives the wrapper
    exactly the optional capabilities (``Supports*``) of the broker it wraps — the transport
    detects them with ``isinstance``.

    Attributes:
        inner: the wrapped broker (shared by every process of a simulation).
        injector: this process's faults.
    """

    #: The inner broker's finalize hints, set only where it has them (the transport reads
    #: them with a default).
    coalesce_finalize: bool
    finalize_in_halves: bool

    def __init__(self, inner: QueueBroker, injector: Injector) -> None:
        self.inner: Any = inner
        self.injector = injector
        # The inner broker's hints on how the transport should batch its finalizes.
        for hint in ("coalesce_finalize", "finalize_in_halves"):
            value = getattr(inner, hint, None)
            if value is not None:
                setattr(self, hint, value)

    async def _call(self, op: str, call: Callable[[], Awaitable[T]], jobs: Sequence[Job] = ()) -> T:
        injector = self.injector
        await injector.before(op)
        result = await call()
        if injector.pushed is not None and op in _PUSHES:
            injector.pushed(_task_keys(jobs))
        if injector.lose_reply(op):
            details: dict[str, Any] = {"op": op}
            if op in _PUSHES:
                tasks = _task_keys(jobs)
                if tasks:
                    details["tasks"] = tasks
                landed = _result_keys(jobs)
                if landed:
                    # Pushed, never heard of: the retry that follows may be lost, the results
                    # are in the broker already (the engine gets them: no loss to find).
                    details["landed_results"] = landed
            results = _result_keys(_claimed_in(result))
            if results:
                # Claimed, never heard of: each such result waits out the stalled threshold,
                # and its step may be declared lost and sent again meanwhile.
                details["results"] = results
            injector.note("lost-reply", **details)
            raise BrokerUnavailable(f"injected: the reply to {op} from {injector.name} was lost")
        return result

    async def push_on(
        self, queue: str, job: Job, *, priority: int | None = None, delay: float = 0.0
    ) -> None:
        if self.injector.lose_write("push_on", (job,)):
            await self.injector.before("push_on")
            return
        await self._call(
            "push_on",
            functools.partial(self.inner.push_on, queue, job, priority=priority, delay=delay),
            (job,),
        )

    async def pop_from(self, queue: str, *, worker: str = "") -> ClaimedJob | None:
        result: ClaimedJob | None = await self._call(
            "pop_from", functools.partial(self.inner.pop_from, queue, worker=worker)
        )
        if result is None:
            return None
        return self.injector.damage("pop_from", queue, [result])[0]

    async def complete_job(self, lease: Lease, queue: str) -> bool:
        call = functools.partial(self.inner.complete_job, lease, queue)
        return bool(await self._call("complete_job", call))

    async def fail_job(self, lease: Lease, queue: str, error: str) -> bool:
        return bool(
            await self._call(
                "fail_job", functools.partial(self.inner.fail_job, lease, queue, error)
            )
        )

    async def retry_job(
        self, lease: Lease, queue: str, *, delay: float = 0.0, count_attempt: bool = True
    ) -> bool:
        call = functools.partial(
            self.inner.retry_job, lease, queue, delay=delay, count_attempt=count_attempt
        )
        return bool(await self._call("retry_job", call))

    async def aclose(self) -> None:
        # The shared broker belongs to the simulation, not to one of its processes.
        await trio.lowlevel.checkpoint()


class _BatchPop(FaultyBroker):
    async def pop_many(self, queue: str, count: int, *, worker: str = "") -> list[ClaimedJob]:
        result: list[ClaimedJob] = await self._call(
            "pop_many", functools.partial(self.inner.pop_many, queue, count, worker=worker)
        )
        return self.injector.damage("pop_many", queue, result)


class _ClaimAhead(FaultyBroker):
    async def pop_ahead(
        self, queue: str, count: int, ahead: int, *, worker: str = ""
    ) -> list[ClaimedJob]:
        call = functools.partial(self.inner.pop_ahead, queue, count, ahead, worker=worker)
        result: list[ClaimedJob] = await self._call("pop_ahead", call)
        return self.injector.damage("pop_ahead", queue, result)

    async def mark_started(self, queue: str, leases: Sequence[Lease]) -> list[bool]:
        result: list[bool] = await self._call(
            "mark_started", functools.partial(self.inner.mark_started, queue, leases)
        )
        return result


class _FailAndPush(FaultyBroker):
    async def fail_and_push(
        self, lease: Lease, queue: str, error: str, push_queue: str, job: Job
    ) -> bool:
        call = functools.partial(self.inner.fail_and_push, lease, queue, error, push_queue, job)
        return bool(await self._call("fail_and_push", call, (job,)))


class _BatchFinalize(FaultyBroker):
    async def complete_many(self, queue: str, leases: Sequence[Lease]) -> list[bool]:
        result: list[bool] = await self._call(
            "complete_many", functools.partial(self.inner.complete_many, queue, leases)
        )
        return result

    async def push_many(
        self, queue: str, jobs: Sequence[Job], priorities: Sequence[int | None]
    ) -> None:
        if self.injector.lose_write("push_many", jobs):
            await self.injector.before("push_many")
            return
        await self._call(
            "push_many", functools.partial(self.inner.push_many, queue, jobs, priorities), jobs
        )

    async def push_and_complete_many(
        self, push_queue: str, jobs: Sequence[Job], queue: str, leases: Sequence[Lease]
    ) -> list[bool]:
        if self.injector.lose_write("push_and_complete_many", jobs):
            # The completion happens; the pushed results are lost.
            lost: list[bool] = await self._call(
                "complete_many", functools.partial(self.inner.complete_many, queue, leases)
            )
            return lost
        call = functools.partial(self.inner.push_and_complete_many, push_queue, jobs, queue, leases)
        result: list[bool] = await self._call("push_and_complete_many", call, jobs)
        return result


class _FinishAndClaim(FaultyBroker):
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
        pushed: Sequence[Job] = jobs
        if self.injector.lose_write("finish_and_claim", jobs):
            pushed = ()  # the completion and the claims happen; the pushed results are lost
        call = functools.partial(
            self.inner.finish_and_claim, push_queue, pushed, queue, leases, count, worker=worker
        )
        answers, claimed = await self._call("finish_and_claim", call, pushed)
        return answers, self.injector.damage("finish_and_claim", queue, claimed)


class _Renewal(FaultyBroker):
    async def renew_jobs(self, queue: str, leases: Sequence[Lease]) -> RenewOutcome:
        result: RenewOutcome = await self._call(
            "renew_jobs", functools.partial(self.inner.renew_jobs, queue, leases)
        )
        return result


class _Recovery(FaultyBroker):
    async def recover_stalled_jobs(
        self, queue: str, threshold: float, max_stalled: int
    ) -> Recovery:
        call = functools.partial(self.inner.recover_stalled_jobs, queue, threshold, max_stalled)
        result: Recovery = await self._call("recover_stalled_jobs", call)
        return result


class _SweepHint(FaultyBroker):
    async def queues_with_claims(self, queues: Sequence[str]) -> list[str]:
        result: list[str] = await self._call(
            "queues_with_claims", functools.partial(self.inner.queues_with_claims, queues)
        )
        return result


async def _read_job(injector: Injector, op: str) -> None:
    """A job-state read: it waits out a stall and fails in a dead process, but draws no
    per-call fault (seeds that predate the engine's loss audit replay unchanged)."""
    if injector.dead:
        raise injector._gone(op)
    await injector.wait_out_stall()
    if injector.dead:
        raise injector._gone(op)


class _JobState(FaultyBroker):
    async def job_state(self, queue: str, job_id: str) -> JobState | None:
        await _read_job(self.injector, "job_state")
        result: JobState | None = await self.inner.job_state(queue, job_id)
        return result


class _JobStates(FaultyBroker):
    async def job_states(self, queue: str, job_ids: Sequence[str]) -> list[JobState | None]:
        await _read_job(self.injector, "job_states")
        result: list[JobState | None] = await self.inner.job_states(queue, job_ids)
        return result


class _Size(FaultyBroker):
    async def size_of(self, queue: str) -> int:
        return int(await self._call("size_of", functools.partial(self.inner.size_of, queue)))


class _FailedJobs(FaultyBroker):
    async def failed_jobs(self, queue: str, *, limit: int = 100) -> list[FailedJob]:
        result: list[FailedJob] = await self._call(
            "failed_jobs", functools.partial(self.inner.failed_jobs, queue, limit=limit)
        )
        return result


class _Wakeup(FaultyBroker):
    async def wait_for_work(self, queue: str) -> None:
        # A wait is not a request that can be lost: a dead or stalled process simply never
        # wakes (a killed one is cancelled right after).
        injector = self.injector
        if injector.dead:
            await trio.sleep_forever()
        await injector.wait_out_stall()
        await self.inner.wait_for_work(queue)
        await injector.wait_out_stall()


class _QueueLimits(FaultyBroker):
    async def set_queue_limit(
        self, queue: str, limit: int | None, *, per_key: bool = False
    ) -> None:
        # A worker stores its steps' limits as it opens: like a job-state read, it waits out a
        # stall and fails in a dead process, but draws no per-call fault (seeds that predate
        # fleet-wide limits replay unchanged).
        await _read_job(self.injector, "set_queue_limit")
        await self.inner.set_queue_limit(queue, limit, per_key=per_key)


class _RateLimits(FaultyBroker):
    # Like the limits: a stall is waited out and a dead process fails, but no per-call fault is
    # drawn (seeds that predate rate limits replay unchanged).
    async def set_queue_rate(
        self, queue: str, count: int | None, per: float = 1.0, *, per_key: bool = False
    ) -> None:
        await _read_job(self.injector, "set_queue_rate")
        await self.inner.set_queue_rate(queue, count, per, per_key=per_key)

    async def take_starts(self, queue: str, want: int, key: str | None = None) -> RateGrant:
        await _read_job(self.injector, "take_starts")
        grant: RateGrant = await self.inner.take_starts(queue, want, key)
        return grant

    async def return_starts(
        self, queue: str, at: float, n: int, key: str | None = None
    ) -> None:
        await _read_job(self.injector, "return_starts")
        await self.inner.return_starts(queue, at, n, key)


_CAPABILITIES: tuple[tuple[type, type[FaultyBroker]], ...] = (
    (SupportsBatchPop, _BatchPop),
    (SupportsClaimAhead, _ClaimAhead),
    (SupportsBatchFinalize, _BatchFinalize),
    (SupportsFinishAndClaim, _FinishAndClaim),
    (SupportsFailAndPush, _FailAndPush),
    (SupportsRenewal, _Renewal),
    (SupportsRecovery, _Recovery),
    (SupportsSweepHint, _SweepHint),
    (SupportsSize, _Size),
    (SupportsJobState, _JobState),
    (SupportsJobStates, _JobStates),
    (SupportsFailedJobs, _FailedJobs),
    (SupportsWakeup, _Wakeup),
    (SupportsQueueLimits, _QueueLimits),
    (SupportsRateLimits, _RateLimits),
)


@functools.cache
def _wrapper_class(mixins: tuple[type[FaultyBroker], ...]) -> type[FaultyBroker]:
    if not mixins:
        return FaultyBroker
    return cast(
        "type[FaultyBroker]", type("FaultyBroker", mixins, {"__doc__": FaultyBroker.__doc__})
    )


def wrap_broker(broker: QueueBroker, injector: Injector) -> FaultyBroker:
    """Wrap ``broker`` so every call goes through ``injector``; the wrapper has exactly the
    optional capabilities ``broker`` has."""
    mixins = tuple(mixin for protocol, mixin in _CAPABILITIES if isinstance(broker, protocol))
    return _wrapper_class(mixins)(broker, injector)


class FaultyKeyStore:
    """A :class:`~durable_trio.keys.KeyStore` that forwards to ``inner`` through an
    :class:`Injector`: writes may fail, every call waits out a stall, a killed process's calls
    raise.

    Attributes:
        failed_removals: the keys whose ``remove`` this wrapper failed (they live until their
            time-to-live runs out).
    """

    def __init__(self, inner: KeyStore, injector: Injector) -> None:
        self.inner = inner
        self.injector = injector
        self.failed_removals: list[str] = []

    async def _write(self, op: str, keys: Sequence[str]) -> None:
        injector = self.injector
        if injector.dead:
            raise injector._gone(op)
        await injector.wait_out_stall()
        if injector.dead:
            raise injector._gone(op)
        if injector.fail_key_write():
            injector.note("key-write-failure", op=op)
            if op == "remove":
                self.failed_removals.extend(keys)
            raise BrokerUnavailable(f"injected: key-store {op} from {injector.name} failed")

    async def put(self, key: str, value: bytes, ttl: float) -> None:
        await self._write("put", (key,))
        await self.inner.put(key, value, ttl)

    async def put_many(self, items: Sequence[tuple[str, bytes, float]]) -> None:
        await self._write("put_many", [key for key, _, _ in items])
        await self.inner.put_many(items)

    async def remove(self, keys: Sequence[str]) -> None:
        await self._write("remove", keys)
        await self.inner.remove(keys)

    async def entries(self, prefix: str) -> list[KeyEntry]:
        injector = self.injector
        if injector.dead:
            raise injector._gone("entries")
        await injector.wait_out_stall()
        return await self.inner.entries(prefix)

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
