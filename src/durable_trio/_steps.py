"""Serving step tasks (the task loops shared with workflow turns, T14; results T10) and the
engine's result, heartbeat and control loops (the ids are sections of docs/spec.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
import trio

from ._claims import _Loop
from ._codec import decode_envelope
from ._errors import BrokerError, JobError, PayloadError
from ._slots import Slots
from ._transport_base import (
    ControlHandler,
    HeartbeatHandler,
    ResultHandler,
    StepHandler,
    TransportBase,
)
from ._wire import (
    JobKind,
    RemoteTask,
    StepError,
    StepResult,
    StepStatus,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .adapters import ClaimedJob, Job

#: First and largest delay between two attempts at pushing a step's result.
_RESULT_PUSH_BACKOFF = (0.05, 5.0)


class ConsumeMixin(TransportBase):
    # ------------------------------------------------------------------ consumers

    def handle(self, name: str, handler: StepHandler) -> None:
        """Serve step ``name``: ``async def handler(task: RemoteTask) -> JSON value``.

        Starts (once per routing token) the task loop of ``name``'s queue. Re-registering a
        name swaps its handler. A handler that raises yields a failed :class:`StepResult`
        (retryable unless the exception has ``retryable = False``).
        """
        self._check_open()
        self._handlers[name] = handler
        self._ensure_task_loop(name)

    def _ensure_task_loop(self, name: str) -> None:
        """Start (once per routing token) the task loop shared by steps and workflow turns."""
        queue = self.task_queue(name)
        if queue in self._task_loops:
            return
        self._task_loops.add(queue)
        self._task_queues.add(queue)
        self._consumers.start_loop(
            _Loop(
                queue,
                self._on_task_job,
                self._task_slots,
                self._options.idle_backoff_max,
                token=self.token_of(name),
            )
        )

    def _serve_turns(self, name: str, serve: Callable[[Any], Awaitable[None]]) -> None:
        """Serve the workflow turns on the task loop of ``name``'s routing token (T14: a turn
        shares its token's task loop, told apart from a step by its kind)."""
        self._turns = serve
        self._ensure_task_loop(name)

    # ------------------------------------------------------------------ the generic surface

    def consume(
        self,
        kind: JobKind,
        queue: str,
        handler: Callable[[Any], Awaitable[None]],
        *,
        concurrency: int = 1,
        backoff_max: int | None = None,
        inbox: bool = False,
    ) -> None:
        """Hand the payload of every ``kind`` job of ``queue`` to ``handler``, up to
        ``concurrency`` at once. The first call for a kind starts its loop; a later one swaps
        the handler for the next job. A handler that raises gets the job redelivered (up to
        ``max_job_attempts``; bad input is failed at once).

        Args:
            kind: the one kind of job the queue carries (another is bad input).
            queue: from :attr:`names`.
            handler: ``async def handler(payload) -> None``.
            concurrency: most handlers running at once.
            backoff_max: largest idle backoff, in poll intervals (default ``idle_backoff_max``).
            inbox: a queue only this instance reads (its own inbox): never deferred, stopped
                after the handlers at close, then drained.

        Raises:
            TransportClosed: the transport is closing.
        """
        self._consumers.consume(
            kind, queue, handler, Slots(concurrency), backoff_max=backoff_max, inbox=inbox
        )

    def consume_jobs(self, queue: str, on_job: Callable[[ClaimedJob], Awaitable[None]]) -> None:
        """Hand every job of ``queue``, undecoded, to ``on_job`` (a queue of several kinds),
        one at a time. Same redelivery as :meth:`consume`.

        Raises:
            TransportClosed: the transport is closing.
        """
        self._check_open()
        self._consumers.start_loop(
            _Loop(queue, on_job, Slots(1), self._options.idle_backoff_max)
        )

    async def publish(
        self, kind: JobKind, queue: str, payload: Any, *, priority: int | None = None
    ) -> str:
        """Push ``payload`` as a ``kind`` job onto ``queue`` (never deferred; works on through
        the close drain).

        Returns:
            The job id.

        Raises:
            PayloadTooLarge: the encoded job is over ``max_payload_bytes``.
            PayloadError: ``payload`` does not encode.
            BrokerError: the broker did not take it.
            TransportClosed: the transport is closed.
        """
        return await self._producers.push(queue, kind, payload, priority=priority)

    def on_result(self, handler: ResultHandler) -> None:
        """engine side: consume step results. The results loop never backs off (critical path).
        A handler that raises gets the result redelivered (up to ``max_job_attempts``)."""
        self._consumers.consume(
            JobKind.RESULT, self._names.results, handler, self._result_slots, backoff_max=1
        )

    def on_heartbeat(self, handler: HeartbeatHandler) -> None:
        """engine side: consume step heartbeats."""
        self._consumers.consume(JobKind.HEARTBEAT, self._names.heartbeats, handler, Slots(1))

    def on_control(self, handler: ControlHandler) -> None:
        """Consume control messages (T17: point-to-point, best-effort)."""
        self._consumers.consume(JobKind.CONTROL, self._names.control, handler, Slots(1))

    def defer_consumers(self) -> None:
        """Park every consumer loop started from now on until :meth:`start_consumers`.
        Producers are never deferred; a process that only dispatches never looks like a worker."""
        self._consumers.defer()

    def start_consumers(self) -> None:
        """Start every parked consumer loop (and stop deferring)."""
        self._consumers.start_deferred()

    # ------------------------------------------------------------------ step tasks

    async def _on_task_job(self, job: ClaimedJob) -> Job | None:
        try:
            envelope = decode_envelope(job.data, max_bytes=self._options.max_payload_bytes)
            if envelope.kind is JobKind.WORKFLOW:
                # T14: a workflow turn shares its token's task loop; told apart by shape
                pass
            elif envelope.kind is not JobKind.TASK:
                raise PayloadError(f"a {envelope.kind.value!r} job does not belong on a task queue")
        except PayloadError as exc:
            await self._answer_bad_task(
                job, StepError(message=f"bad task: {exc}", code="bad_input", retryable=False)
            )
            raise
        if envelope.kind is JobKind.WORKFLOW:
            assert self._turns is not None  # a workflow job reaches a loop its turns started
            await self._turns(envelope.payload)
            return None
        return await self._serve_task(envelope.payload)

    async def _answer_bad_task(self, job: ClaimedJob, error: StepError) -> None:
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
        await self.publish_result(result)

    async def _serve_task(self, task: RemoteTask) -> Job | None:
        """Run a step and make its result. Returns the result job when the job worker pushes
        it together with the task's acknowledgement (one round trip on Redis); else pushes it
        now and returns ``None``."""
        handler = self._handlers.get(task.name)
        result: StepResult
        if handler is None:
            message = f"no handler for step {task.name!r} on this worker"
            self._report(
                JobError(message, queue=self.task_queue(task.routing_group), job_id=task.task_id)
            )
            error = StepError(message=message, code="no_handler", retryable=False)
            result = StepResult.failure(task, error)
        else:
            controller = self._controller
            controller.on_start()
            started = trio.current_time()
            ok = False
            try:
                output = await handler(task)
                ok = True
            except Exception as exc:
                self._report(
                    JobError(
                        f"step {task.name!r} raised {exc!r}",
                        queue=self.task_queue(task.routing_group),
                        job_id=task.task_id,
                    ).with_traceback(exc.__traceback__)
                )
                error = StepError(
                    message=f"{type(exc).__name__}: {exc}",
                    code=getattr(exc, "code", None)
                    if isinstance(getattr(exc, "code", None), str)
                    else None,
                    retryable=getattr(exc, "retryable", True) is not False,
                )
                result = StepResult.failure(task, error)
            else:
                result = StepResult(
                    task.run_id,
                    task.step_id,
                    task.attempt,
                    StepStatus.COMPLETED,
                    output=output,
                    task_id=task.task_id,
                )
            finally:
                # Only step durations feed the latency gradient (T6); a cancelled step too
                # leaves the in-flight count.
                controller.on_settle(started, trio.current_time(), step=ok)
        try:
            data = self._producers.new_job(JobKind.RESULT, result)
        except PayloadError as exc:
            self._report(
                JobError(
                    f"step {task.name!r} returned an output that cannot be sent: {exc}",
                    queue=self.task_queue(task.routing_group),
                    job_id=task.task_id,
                )
            )
            error = StepError(message=str(exc), code="bad_output", retryable=False)
            data = self._producers.new_job(JobKind.RESULT, StepResult.failure(task, error))
        if self._producers.batched:
            return data  # the job worker pushes it with the task's acknowledgement
        await self._push_result(task, data)
        return None

    async def _push_result(self, task: RemoteTask, job: Job) -> None:
        """Push a step's result, again and again with a backoff while the broker fails: the
        step has run, and raising would hand its task back to run again — and, after
        ``max_job_attempts`` handbacks, fail it for good with no answer for its run. The claim
        stays renewed meanwhile; a lost lease (T8) or a close past its deadline cancels the
        wait."""
        delay, largest = _RESULT_PUSH_BACKOFF
        while True:
            try:
                await self._producers.push_job(self._names.results, job)
                return
            except BrokerError as exc:
                self._report(
                    JobError(
                        f"publishing the result of step {task.name!r} failed (retrying in "
                        f"{delay:.2f} s): {exc}",
                        queue=self.task_queue(task.routing_group),
                        job_id=task.task_id,
                    )
                )
            await trio.sleep(delay)
            delay = min(delay * 2, largest)

