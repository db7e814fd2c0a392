"""Serving step tasks: the jobs of a task loop, steps and workflow turns told apart by kind
(T14), each step's result made and pushed (the ids are sections of docs/spec.md)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
import trio

from .._backoff import Backoff
from .._codec import decode_envelope
from .._errors import BrokerError, JobError, PayloadError
from .._logs import get_logger
from .._telemetry import StepAttempt, hop
from .._wire import (
    JobKind,
    JSONValue,
    RemoteTask,
    StepError,
    StepHeartbeat,
    StepResult,
    StepStatus,
)
from ._handler_timeout import run_within_timeout
from ._step_beats import CURRENT_BEATS, StepBeats, beat_interval

if TYPE_CHECKING:
    from ..brokers import ClaimedJob, Job
    from ._adaptive import ConcurrencyController
    from ._options import TransportOptions
    from ._producers import Producers

_log = get_logger("durable_trio")

_TASK = JobKind.TASK
_WORKFLOW = JobKind.WORKFLOW
#: Routing groups whose task queue a step server remembers (see ``StepServer._queue_of``).
_QUEUES_KEPT = 1024

#: First and largest delay between two attempts at pushing a step's result.
_RESULT_PUSH_BACKOFF = Backoff(initial=0.05, maximum=5.0)


StepHandler = Callable[[RemoteTask], Awaitable[JSONValue]]
#: ``async def gate(task) -> float | None``: ``None``, the step may start now; else the seconds
#: after which its job is handed back (a per-key rate past its rate, see the facade's ``handle``).
StartGate = Callable[[RemoteTask], Awaitable[float | None]]


class StartDeferred(Exception):
    """A task its gate did not let start: the job is handed back after ``delay`` seconds,
    attempt-neutral (neither an attempt nor a stall); its handler never ran."""

    def __init__(self, delay: float) -> None:
        super().__init__(f"start deferred {delay:.3f} s")
        self.delay = delay


class StepServer:
    """Runs the jobs of the task loops: a step's handler (its result made and pushed), or a
    workflow turn (through the remote layer's ``turns``). Owns the step handlers."""

    def __init__(
        self,
        producers: Producers,
        controller: ConcurrencyController,
        options: TransportOptions,
        *,
        results: str,
        task_queue: Callable[[str], str],
        publish_result: Callable[[StepResult], Awaitable[str]],
        report: Callable[[BaseException], None],
        instance_id: str = "",
        lost_at: Callable[[str], float | None] = lambda token: None,
        publish_beat: Callable[[StepHeartbeat], Awaitable[None]] | None = None,
        spawn: Callable[[Callable[[], Awaitable[None]]], None] | None = None,
    ) -> None:
        self._instance_id = instance_id
        self._lost_at = lost_at
        self._producers = producers
        self._controller = controller
        self._max_payload_bytes = options.max_payload_bytes
        self._results = results
        self._task_queue = task_queue
        self._publish_result = publish_result
        self._report = report
        self._beat_interval = options.step_heartbeat_interval
        self._send_beat = publish_beat or _no_beats
        self._spawn_sender = spawn or _no_spawn
        self._queues: dict[str, str] = {}
        """The task queue of each routing group met (``_queue_of``)."""
        self.handlers: dict[str, StepHandler] = {}
        self.gates: dict[str, StartGate] = {}
        """Per step: asked before its handler, whether it may start now (see
        :class:`StartDeferred`)."""
        self._now: Callable[[], float] | None = None
        self.turns: Callable[[Any], Awaitable[None]] | None = None
        """Serves the workflow turns found on a task loop (set by the remote layer, T14)."""

    async def on_task_job(self, job: ClaimedJob) -> Job | None:
        try:
            envelope = decode_envelope(job.data, max_bytes=self._max_payload_bytes)
            kind = envelope.kind
            if kind is not _TASK and kind is not _WORKFLOW:
                # (T14: a workflow turn shares its token's task loop; told apart by shape)
                raise PayloadError(f"a {kind.value!r} job does not belong on a task queue")
        except PayloadError as exc:
            await self.answer_bad_task(
                job, StepError(message=f"bad task: {exc}", code="bad_input", retryable=False)
            )
            raise
        if kind is _WORKFLOW:
            assert self.turns is not None  # a workflow job reaches a loop its turns started
            hop(envelope, None)
            await self.turns(envelope.payload)
            return None
        task: RemoteTask = envelope.payload
        group = task.routing_group
        queue = self._queues.get(group)
        if queue is None:
            queue = self._queue_of(group)
        gate = self.gates.get(task.name)
        if gate is not None and (delay := await gate(task)) is not None:
            raise StartDeferred(delay)  # (before the attempt began: nothing ran, nothing told)
        if envelope.trace is not None:  # (a hop's span is only ever a traced job's)
            hop(envelope, queue)
        now_of = self._now
        if now_of is None:  # (the run's clock, bound at the first step: one call a read)
            now_of = self._now = trio.lowlevel.current_clock().current_time
        started = now_of()
        with StepAttempt(task, queue, self._instance_id, envelope.trace, started) as attempt:
            # Run the step and make its result (``attempt`` told how it ended): inline, not a
            # coroutine of its own, on the path of every step.
            handler = self.handlers.get(task.name)
            result: StepResult | None = None
            output: JSONValue = None
            delivery: dict[str, Any] | None = None
            if handler is None:
                result = self._no_handler(task, job, attempt)
            else:
                controller = self._controller
                controller.on_start()
                ok = False
                now: float | None = None
                interval = self._beat_interval  # (the beats of this claim, made inline)
                if task.heartbeat_timeout is not None:
                    interval = beat_interval(task, interval)
                beats = StepBeats(task, self._send_beat, self._spawn_sender, interval,
                                  self._report, self._instance_id)  # fmt: skip
                token = CURRENT_BEATS.set(beats)
                try:
                    output = await (
                        handler(task) if task.timeout is None else run_within_timeout(handler, task)
                    )
                    ok = True
                except Exception as exc:
                    result = self._failed(task, job, attempt, exc)
                else:
                    now = now_of()
                    attempt.end("completed", now=now)
                    delivery = self._delivery(job)  # (the result is made here, its job below)
                finally:
                    beats.close()
                    CURRENT_BEATS.reset(token)
                    # Only step durations feed the latency gradient (T6); a cancelled step too
                    # leaves the in-flight count.
                    controller.on_settle(
                        started, now_of() if now is None else now, step=ok
                    )
            data = self._result_job(task, job, result, output, delivery)
            if self._producers.batched:
                return data  # the job worker pushes it with the task's acknowledgement
            await self._push_result(task, data)
            return None

    def _queue_of(self, group: str) -> str:
        """The task queue of a routing group (remembered: named once per group, not per job;
        forgotten all at once past a bound, so odd groups cannot make it grow for ever)."""
        queues = self._queues
        if len(queues) >= _QUEUES_KEPT:
            queues.clear()
        queue = queues[group] = self._task_queue(group)
        return queue

    async def answer_bad_task(self, job: ClaimedJob, error: StepError) -> None:
        """A task that does not parse but names its run and step still gets a failed result, so
        the run settles instead of waiting forever. Nothing is published when it cannot be told
        which step it was, nor for a job of another kind found on a task queue (a result or a
        decision sent to the wrong queue is set aside; it is not a failure of the run's step)."""
        try:
            raw = orjson.loads(job.data)
            if raw.get("kind", "task") != "task":
                return
            payload = raw["payload"]
            run_id, step_id, attempt = payload["runId"], payload["stepId"], payload["attempt"]
        except Exception:
            return
        if type(run_id) is not str or type(step_id) is not str or type(attempt) is not int:
            return
        result = StepResult(run_id, step_id, attempt, StepStatus.FAILED, error=error)
        await self._publish_result(result)

    def _delivery(self, job: ClaimedJob) -> dict[str, Any]:
        """The evidence a result carries of the claim that produced it (``StepResult.delivery``):
        read when the result is made, so a lease lost while the handler ran shows."""
        token = job.lease.token
        delivery: dict[str, Any] = {
            "worker": self._instance_id,
            "job": job.id,
            "lease": token,
            "stalledCount": job.stalled_count,
        }
        if job.stalls:
            delivery["stalls"] = [
                {"at": s.at, "worker": s.worker, "counted": s.counted} for s in job.stalls
            ]
        lost_at = self._lost_at(token)
        if lost_at is not None:
            delivery["leaseLostAt"] = lost_at
        return delivery

    def _no_handler(self, task: RemoteTask, job: ClaimedJob, attempt: StepAttempt) -> StepResult:
        """The failed result of a task this worker has no handler for (reported)."""
        message = f"no handler for step {task.name!r} on this worker"
        self._report(
            JobError(message, queue=self._task_queue(task.routing_group), job_id=task.task_id)
        )
        error = StepError(message=message, code="no_handler", retryable=False)
        result = StepResult.failure(task, error, self._delivery(job))
        attempt.end("failed", message)
        return result

    def _failed(
        self, task: RemoteTask, job: ClaimedJob, attempt: StepAttempt, exc: Exception
    ) -> StepResult:
        """The failed result of a step whose handler raised ``exc`` (logged or reported)."""
        retryable = getattr(exc, "retryable", True) is not False
        if getattr(exc, "quiet", False) is True:  # stopped as asked (its run cancelled)
            _log.info("step %r (job %s) stopped: %s", task.name, task.task_id, exc)
        elif (
            retryable
            and task.attempt < (task.max_attempts or 0)
            and not getattr(exc, "always_reported", False)  # a step that blocked the loop
        ):
            # An expected retry (a flaky call, a timeout): one line, no alarm; the
            # traceback at DEBUG, and at ERROR with the last attempt (docs/engine.md).
            _log.warning(
                "step %r attempt %d of %d (run %s) raised %r: the engine retries it",
                task.name, task.attempt, task.max_attempts, task.run_id, exc,
            )  # fmt: skip
            _log.debug("step %r attempt %d raised", task.name, task.attempt, exc_info=exc)
        else:
            self._report(
                JobError(
                    f"step {task.name!r} raised {exc!r}",
                    queue=self._task_queue(task.routing_group),
                    job_id=task.task_id,
                ).with_traceback(exc.__traceback__)
            )
        error = StepError(
            message=f"{type(exc).__name__}: {exc}",
            code=getattr(exc, "code", None)
            if isinstance(getattr(exc, "code", None), str)
            else None,
            retryable=retryable,
        )
        result = StepResult.failure(task, error, self._delivery(job))
        attempt.end("failed", error.message)
        return result

    def _result_job(
        self,
        task: RemoteTask,
        job: ClaimedJob,
        result: StepResult | None,
        output: JSONValue,
        delivery: dict[str, Any] | None,
    ) -> Job:
        """The job of a step's result: ``result``, or the completed one of ``output`` and
        ``delivery``; a failed one (reported) if the output cannot be sent."""
        try:
            if delivery is not None:
                data = self._producers.result_job(task, output, delivery)
            else:
                assert result is not None
                data = self._producers.new_job(JobKind.RESULT, result)
        except PayloadError as exc:
            self._report(
                JobError(
                    f"step {task.name!r} returned an output that cannot be sent: {exc}",
                    queue=self._task_queue(task.routing_group),
                    job_id=task.task_id,
                )
            )
            error = StepError(message=str(exc), code="bad_output", retryable=False)
            failure = StepResult.failure(task, error, self._delivery(job))
            data = self._producers.new_job(JobKind.RESULT, failure)
        return data

    async def _push_result(self, task: RemoteTask, job: Job) -> None:
        """Push a step's result, again and again with a backoff while the broker fails: the
        step has run, and raising would hand its task back to run again — and, after
        ``max_job_attempts`` handbacks, fail it for good with no answer for its run. The claim
        stays renewed meanwhile; a lost lease (T8) or a close past its deadline cancels the
        wait."""
        failures = 0
        while True:
            try:
                await self._producers.push_job(self._results, job)
                return
            except BrokerError as exc:
                failures += 1
                delay = _RESULT_PUSH_BACKOFF.delay(failures)
                self._report(
                    JobError(
                        f"publishing the result of step {task.name!r} failed (retrying in "
                        f"{delay:.2f} s): {exc}",
                        queue=self._task_queue(task.routing_group),
                        job_id=task.task_id,
                    )
                )
            await trio.sleep(delay)


async def _no_beats(beat: StepHeartbeat) -> None:
    await trio.lowlevel.checkpoint()


def _no_spawn(sender: Callable[[], Awaitable[None]]) -> None:
    """A step server with nowhere to run senders drops its beats."""
