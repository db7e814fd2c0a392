"""The reclaim sweep and the poison bridge with its evidence (T9, docs/spec.md)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

import trio

from .._codec import decode_envelope
from .._errors import BrokerError, DamagedJob, JobError, PayloadError, TransportClosed
from .._periodic import fixed_rate
from .._wire import (
    JobKind,
    RemoteTask,
    StepError,
    StepResult,
    StepStatus,
)
from ..brokers import (
    ClaimedJob,
    SupportsFailAndPush,
    SupportsRecovery,
    SupportsSweepHint,
)
from ._claims import unexpected
from ._dead_workers import dead_sweep_interval
from ._liveness import read_last_status

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .._naming import QueueNames
    from ..brokers import Job
    from ._dead_workers import DeadWorkers
    from ._options import TransportOptions
    from ._ports import TransportBackend

__all__ = ["Sweeper"]

#: With a sweep hint, every this-many-th sweep still looks at every queue (a lost hint then
#: costs at most this many intervals, never a job).
_FULL_SWEEP_EVERY = 20


class Sweeper:
    """Recovers stalled jobs every ``stalled_check_interval`` (T9) and fails poison step tasks
    with their evidence. Part of intake: close stops it with the consumers."""

    def __init__(
        self,
        backend: TransportBackend,
        names: QueueNames,
        options: TransportOptions,
        *,
        stalled_threshold: float,
        consumed: list[str],
        inboxes: list[str],
        task_queues: set[str],
        publish_result: Callable[[StepResult], Awaitable[str]],
        result_job: Callable[[StepResult], Job],
        answer_bad_task: Callable[[ClaimedJob, StepError], Awaitable[None]],
        report: Callable[[BaseException], None],
        dead_workers: DeadWorkers | None = None,
    ) -> None:
        self._backend = backend
        self._dead_workers = dead_workers
        self._broker = backend.broker
        self._names = names
        self._options = options
        self.stalled_threshold = stalled_threshold
        self._consumed = consumed
        self._inboxes = inboxes
        self._task_queues = task_queues
        self.publish_result = publish_result
        self._result_job = result_job
        self._fail_and_push = (
            self._broker if isinstance(self._broker, SupportsFailAndPush) else None
        )
        self._answer_bad_task = answer_bad_task
        self._report = report
        self._unanswered: list[StepResult] = []
        """Failed results of poison tasks already failed whose publish failed: published
        again at every later sweep until one lands."""

    # ------------------------------------------------------------------ reclaim sweep (T9)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Sweep on ``start + k * stalled_check_interval``; with a dead-worker pass, that pass
        on its own timer beside it (``_dead_workers``)."""
        async with trio.open_nursery() as nursery:
            if self._dead_workers is not None:
                nursery.start_soon(self._sweep_dead, self._dead_workers)
            nursery.start_soon(self._sweep_stalled)
            task_status.started()

    async def _sweep_dead(self, dead: DeadWorkers) -> None:
        """Issue 30, item 9: while a worker of the namespace is known dead, take back the claims
        older than the dead threshold on the task queues this instance serves (see
        ``_dead_workers``: a live worker renews far more often than that)."""
        hint = self._broker if isinstance(self._broker, SupportsSweepHint) else None
        prefix = self._names.tasks("")
        interval = dead_sweep_interval(dead.dead_threshold)
        quiet_until = -math.inf
        async for _ in fixed_rate(interval):
            queues = [q for q in self._consumed if q in self._task_queues]
            try:
                if hint is not None and queues:
                    if trio.current_time() < quiet_until:
                        continue
                    asked = trio.current_time()
                    queues = await hint.queues_with_claims(queues)
                    if not queues:
                        # No claim on them now: none can be older than the dead threshold
                        # before `asked + dead_threshold` (a claim's age is since its worker
                        # took or last renewed it), so the ticks before then have nothing to
                        # take back. An idle worker asks once per threshold, not per tick; a
                        # claim taken meanwhile is still taken back at the same tick as before.
                        quiet_until = asked + dead.dead_threshold - interval
                if not queues:
                    continue
                tokens = await dead.sweepable(q[len(prefix) :] for q in queues)
            except BrokerError as exc:
                self._report(exc)
                continue
            except Exception as exc:  # a key store defect: never fatal
                self._report(unexpected(exc, "reading the dead workers"))
                continue
            for queue in queues:
                if queue[len(prefix) :] in tokens:
                    await self._sweep(queue, dead.dead_threshold)

    async def _sweep_stalled(self) -> None:
        interval = self._options.stalled_check_interval
        hint = self._broker if isinstance(self._broker, SupportsSweepHint) else None
        async for tick in fixed_rate(interval):
            # Every queue this instance consumes, its own inboxes too: a job on any of them
            # can stall, and past the limit is set aside, never redelivered forever.
            queues = [*self._consumed, *self._inboxes]
            if hint is not None and tick % _FULL_SWEEP_EVERY:
                # Skip the queues that hold no claim (one cheap call for all of them): an idle
                # worker must cost next to nothing. Every _FULL_SWEEP_EVERY-th tick sweeps all.
                try:
                    queues = await hint.queues_with_claims(queues)
                except BrokerError as exc:
                    self._report(exc)
                except Exception as exc:
                    self._report(unexpected(exc, "reading the sweep hint"))
            if self._unanswered:
                await self._publish_unanswered()
            for queue in queues:
                await self._sweep(queue)

    async def _publish_unanswered(self) -> None:
        pending, self._unanswered = self._unanswered, []
        for result in pending:
            if not await self._publish_failed(result):
                self._unanswered.append(result)

    async def _publish_failed(self, result: StepResult) -> bool:
        try:
            await self.publish_result(result)
        except (BrokerError, TransportClosed) as exc:
            self._report(
                _publish_error(
                    f"the failed result of poison step {result.step_id!r} (run "
                    f"{result.run_id!r}) was not published, tried again at the next sweep: "
                    f"{exc}",
                    exc,
                )
            )
            return False
        return True

    async def _sweep(self, queue: str, threshold: float | None = None) -> None:
        broker = cast("SupportsRecovery", self._broker)  # (checked once: _can_recover)
        # One limit on every queue: a job that stalled max_stalled_count times while its
        # handler ran (a claim popped ahead and never started does not count, see
        # SupportsClaimAhead) is set aside — failed, kept in the broker's failed set — never
        # redelivered forever, whether a step task, a result, a decision or a control message.
        try:
            recovery = await broker.recover_stalled_jobs(
                queue,
                self.stalled_threshold if threshold is None else threshold,
                self._options.max_stalled_count,
            )
        except BrokerError as exc:
            self._report(exc)
            return
        except Exception as exc:  # a stalled claim the broker could not read: never fatal
            self._report(unexpected(exc, f"sweeping {queue!r}"))
            return
        for job in recovery.exceeded:
            if job.damage is not None:
                await self._set_aside_damaged(queue, job)
            else:
                await self._fail_poison(queue, job)

    async def _set_aside_damaged(self, queue: str, job: ClaimedJob) -> None:
        """A stalled claim whose stored fields are damaged: failed with the reason (the raw
        bytes stay in the failed set), never redelivered, never parsed; an entry the broker
        already quarantined (no lease) is only reported."""
        self._report(
            DamagedJob(f"stalled claim unreadable, set aside: {job.damage}", queue=queue,
                       job_id=job.id)
        )
        if not job.lease.token:
            return
        if queue in self._task_queues:
            # Its bytes may still name its step: a retryable answer, so the run goes on (the
            # job runner's answer to a damaged claim, the same one).
            error = StepError(message=f"damaged job: {job.damage}", code="damaged", retryable=True)
            try:
                await self._answer_bad_task(job, error)
            except (BrokerError, TransportClosed) as exc:
                self._report(exc)
                return  # still claimed by this sweep: the next one tries again
        try:
            await self._broker.fail_job(job.lease, queue, f"damaged: {job.damage}")
        except BrokerError as exc:
            self._report(exc)

    async def _fail_poison(self, queue: str, job: ClaimedJob) -> None:
        """Set aside a job that stalled more than ``max_stalled_count`` times while its
        handler ran: fail it (kept in the broker's failed set with its stall history), then,
        for a step task only, publish a RETRYABLE failed result so its run does not wait
        forever (never for an unparseable or workflow payload).

        The fail goes first and the result only if it succeeded (so a job is answered as
        failed only once it is failed, never while another worker may still run it): if the
        fail fails (a broker error), the job stays claimed by this sweep and the next sweep
        (after ``stalled_threshold``) tries again; if it answers "lease lost", the job went
        elsewhere and nothing is published. A result that cannot be published after the fail
        is reported and published again at every later sweep of this instance until it lands
        (should this instance die first, the step waits for the engine's own timeouts). On a
        broker that can (``SupportsFailAndPush``: memory, SQLite, Redis) the fail and the
        publish are one atomic call, and that window is closed: both or neither."""
        reason = f"stalled more than {self._options.max_stalled_count} times"
        result = await self._poison_result(queue, job, reason)
        together = self._fail_and_push is not None and result is not None
        try:
            if together:
                assert self._fail_and_push is not None
                assert result is not None
                failed = await self._fail_and_push.fail_and_push(
                    job.lease, queue, reason, self._names.results, self._result_job(result)
                )
            else:
                failed = await self._broker.fail_job(job.lease, queue, reason)
        except BrokerError as exc:
            self._report(exc)
            return
        if not failed:
            return
        kind = "poison job failed" if result is not None else "poison job set aside (failed)"
        self._report(JobError(f"{kind}: {reason}", queue=queue, job_id=job.id))
        if result is not None and not together and not await self._publish_failed(result):
            self._unanswered.append(result)

    async def _poison_result(self, queue: str, job: ClaimedJob, reason: str) -> StepResult | None:
        """The failed result a poison job answers its run with: for a step task, and for a
        step result whose handling by the engines stalled past the limit (set aside, it would
        otherwise leave its step waiting forever: the retryable failure makes the engine try
        the step again, or ends it as failed, inspectable, when its retries are spent).
        ``None``: neither (or unreadable)."""
        is_results = queue == self._names.results
        if queue not in self._task_queues and not is_results:
            return None
        try:
            envelope = decode_envelope(job.data, max_bytes=self._options.max_payload_bytes)
        except PayloadError:
            return None
        if is_results:
            if envelope.kind is not JobKind.RESULT:
                return None
            held: StepResult = envelope.payload
            message = (
                f"its result was set aside: the engines' handling of it {reason} "
                "(the step is tried again)"
            )
            error = StepError(
                message=message,
                code="result_set_aside",
                retryable=True,
                details={"stalls": _stalls(job), "stalledCount": job.stalled_count},
            )
            return StepResult(
                held.run_id, held.step_id, held.attempt, StepStatus.FAILED, error=error
            )
        if envelope.kind is not JobKind.TASK:
            return None
        task: RemoteTask = envelope.payload
        evidence: dict[str, Any] = {
            # Every stall, and whether it counted (its handler had started) or not (a claim
            # popped ahead and never started, taken back uncounted).
            "stalls": _stalls(job),
            "stalledCount": job.stalled_count,
        }
        keys = self._backend.keys
        if keys is not None:
            # The last liveness snapshot of every worker that held it (RSS, CPU, in-flight):
            # an out-of-memory loop shows as growing RSS on each of them.
            workers: dict[str, Any] = {}
            for worker in dict.fromkeys(s.worker for s in job.stalls if s.worker):
                try:
                    workers[worker] = await read_last_status(keys, self._names, worker)
                except BrokerError as exc:
                    self._report(exc)
            evidence["workers"] = workers
        error = StepError(message=reason, code="stalled", retryable=True, details=evidence)
        return StepResult.failure(task, error)


def _stalls(job: ClaimedJob) -> list[dict[str, Any]]:
    return [{"at": s.at, "worker": s.worker, "counted": s.counted} for s in job.stalls]


def _publish_error(message: str, cause: BaseException) -> BrokerError:
    error = BrokerError(message)
    error.__cause__ = cause
    return error
