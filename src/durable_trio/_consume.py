"""Consumers: registration, the poll loop (T4, T5), job workers, finalize (T10), step tasks
(the ids are sections of docs/spec.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
import trio

from ._codec import decode_envelope
from ._errors import BrokerError, DamagedJob, JobError, PayloadError
from ._slots import Slots
from ._wire import (
    JobKind,
    RemoteTask,
    StepError,
    StepResult,
    StepStatus,
)
from .adapters import (
    ClaimedJob,
    SupportsBatchPop,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .adapters import Job


from ._claims import (
    _BUFFERED,
    _Claim,
    _Loop,
    _OnJob,
    _unexpected,
)
from ._transport_base import (
    _FAIRNESS_BATCH,
    _MAX_BATCH,
    _MAX_ERROR_BACKOFF,
    ControlHandler,
    HeartbeatHandler,
    ResultHandler,
    StepHandler,
    TransportBase,
)

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
        self._start_loop(
            _Loop(
                queue,
                self._on_task_job,
                self._task_slots,
                self._options.idle_backoff_max,
                token=self.token_of(name),
            )
        )

    def on_result(self, handler: ResultHandler) -> None:
        """engine side: consume step results. The results loop never backs off (critical path).
        A handler that raises gets the result redelivered (up to ``max_job_attempts``)."""
        self._consume_kind(
            JobKind.RESULT, self._names.results, handler, self._result_slots, backoff_max=1
        )

    def on_heartbeat(self, handler: HeartbeatHandler) -> None:
        """engine side: consume step heartbeats."""
        self._consume_kind(JobKind.HEARTBEAT, self._names.heartbeats, handler, Slots(1))

    def on_control(self, handler: ControlHandler) -> None:
        """Consume control messages (T17: point-to-point, best-effort)."""
        self._consume_kind(JobKind.CONTROL, self._names.control, handler, Slots(1))

    def _consume_kind(
        self,
        kind: JobKind,
        queue: str,
        handler: Callable[[Any], Awaitable[None]],
        slots: Slots,
        *,
        backoff_max: int | None = None,
    ) -> None:
        """Hand every ``kind`` job of ``queue`` to ``handler``: the first call starts the loop,
        a later one swaps the handler for the next job."""
        self._check_open()
        first = kind not in self._kind_handlers
        self._kind_handlers[kind] = handler
        if first:
            self._start_loop(
                _Loop(
                    queue,
                    self._typed(kind, lambda: self._kind_handlers[kind]),
                    slots,
                    self._options.idle_backoff_max if backoff_max is None else backoff_max,
                )
            )

    def defer_consumers(self) -> None:
        """Park every consumer loop started from now on until :meth:`start_consumers`.
        Producers are never deferred; a process that only dispatches never looks like a worker."""
        if self._deferred is None:
            self._deferred = []

    def start_consumers(self) -> None:
        """Start every parked consumer loop (and stop deferring)."""
        parked, self._deferred = self._deferred or [], None
        for loop in parked:
            self._start_loop(loop)

    def _start_loop(self, loop: _Loop) -> None:
        if loop.inbox:
            self._loops.append(loop)
            self._inboxes.nursery.start_soon(self._poll_loop, loop, name=f"inbox {loop.queue}")
            return
        if self._deferred is not None:
            self._deferred.append(loop)
            return
        self._consumed.append(loop.queue)
        self._loops.append(loop)
        if loop.token is not None and self._liveness is not None:
            # Only a loop that really consumes makes this instance a live worker of the token:
            # a deferred (producer-only) process never looks like one.
            self._liveness.serve(loop.token)
        self._consumers.nursery.start_soon(self._poll_loop, loop, name=f"poll {loop.queue}")

    def _stop_intake(self, bound: float, *, inbox: bool = False) -> None:
        """Close: the pops in flight of the task/engine loops (or, with ``inbox``, of this
        instance's own inboxes) land by ``bound`` (absolute time); with the task/engine loops,
        so do the finalizes in flight (the job runner's own scopes)."""
        for loop in self._loops:
            if loop.pop_scope is not None and loop.inbox is inbox:
                loop.pop_scope.deadline = bound
        if not inbox:
            self._runner.bound_finalizes(bound)

    def _typed(
        self, kind: JobKind, current: Callable[[], Callable[[Any], Awaitable[None]] | None]
    ) -> _OnJob:
        """A job callback that decodes ``kind`` jobs and hands their payload to the handler
        registered now (``current()``), so re-registering swaps it for the next job."""
        max_bytes = self._options.max_payload_bytes

        async def on_job(job: ClaimedJob) -> None:
            envelope = decode_envelope(job.data, max_bytes=max_bytes)
            if envelope.kind is not kind:
                raise PayloadError(f"a {envelope.kind.value!r} job does not belong on this queue")
            handler = current()
            assert handler is not None
            await handler(envelope.payload)

        return on_job

    # ------------------------------------------------------------------ the poll loop (T4, T5)

    async def _poll_loop(self, loop: _Loop) -> None:
        broker = self._broker
        wait_for_work = self._wait_for_work
        queue = loop.queue
        slots = loop.slots
        poll_interval = self._options.poll_interval
        worker = self.instance_id
        empty = 0
        errors = 0
        streak = 0
        # Pops are shielded (one scope per loop, its shield switched on around each pop, which
        # costs far less than a scope per pop) so a close never cancels a claim half-made: a
        # job the broker handed over is always tracked, then run or handed back. Close bounds a
        # pop still in flight by setting this scope's deadline.
        pop_many = broker.pop_many if isinstance(broker, SupportsBatchPop) else None
        prefetch = self._options.prefetch
        buffer = loop.buffer
        runner = self._runner
        start_claim, begin_job = runner.start_claim, runner.begin_job
        claims = runner.claims
        with trio.CancelScope() as pop_scope:
            loop.pop_scope = pop_scope
            while True:
                await slots.acquire()
                # N free slots, one round trip: claim as many jobs as there are free slots
                # (and, with prefetch, as many again, so the next freed slots need no wait).
                extra = slots.take_free(_MAX_BATCH - 1) if pop_many is not None else 0
                take = 1 + extra
                while take and buffer:
                    claim = buffer.popleft()
                    if claim.state is _BUFFERED:  # (a lost lease took it out meanwhile)
                        start_claim(loop, claim)
                        take -= 1
                if take == 0:
                    streak += 1 + extra
                    if streak >= _FAIRNESS_BATCH:
                        streak = 0
                        await trio.lowlevel.checkpoint()
                    continue
                ahead = 0
                if pop_many is not None:
                    ahead = slots.limit if prefetch is None else prefetch
                    ahead = max(0, min(ahead, _MAX_BATCH) - len(buffer))
                try:
                    # No pop starts once close has begun (a loop first scheduled after the
                    # close started would otherwise shield a pop nobody bounds).
                    await trio.lowlevel.checkpoint_if_cancelled()
                except trio.Cancelled:
                    slots.release(take)
                    raise
                pop_scope.shield = True
                try:
                    if pop_many is not None:
                        batch = await pop_many(queue, take + ahead, worker=worker)
                    else:
                        job = await broker.pop_from(queue, worker=worker)
                        batch = [job] if job is not None else []
                except BrokerError as exc:
                    errors += 1
                    self._report(exc)
                    batch = []
                except Exception as exc:
                    # A broker's pop must turn whatever it reads into claims (damaged ones
                    # flagged, see ClaimedJob.damage), never raise on stored data; should one
                    # still raise, this loop must not end the whole transport (and crash again
                    # on the same entry at every restart): reported, retried after a backoff.
                    errors += 1
                    self._report(_unexpected(exc, f"claiming from {queue!r}"))
                    batch = []
                else:
                    # The broker answered: the outage is over, even if the queue is empty (an
                    # empty pop must not leave the loop polling on the error backoff, up to
                    # 10 s late for every job, instead of waiting for work).
                    errors = 0
                finally:
                    pop_scope.shield = False
                if batch and any(job.damage is not None and not job.lease.token for job in batch):
                    batch = self._drop_quarantined(queue, batch)
                if len(batch) < take:
                    slots.release(take - len(batch))
                if batch:
                    errors = empty = 0
                    for job in batch[:take]:
                        begin_job(loop, job)
                    for job in batch[take:]:
                        claim = _Claim(queue, job, state=_BUFFERED)
                        claims[job.lease.token] = claim
                        buffer.append(claim)
                    if len(batch) < take + ahead and not buffer and wait_for_work is not None:
                        # Fewer than asked: the pop drained the queue (and, on a broker with a
                        # wake-up signal, counts as an empty pop): wait for work instead of
                        # spending one more round trip to learn that it is empty.
                        streak = 0
                        await wait_for_work(queue)
                        continue
                    streak += len(batch)
                    if streak >= _FAIRNESS_BATCH:
                        streak = 0
                        await trio.lowlevel.checkpoint()
                    continue
                streak = 0
                if errors:
                    await trio.sleep(min(poll_interval * 2 ** min(errors, 16), _MAX_ERROR_BACKOFF))
                elif wait_for_work is not None:
                    await wait_for_work(queue)
                else:
                    empty += 1
                    await trio.sleep(poll_interval * min(2 ** (empty - 1), loop.backoff_max))

    def _drop_quarantined(self, queue: str, batch: list[ClaimedJob]) -> list[ClaimedJob]:
        """Report the entries the broker could not tie to a job (already in its quarantine,
        no lease to finalize) and keep the real claims."""
        kept = []
        for job in batch:
            if job.damage is not None and not job.lease.token:
                self._report(
                    DamagedJob(
                        f"unreadable entry moved to the quarantine: {job.damage}",
                        queue=queue,
                        job_id=job.id,
                    )
                )
            else:
                kept.append(job)
        return kept

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
            await self._serve_workflow_turn(envelope.payload)
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
            data = self._new_job(JobKind.RESULT, result)
        except PayloadError as exc:
            self._report(
                JobError(
                    f"step {task.name!r} returned an output that cannot be sent: {exc}",
                    queue=self.task_queue(task.routing_group),
                    job_id=task.task_id,
                )
            )
            error = StepError(message=str(exc), code="bad_output", retryable=False)
            data = self._new_job(JobKind.RESULT, StepResult.failure(task, error))
        if self._finishers_on:
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
                await self._push_job(self._names.results, job)
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

