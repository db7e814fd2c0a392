"""The queue transport: one nursery tree that carries tasks, results and control over a broker.

::

    transport (root nursery, lives as long as the ``async with``)
    ├── consumers      every poll loop (task queues, results, heartbeats, control)
    ├── inboxes        this instance's own reply / tenant-event inbox loops
    ├── jobs           one task per running handler, each in its own cancel scope
    ├── lease keeper   claim renewal every threshold/2
    └── reclaim sweep  recover stalled jobs every stalled_check_interval; poison-job bridge

Leaving the ``async with`` (or ``await transport.aclose()``) runs the bounded close of T24.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import orjson
import outcome
import trio

from ._adaptive import ConcurrencyController
from ._codec import decode_envelope, encode_envelope
from ._errors import BrokerError, ConfigError, JobError, LeaseLost, PayloadError, TransportClosed
from ._liveness import (
    GroupHealth,
    Liveness,
    WorkerDescriptor,
    read_group_health,
    read_last_status,
)
from ._naming import QueueNames, sanitize_token, tenant_group
from ._options import (
    DEFAULT_RENEWING_STALLED_THRESHOLD,
    DEFAULT_STALLED_THRESHOLD,
    TransportOptions,
)
from ._slots import Slots
from ._wire import (
    ControlMessage,
    JobKind,
    JSONValue,
    RemoteTask,
    StepError,
    StepHeartbeat,
    StepResult,
    StepStatus,
    WorkerStatus,
)
from .adapters import (
    ClaimedJob,
    Job,
    Lease,
    SupportsBatchPop,
    SupportsRecovery,
    SupportsRenewal,
    SupportsSize,
    SupportsWakeup,
)

if TYPE_CHECKING:
    from ._backend import Backend
    from .keys import KeyEntry

__all__ = ["QueueTransport", "TransportStatistics", "open_queue_transport"]

StepHandler = Callable[[RemoteTask], Awaitable[JSONValue]]
ResultHandler = Callable[[StepResult], Awaitable[None]]
HeartbeatHandler = Callable[[StepHeartbeat], Awaitable[None]]
ControlHandler = Callable[[ControlMessage], Awaitable[None]]
_OnJob = Callable[[ClaimedJob], Awaitable[None]]

#: A loop that polls this many jobs in a row without waiting yields once, so a loop with a large
#: limit over a broker that answers at once never starves the handlers it starts.
_FAIRNESS_BATCH = 64
#: Most jobs one pop claims (a loop with more free slots than this pops again at once).
_MAX_BATCH = 64
#: Longest sleep after consecutive broker errors in a poll loop.
_MAX_ERROR_BACKOFF = 10.0


class _Group:
    """A nursery that lives until cancelled, owned by one part of the tree (consumers, jobs...)."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.nursery: trio.Nursery

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self.done.set()

    def cancel(self) -> None:
        self.nursery.cancel_scope.cancel()


@attrs.define(eq=False)
class _Loop:
    queue: str
    on_job: _OnJob
    slots: Slots
    backoff_max: int
    token: str | None = None
    """The routing token of a task loop (whose serving starts a liveness key)."""
    pop_scope: trio.CancelScope | None = None
    idle: list[_JobWorker] = attrs.Factory(list)


_RUNNING, _FINALIZING, _ABANDONED = "running", "finalizing", "abandoned"


@attrs.define(eq=False)
class _Claim:
    queue: str
    job: ClaimedJob
    scope: trio.CancelScope | None = None
    """The scope of the job worker running it (cancelling it cancels exactly this handler)."""
    state: str = _RUNNING
    lost: bool = False

    def cancel(self) -> None:
        if self.scope is not None:
            self.scope.cancel()


@attrs.define(eq=False)
class _JobWorker:
    """A task that runs one loop's jobs one after another, parked while idle.

    One task per running handler, each in its own cancel scope, as §2 asks — but the task and
    its scope outlive one job: spawning a task and building a scope per job costs ~15 µs, a
    reschedule of a parked worker ~3 µs. Cancelling the scope (a lost lease, close's deadline)
    ends the worker with its job; the loop starts a fresh one when next needed.
    """

    task: trio.lowlevel.Task
    scope: trio.CancelScope


@attrs.frozen
class TransportStatistics:
    """A snapshot of one transport's state."""

    in_flight: int
    """Job handlers running now (every queue)."""
    open_claims: int
    """Claims this instance holds (running, finalizing or awaiting handback)."""
    task_limit: int
    """The step concurrency limit."""
    duplicates: int
    """Times a job's lease was lost while its handler ran."""
    queues: tuple[str, ...]
    """Every queue this instance consumes."""
    closed: bool


class QueueTransport:
    """Carries step tasks, results, heartbeats and control messages over a queue broker.

    Open one with :func:`open_queue_transport`; do not construct it directly.
    """

    def __init__(self, backend: Backend, options: TransportOptions) -> None:
        self._backend = backend
        self._broker = backend.broker
        self._options = options
        self._names = QueueNames(options.namespace)
        self._report_hook = options.on_error
        broker = self._broker
        self._can_renew = isinstance(broker, SupportsRenewal)
        self._can_recover = isinstance(broker, SupportsRecovery)
        self._wait_for_work = broker.wait_for_work if isinstance(broker, SupportsWakeup) else None
        if options.stalled_threshold is not None:
            self.stalled_threshold = options.stalled_threshold
        elif self._can_renew:
            self.stalled_threshold = DEFAULT_RENEWING_STALLED_THRESHOLD
        else:
            self.stalled_threshold = DEFAULT_STALLED_THRESHOLD
        self._controller = ConcurrencyController(options.concurrency, on_limit=self._move_limit)
        self._task_slots = Slots(self._controller.limit)
        self._result_slots = Slots(options.result_concurrency)
        self._handlers: dict[str, StepHandler] = {}
        self._result_handler: ResultHandler | None = None
        self._heartbeat_handler: HeartbeatHandler | None = None
        self._control_handler: ControlHandler | None = None
        self._task_loops: set[str] = set()
        self._task_queues: set[str] = set()
        self._consumed: list[str] = []
        self._loops: list[_Loop] = []
        self._claims: dict[str, _Claim] = {}
        self._running = 0
        self._jobs_idle = trio.Event()
        self._jobs_idle.set()
        self._liveness: Liveness | None = None
        if backend.keys is not None:
            self._liveness = Liveness(
                backend.keys,
                self._names,
                options.instance_id,
                interval=options.worker_heartbeat_interval,
                status=self._controller.snapshot,
                descriptor=self._descriptor,
                report=self._report,
            )
        self._descriptor_cache: tuple[float, list[KeyEntry]] | None = None
        self._started_at = time.time()
        self._deferred: list[_Loop] | None = None
        self._ids = itertools.count(1)
        self._id_prefix = f"{sanitize_token(options.instance_id)[:24]}-"
        self._closing = False
        self._fully_closed = False
        self._closed = trio.Event()
        self._max_payload_bytes = options.max_payload_bytes
        self._consumers = _Group()
        self._inboxes = _Group()
        self._jobs = _Group()
        self._keeper = _Group()
        self._vitals = _Group()
        self._root: trio.Nursery | None = None

    # ------------------------------------------------------------------ identity and names

    @property
    def instance_id(self) -> str:
        """This instance's id (reply target, liveness key suffix)."""
        return self._options.instance_id

    @property
    def names(self) -> QueueNames:
        """The queue names of this transport's namespace."""
        return self._names

    @property
    def options(self) -> TransportOptions:
        return self._options

    @property
    def backend(self) -> Backend:
        return self._backend

    def token_of(self, group: str) -> str:
        """The routing token of a step name or group (T1)."""
        return tenant_group(sanitize_token(group), self._options.partition)

    def task_queue(self, group: str) -> str:
        """The task queue a step name or group routes to (T1)."""
        return self._names.tasks(self.token_of(group))

    def statistics(self) -> TransportStatistics:
        return TransportStatistics(
            in_flight=self._running,
            open_claims=len(self._claims),
            task_limit=self._task_slots.limit,
            duplicates=self._controller.duplicates,
            queues=tuple(self._consumed),
            closed=self._closed.is_set(),
        )

    # ------------------------------------------------------------------ lifecycle

    async def _start(self, root: trio.Nursery) -> None:
        self._root = root
        for group in (self._consumers, self._inboxes, self._jobs, self._keeper, self._vitals):
            await root.start(group.run)
        await self._vitals.nursery.start(self._controller.run)
        if self._liveness is not None:
            await self._vitals.nursery.start(self._liveness.run)
        if self._can_renew:
            self._keeper.nursery.start_soon(self._renew_forever)
        if self._can_recover and self._options.stalled_check_interval > 0:
            root.start_soon(self._sweep_forever)

    def _check_open(self) -> None:
        if self._closing:
            raise TransportClosed("the transport is closed")

    def _report(self, exc: BaseException) -> None:
        try:
            self._report_hook(exc)
        except Exception:  # a broken hook must not take a loop down with it
            import logging

            logging.getLogger("durable_trio").exception("the on_error hook raised")

    # ------------------------------------------------------------------ producers (never deferred)

    async def _push(
        self,
        queue: str,
        kind: JobKind,
        payload: Any,
        *,
        priority: int | None = None,
        delay: float = 0.0,
    ) -> str:
        if self._fully_closed:
            # Producers work on through the close drain (a finishing handler publishes its
            # result); only a fully closed transport refuses.
            raise TransportClosed("the transport is closed")
        job_id = f"{self._id_prefix}{next(self._ids)}"
        data = encode_envelope(job_id, kind, payload, priority, self._max_payload_bytes)
        await self._broker.push_on(queue, Job(job_id, data), priority=priority, delay=delay)
        return job_id

    async def dispatch(self, task: RemoteTask, *, delay: float = 0.0) -> str:
        """engine -> step worker: enqueue ``task`` on its routing token's task queue (T1, T3).

        Returns:
            The job id.

        Raises:
            PayloadTooLarge: the encoded task is over ``max_payload_bytes``.
            PayloadError: its input is not JSON-serialisable.
            BrokerError: the broker did not take it.
            TransportClosed: the transport is closed.
        """
        return await self._push(
            self.task_queue(task.routing_group),
            JobKind.TASK,
            task,
            priority=task.priority,
            delay=delay,
        )

    async def publish_result(self, result: StepResult) -> str:
        """step worker -> engine: publish a step result (the transport does this for handlers)."""
        return await self._push(self._names.results, JobKind.RESULT, result)

    async def heartbeat(self, beat: StepHeartbeat) -> None:
        """step worker -> engine: a long step is alive."""
        await self._push(self._names.heartbeats, JobKind.HEARTBEAT, beat)

    async def send_control(self, message: ControlMessage) -> None:
        """Best-effort, POINT-TO-POINT control (T17): exactly one consumer takes each message.
        It is not a broadcast: with several consumers, only one of them sees it."""
        await self._push(self._names.control, JobKind.CONTROL, message)

    # ------------------------------------------------------------------ consumers

    def handle(self, name: str, handler: StepHandler) -> None:
        """Serve step ``name``: ``async def handler(task: RemoteTask) -> JSON value``.

        Starts (once per routing token) the task loop of ``name``'s queue. Re-registering a
        name swaps its handler. A handler that raises yields a failed :class:`StepResult`
        (retryable unless the exception has ``retryable = False``).
        """
        self._check_open()
        self._handlers[name] = handler
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
        self._check_open()
        first = self._result_handler is None
        self._result_handler = handler
        if first:
            self._start_loop(
                _Loop(
                    self._names.results,
                    self._typed(JobKind.RESULT, lambda: self._result_handler),
                    self._result_slots,
                    1,
                )
            )

    def on_heartbeat(self, handler: HeartbeatHandler) -> None:
        """engine side: consume step heartbeats."""
        self._check_open()
        first = self._heartbeat_handler is None
        self._heartbeat_handler = handler
        if first:
            self._start_loop(
                _Loop(
                    self._names.heartbeats,
                    self._typed(JobKind.HEARTBEAT, lambda: self._heartbeat_handler),
                    Slots(1),
                    self._options.idle_backoff_max,
                )
            )

    def on_control(self, handler: ControlHandler) -> None:
        """Consume control messages (T17: point-to-point, best-effort)."""
        self._check_open()
        first = self._control_handler is None
        self._control_handler = handler
        if first:
            self._start_loop(
                _Loop(
                    self._names.control,
                    self._typed(JobKind.CONTROL, lambda: self._control_handler),
                    Slots(1),
                    self._options.idle_backoff_max,
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
        with trio.CancelScope() as pop_scope:
            loop.pop_scope = pop_scope
            while True:
                await slots.acquire()
                # N free slots, one round trip: claim as many jobs as there are free slots.
                extra = slots.take_free(_MAX_BATCH - 1) if pop_many is not None else 0
                try:
                    # No pop starts once close has begun (a loop first scheduled after the
                    # close started would otherwise shield a pop nobody bounds).
                    await trio.lowlevel.checkpoint_if_cancelled()
                except trio.Cancelled:
                    slots.release(1 + extra)
                    raise
                pop_scope.shield = True
                try:
                    if pop_many is not None:
                        batch = await pop_many(queue, 1 + extra, worker=worker)
                    else:
                        job = await broker.pop_from(queue, worker=worker)
                        batch = [job] if job is not None else []
                except BrokerError as exc:
                    errors += 1
                    self._report(exc)
                    batch = []
                finally:
                    pop_scope.shield = False
                if len(batch) < 1 + extra:
                    slots.release(1 + extra - len(batch))
                if batch:
                    errors = empty = 0
                    for job in batch:
                        self._begin_job(loop, job)
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

    def _begin_job(self, loop: _Loop, job: ClaimedJob) -> None:
        """Track a popped job and hand it to an idle worker of its loop (or a new one)."""
        claim = _Claim(loop.queue, job)
        self._claims[job.lease.token] = claim
        if self._running == 0:
            self._jobs_idle = trio.Event()
        self._running += 1
        if loop.idle:
            worker = loop.idle.pop()
            claim.scope = worker.scope
            trio.lowlevel.reschedule(worker.task, outcome.Value(claim))
        else:
            self._jobs.nursery.start_soon(self._job_worker, loop, claim)

    async def _job_worker(self, loop: _Loop, claim: _Claim) -> None:
        """Run ``claim``, then park until the loop hands this worker its next claim.

        The hot path of every job, so written flat: one coroutine per job (the handler's), the
        successful finalize inline.
        """
        on_job = loop.on_job
        slots = loop.slots
        claims = self._claims
        complete_job = self._broker.complete_job
        with trio.CancelScope() as scope:
            me = _JobWorker(trio.lowlevel.current_task(), scope)
            claim.scope = scope

            def abort(_: Any) -> trio.lowlevel.Abort:
                loop.idle.remove(me)
                return trio.lowlevel.Abort.SUCCEEDED

            while True:
                job = claim.job
                try:
                    error: Exception | None = None
                    try:
                        await on_job(job)
                    except Exception as exc:
                        error = exc
                    # Abandoned by close (handed back in its step 6), or the lease went to
                    # another worker (T8): its outcome must not finalize someone else's claim.
                    if claim.state is _RUNNING and not claim.lost:
                        # From here nobody cancels this scope: shielded, and bounded once a
                        # close starts (close sets the deadline of the finalizes in flight), so a
                        # close can never race a job's final write.
                        claim.state = _FINALIZING
                        scope.shield = True
                        if self._closing:
                            scope.deadline = trio.current_time() + self._options.cleanup_timeout
                        try:
                            if error is not None:
                                await self._finalize(claim, error)
                            elif not await complete_job(job.lease, claim.queue):
                                self._report(
                                    LeaseLost(
                                        "completing the job answered 'lease lost': it was "
                                        "re-delivered meanwhile (not retried)",
                                        queue=claim.queue,
                                        job_id=job.id,
                                    )
                                )
                        except BrokerError as exc:
                            self._report(_job_error(f"finalizing failed: {exc}", claim, exc))
                        finally:
                            scope.shield = False
                finally:
                    if claim.state is _RUNNING:
                        # Cancelled before it finished (its own scope, by close or a lost lease,
                        # or the whole transport from outside): keep it for close's handback.
                        claim.state = _ABANDONED
                    if claim.state is not _ABANDONED or claim.lost:
                        del claims[job.lease.token]
                    slots.release()
                    self._running -= 1
                    if self._running == 0:
                        self._jobs_idle.set()
                loop.idle.append(me)
                claim = await trio.lowlevel.wait_task_rescheduled(abort)
        if claim.state is _FINALIZING and scope.cancelled_caught:
            self._report(
                JobError(
                    "finalizing timed out (broker not answering)",
                    queue=claim.queue,
                    job_id=claim.job.id,
                )
            )

    async def _finalize(self, claim: _Claim, error: Exception) -> None:
        """T10 for a job whose handler raised: hand it back (fail it for good after
        ``max_job_attempts``); fail bad input at once. (Success is completed inline by the job
        worker.) Runs shielded and bounded: a close can never race a job's final write."""
        broker = self._broker
        job, queue = claim.job, claim.queue
        try:
            if isinstance(error, PayloadError):
                self._report(_job_error(f"bad input, job failed: {error}", claim, error))
                ok = await broker.fail_job(job.lease, queue, f"bad input: {error}")
            elif job.attempts + 1 >= self._options.max_job_attempts:
                self._report(
                    _job_error(
                        f"handler failed {job.attempts + 1} times, job failed: {error!r}",
                        claim,
                        error,
                    )
                )
                ok = await broker.fail_job(
                    job.lease, queue, f"handler failed {job.attempts + 1} times: {error!r}"
                )
            else:
                self._report(
                    _job_error(f"handler failed, job handed back: {error!r}", claim, error)
                )
                ok = await broker.retry_job(job.lease, queue)
            if not ok:
                self._report(
                    LeaseLost("finalizing answered 'lease lost'", queue=queue, job_id=job.id)
                )
        except BrokerError as exc:
            self._report(_job_error(f"finalizing failed: {exc}", claim, exc))

    # ------------------------------------------------------------------ step tasks

    async def _on_task_job(self, job: ClaimedJob) -> None:
        try:
            envelope = decode_envelope(job.data, max_bytes=self._options.max_payload_bytes)
            if envelope.kind is not JobKind.TASK:
                raise PayloadError(f"a {envelope.kind.value!r} job does not belong on a task queue")
        except PayloadError as exc:
            await self._answer_bad_task(job, exc)
            raise
        await self._serve_task(envelope.payload)

    async def _answer_bad_task(self, job: ClaimedJob, exc: PayloadError) -> None:
        """A task that does not parse but names its run and step still gets a failed result, so
        the run settles instead of waiting forever. Nothing is published when it cannot be told
        which step it was."""
        try:
            raw = orjson.loads(job.data)
            payload = raw["payload"]
            run_id, step_id, attempt = payload["runId"], payload["stepId"], payload["attempt"]
        except Exception:
            return
        if type(run_id) is not str or type(step_id) is not str or type(attempt) is not int:
            return
        error = StepError(message=f"bad task: {exc}", code="bad_input", retryable=False)
        result = StepResult(run_id, step_id, attempt, StepStatus.FAILED, error=error)
        await self.publish_result(result)

    async def _serve_task(self, task: RemoteTask) -> None:
        handler = self._handlers.get(task.name)
        result: StepResult
        if handler is None:
            message = f"no handler for step {task.name!r} on this worker"
            self._report(
                JobError(message, queue=self.task_queue(task.routing_group), job_id=task.task_id)
            )
            error = StepError(message=message, code="no_handler", retryable=False)
            result = StepResult(
                task.run_id,
                task.step_id,
                task.attempt,
                StepStatus.FAILED,
                error=error,
                task_id=task.task_id,
            )
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
                result = StepResult(
                    task.run_id,
                    task.step_id,
                    task.attempt,
                    StepStatus.FAILED,
                    error=error,
                    task_id=task.task_id,
                )
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
            await self.publish_result(result)
        except PayloadError as exc:
            self._report(
                JobError(
                    f"step {task.name!r} returned an output that cannot be sent: {exc}",
                    queue=self.task_queue(task.routing_group),
                    job_id=task.task_id,
                )
            )
            error = StepError(message=str(exc), code="bad_output", retryable=False)
            await self.publish_result(
                StepResult(
                    task.run_id,
                    task.step_id,
                    task.attempt,
                    StepStatus.FAILED,
                    error=error,
                    task_id=task.task_id,
                )
            )

    # ------------------------------------------------------------------ lease keeper (T7, T8)

    async def _renew_forever(self) -> None:
        period = self.stalled_threshold / 2
        start = trio.current_time()
        tick = 1
        while True:
            await trio.sleep_until(start + tick * period)
            with trio.move_on_after(period, shield=True):
                await self._renew_open_claims()
            # A slow round skips the ticks it overran instead of stacking rounds.
            tick = max(tick + 1, math.floor((trio.current_time() - start) / period) + 1)

    async def _renew_open_claims(self) -> None:
        by_queue: dict[str, list[Lease]] = {}
        for claim in self._claims.values():
            by_queue.setdefault(claim.queue, []).append(claim.job.lease)
        assert isinstance(self._broker, SupportsRenewal)
        for queue, leases in by_queue.items():
            try:
                outcome = await self._broker.renew_jobs(queue, leases)
            except BrokerError as exc:
                self._report(exc)
                continue
            for lease in outcome.lost:
                held = self._claims.get(lease.token)
                if held is None or held.state is not _RUNNING or held.lost:
                    continue  # finished during the round trip: finalized, not lost
                held.lost = True
                self._controller.duplicates += 1
                what = "cancelled" if self._options.cancel_on_lost_lease else "left to finish"
                self._report(
                    LeaseLost(
                        f"lost the claim before renewing it: the job was re-delivered and may "
                        f"run twice; its handler is {what} and its outcome discarded "
                        f"(raise stalled_threshold if this worker blocks its event loop)",
                        queue=queue,
                        job_id=lease.job_id,
                    )
                )
                if self._options.cancel_on_lost_lease:
                    held.cancel()

    # ------------------------------------------------------------------ reclaim sweep (T9)

    async def _sweep_forever(self) -> None:
        interval = self._options.stalled_check_interval
        start = trio.current_time()
        tick = 1
        while True:
            await trio.sleep_until(start + tick * interval)
            for queue in list(self._consumed):
                await self._sweep(queue)
            tick = max(tick + 1, math.floor((trio.current_time() - start) / interval) + 1)

    async def _sweep(self, queue: str) -> None:
        assert isinstance(self._broker, SupportsRecovery)
        try:
            recovery = await self._broker.recover_stalled_jobs(
                queue, self.stalled_threshold, self._options.max_stalled_count
            )
        except BrokerError as exc:
            self._report(exc)
            return
        for job in recovery.exceeded:
            await self._fail_poison(queue, job)

    async def _fail_poison(self, queue: str, job: ClaimedJob) -> None:
        """Fail a job that stalled more than ``max_stalled_count`` times and, for a step task,
        publish a RETRYABLE failed result so the run does not wait forever. Only after the fail
        succeeded, only on task queues, never for unparseable or workflow payloads."""
        reason = f"stalled more than {self._options.max_stalled_count} times"
        try:
            failed = await self._broker.fail_job(job.lease, queue, reason)
        except BrokerError as exc:
            self._report(exc)
            return
        self._report(JobError(f"poison job failed: {reason}", queue=queue, job_id=job.id))
        if not failed or queue not in self._task_queues:
            return
        try:
            envelope = decode_envelope(job.data, max_bytes=self._options.max_payload_bytes)
        except PayloadError:
            return
        if envelope.kind is not JobKind.TASK:
            return
        task: RemoteTask = envelope.payload
        evidence: dict[str, Any] = {
            "stalls": [{"at": s.at, "worker": s.worker} for s in job.stalls],
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
        result = StepResult(
            task.run_id,
            task.step_id,
            task.attempt,
            StepStatus.FAILED,
            error=error,
            task_id=task.task_id,
        )
        try:
            await self.publish_result(result)
        except (BrokerError, TransportClosed) as exc:
            self._report(exc)

    # ------------------------------------------------------------------ health (T6, T12, T13)

    def _move_limit(self, limit: int) -> None:
        # A move of the limit wakes the loops waiting for a slot at once.
        self._task_slots.limit = limit

    def _descriptor(self) -> dict[str, Any]:
        return {
            "instance": self.instance_id,
            "steps": sorted(self._handlers),
            "startedAt": self._started_at,
        }

    def worker_status(self) -> WorkerStatus:
        """This instance's liveness snapshot (what its heartbeats carry)."""
        return self._controller.snapshot()

    async def queue_depth(self, group: str) -> int | None:
        """Jobs waiting on ``group``'s task queue, or ``None`` if the broker cannot count."""
        if not isinstance(self._broker, SupportsSize):
            return None
        return await self._broker.size_of(self.task_queue(group))

    async def group_health(self, group: str) -> GroupHealth | None:
        """T12: the group's depth and its live workers (with their headroom and p95).

        Returns:
            ``None`` without a key store: no worker can advertise liveness then, and "a
            backlog and zero workers" would be a false alarm.
        """
        keys = self._backend.keys
        if keys is None:
            return None
        token = self.token_of(group)
        depth = await self.queue_depth(group) or 0
        return await read_group_health(keys, self._names, token, depth)

    async def worker_health(self) -> list[GroupHealth] | None:
        """Every group that has a live worker (by routing token), with its depth."""
        keys = self._backend.keys
        if keys is None:
            return None
        marker = self._names.worker_heartbeat("", "").removesuffix(":")
        tokens = sorted(
            {e.key[len(marker) :].rsplit(":", 1)[0] for e in await keys.entries(marker)}
        )
        broker = self._broker
        health = []
        for token in tokens:
            queue = self._names.tasks(token)
            depth = await broker.size_of(queue) if isinstance(broker, SupportsSize) else 0
            health.append(await read_group_health(keys, self._names, token, depth))
        return health

    async def list_worker_descriptors(self, group: str) -> list[WorkerDescriptor]:
        """T13: the live descriptors of the workers serving ``group``, read through a short
        cache (``descriptor_cache`` seconds, default 5)."""
        keys = self._backend.keys
        if keys is None:
            return []
        now = trio.current_time()
        cached = self._descriptor_cache
        if cached is None or now - cached[0] >= self._options.descriptor_cache:
            cached = self._descriptor_cache = (
                now,
                await keys.entries(self._names.worker_descriptor("")),
            )
        token = self.token_of(group)
        found = []
        for entry in cached[1]:
            try:
                raw = orjson.loads(entry.value)
                if token in raw["tokens"]:
                    found.append(
                        WorkerDescriptor(
                            raw["instance"],
                            tuple(raw["tokens"]),
                            tuple(raw["steps"]),
                            raw["startedAt"],
                        )
                    )
            except (orjson.JSONDecodeError, KeyError, TypeError):
                continue
        return found

    # ------------------------------------------------------------------ close (T24)

    async def aclose(self) -> None:
        """Close in bounded, named phases (T24). Idempotent; runs to its end even if cancelled.

        1. cancel the consumers: no new job is taken;
        2. stop liveness and withdraw this instance's keys (bounded);
        3. wait for running handlers up to ``close_timeout`` while renewal keeps their claims;
        4. cancel the handlers still running;
        5. stop renewal, letting the round in flight land;
        6. hand every still-open claim back for immediate, attempt-neutral redelivery;
        7. withdraw inbox registrations and drain this instance's own inboxes (bounded);
        8. the backend belongs to whoever opened it and is closed by them.

        Cancellation:
            Shielded; every phase is bounded (``close_timeout`` for phase 3,
            ``cleanup_timeout`` for each cleanup phase), so close never hangs on a dead broker.
        """
        if self._closing:
            with trio.CancelScope(shield=True):
                await self._closed.wait()
            return
        self._closing = True
        options = self._options
        try:
            with trio.CancelScope(shield=True):
                # 1. stop taking work
                self._consumers.cancel()
                self._deferred = None
                bound = trio.current_time() + options.cleanup_timeout
                for loop in self._loops:  # a pop in flight (shielded) lands, bounded
                    if loop.pop_scope is not None:
                        loop.pop_scope.deadline = bound
                for claim in self._claims.values():  # so does a finalize in flight
                    if claim.state is _FINALIZING and claim.scope is not None:
                        claim.scope.deadline = bound
                with trio.move_on_after(options.cleanup_timeout):
                    await self._consumers.done.wait()
                # 2. stop the controller and the heartbeat timer; withdraw the liveness keys
                if self._liveness is not None:
                    await self._liveness.withdraw(options.cleanup_timeout)
                self._vitals.cancel()
                # 3. let running handlers finish, up to close_timeout, renewal still running
                with trio.move_on_after(options.close_timeout):
                    await self._jobs_idle.wait()
                # 4. cancel what still runs; each handler keeps its claim for the handback
                for claim in self._claims.values():
                    if claim.state is _RUNNING:
                        claim.state = _ABANDONED
                        claim.cancel()
                with trio.move_on_after(options.cleanup_timeout):
                    await self._jobs_idle.wait()
                self._jobs.cancel()
                # 5. stop renewal; a round in flight is shielded and lands first (bounded)
                self._keeper.cancel()
                with trio.move_on_after(options.cleanup_timeout):
                    await self._keeper.done.wait()
                # 6. hand back every claim still open: immediate and attempt-neutral
                await self._hand_back_open_claims()
                # 7. inboxes
                self._inboxes.cancel()
        finally:
            if self._root is not None:
                self._root.cancel_scope.cancel()
            self._fully_closed = True
            self._closed.set()

    async def _hand_back_open_claims(self) -> None:
        claims, self._claims = list(self._claims.values()), {}
        with trio.move_on_after(self._options.cleanup_timeout) as bound:
            for claim in claims:
                try:
                    await self._broker.retry_job(
                        claim.job.lease, claim.queue, delay=0.0, count_attempt=False
                    )
                except BrokerError as exc:
                    self._report(exc)
        if bound.cancelled_caught:
            self._report(
                BrokerError("close: handing claims back timed out; the sweep recovers the rest")
            )


def _job_error(message: str, claim: _Claim, cause: BaseException) -> JobError:
    error = JobError(message, queue=claim.queue, job_id=claim.job.id)
    error.__cause__ = cause
    return error


@asynccontextmanager
async def open_queue_transport(backend: Backend, **options: Any) -> AsyncIterator[QueueTransport]:
    """Open a queue transport over ``backend``; leaving the block closes it (T24).

    Args:
        backend: from :func:`~durable_trio.open_backend`.
        **options: the fields of :class:`~durable_trio.TransportOptions`: ``namespace``,
            ``concurrency``, ``result_concurrency``, ``close_timeout``, ``cleanup_timeout``,
            ``poll_interval``, ``idle_backoff_max``, ``stalled_threshold``,
            ``stalled_check_interval``, ``max_stalled_count``, ``max_job_attempts``,
            ``worker_heartbeat_interval``, ``instance_id``, ``on_error``, ``partition``,
            ``cancel_on_lost_lease``, ``max_payload_bytes``.

    Raises:
        ConfigError: an option that cannot work.
    """
    try:
        validated = TransportOptions(**options)
    except TypeError as exc:
        raise ConfigError(f"open_queue_transport: {exc}") from None
    transport = QueueTransport(backend, validated)
    # The body's own exception leaves bare, not wrapped in the root nursery's ExceptionGroup.
    body_error: BaseException | None = None
    async with trio.open_nursery() as root:
        await transport._start(root)
        try:
            yield transport
        except BaseException as exc:
            body_error = exc
        finally:
            await transport.aclose()
    if body_error is not None:
        raise body_error
