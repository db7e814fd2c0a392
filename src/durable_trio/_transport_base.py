"""The state of a queue transport and what all its parts use: the task groups of its
nursery tree, claims, producers and the error hook. The behaviours live in mixins, one
module each: ``_consume`` (poll loops, job workers, finalize), ``_leases`` (renewal, the
sweep, poison), ``_health`` (liveness and health), ``_remote`` (remote workflows, tenant
pods); ``_transport`` puts them together with the close."""

from __future__ import annotations

import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs
import trio

from ._adaptive import ConcurrencyController
from ._coalesce import Coalescer, results_of
from ._codec import encode_envelope
from ._consume import Consumers
from ._errors import TransportClosed
from ._jobs import JobRunner
from ._leases import LeaseKeeper, Sweeper
from ._liveness import (
    Liveness,
)
from ._naming import QueueNames, sanitize_token, tenant_group
from ._options import (
    DEFAULT_RENEWING_STALLED_THRESHOLD,
    DEFAULT_STALLED_THRESHOLD,
    TransportOptions,
)
from ._slots import Slots
from ._tree import TransportTree
from ._wire import (
    ControlMessage,
    JobKind,
    JSONValue,
    RemoteTask,
    StepError,
    StepHeartbeat,
    StepResult,
)
from .adapters import (
    ClaimedJob,
    Job,
    Lease,
    SupportsBatchFinalize,
    SupportsRecovery,
    SupportsRenewal,
)

if TYPE_CHECKING:
    from .backends._backend import Backend
    from .keys import KeyEntry, KeyStore

StepHandler = Callable[[RemoteTask], Awaitable[JSONValue]]
ResultHandler = Callable[[StepResult], Awaitable[None]]
HeartbeatHandler = Callable[[StepHeartbeat], Awaitable[None]]
ControlHandler = Callable[[ControlMessage], Awaitable[None]]




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


class TransportBase:
    """The state of a queue transport, shared by its parts (see the module docstring)."""

    def __init__(self, backend: Backend, options: TransportOptions) -> None:
        self._backend = backend
        self._broker = backend.broker
        self._options = options
        self._names = QueueNames(options.namespace)
        self._report_hook = options.on_error
        broker = self._broker
        self._can_renew = isinstance(broker, SupportsRenewal)
        self._can_recover = isinstance(broker, SupportsRecovery)
        # (a runtime Protocol check inspects every member: made once here, not per call)
        self._many = broker if isinstance(broker, SupportsBatchFinalize) else None
        # Finalizes and pushes made in one scheduling round share one broker call, where the
        # broker can take them so (not the memory broker: its calls cost less than the round).
        self._batch_finalize = (
            broker
            if isinstance(broker, SupportsBatchFinalize)
            and getattr(broker, "coalesce_finalize", True)
            else None
        )
        self._pushers: dict[str, Coalescer[tuple[Job, int | None], None]] = {}
        self._completers: dict[str, Coalescer[Lease, bool]] = {}
        self._finishers: dict[str, Coalescer[tuple[Lease, Job], bool]] = {}
        self._finishers_on = self._batch_finalize is not None
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
        self._turns: Callable[[Any], Awaitable[None]] | None = None
        """Serves the workflow turns found on a task loop (set by the remote layer, T14)."""
        self._task_loops: set[str] = set()
        self._task_queues: set[str] = set()
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
        self._ids = itertools.count(1)
        self._id_prefix = f"{sanitize_token(options.instance_id)[:24]}-"
        self._closing = False
        self._fully_closed = False
        self._closed = trio.Event()
        self._max_payload_bytes = options.max_payload_bytes
        self._lease_keeper: LeaseKeeper | None = None
        if self._can_renew:
            self._lease_keeper = LeaseKeeper(
                cast("SupportsRenewal", broker),
                lambda: self._runner.claims,
                self._controller,
                period=self.stalled_threshold / 2,
                cancel_on_lost_lease=options.cancel_on_lost_lease,
                report=self._report,
            )
        # The nursery tree; its levels are where each part starts its tasks (see _tree).
        self._tree = TransportTree(options, self._report)
        self._inboxes = self._tree.inboxes
        self._vitals = self._tree.vitals
        self._runner = JobRunner(
            broker,
            options,
            self._tree.jobs,
            completer=self._completer,
            finisher=self._finisher,
            batched=self._batch_finalize is not None,
            closing=lambda: self._closing,
            answer_bad_task=self._answer_bad_task,
            report=self._report,
        )
        self._consumers = Consumers(
            broker,
            options,
            self._runner,
            consumers=self._tree.consumers,
            inboxes=self._tree.inboxes,
            liveness=lambda: self._liveness,
            check_open=self._check_open,
            report=self._report,
        )
        self._sweeper: Sweeper | None = None
        if self._can_recover and options.stalled_check_interval > 0:
            self._sweeper = Sweeper(
                backend,
                self._names,
                options,
                stalled_threshold=self.stalled_threshold,
                consumed=self._consumers.consumed,
                task_queues=self._task_queues,
                publish_result=self.publish_result,
                report=self._report,
            )

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
        """The routing token of a step name or group (T1, docs/spec.md)."""
        return tenant_group(sanitize_token(group), self._options.partition)

    def task_queue(self, group: str) -> str:
        """The task queue a step name or group routes to (T1)."""
        return self._names.tasks(self.token_of(group))

    def statistics(self) -> TransportStatistics:
        return TransportStatistics(
            in_flight=self._runner.running,
            open_claims=len(self._runner.claims),
            task_limit=self._task_slots.limit,
            duplicates=self._controller.duplicates,
            queues=tuple(self._consumers.consumed),
            closed=self._closed.is_set(),
        )

    # ------------------------------------------------------------------ shared helpers

    def _adopt_liveness_store(self, keys: KeyStore) -> None:
        """A store-less tenant pod's liveness, written through ``keys`` (forwarded to the
        control plane, T22); nothing when this transport already has a liveness."""
        if self._backend.keys is not None or self._liveness is not None:
            return
        options = self._options
        self._liveness = Liveness(
            keys,
            self._names,
            options.instance_id,
            interval=options.worker_heartbeat_interval,
            status=self._controller.snapshot,
            descriptor=self._descriptor,
            report=self._report,
        )
        self._vitals.nursery.start_soon(self._liveness.run)

    async def _answer_bad_task(self, job: ClaimedJob, error: StepError) -> None:
        """Overridden by the consumers (a damaged step task still answers its run)."""
        raise NotImplementedError

    def _move_limit(self, limit: int) -> None:
        # A move of the limit wakes the loops waiting for a slot at once.
        self._task_slots.limit = limit

    def _descriptor(self) -> dict[str, Any]:
        return {
            "instance": self.instance_id,
            "steps": sorted(self._handlers),
            "startedAt": self._started_at,
        }

    def _check_open_for_producers(self) -> None:
        if self._fully_closed:
            # Producers work on through the close drain (a finishing handler publishes its
            # result); only a fully closed transport refuses.
            raise TransportClosed("the transport is closed")

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
        self._check_open_for_producers()
        job = self._new_job(kind, payload, priority)
        if delay > 0:
            await self._broker.push_on(queue, job, priority=priority, delay=delay)
        else:
            await self._push_job(queue, job, priority)
        return job.id

    def _new_job(self, kind: JobKind, payload: Any, priority: int | None = None) -> Job:
        """A job with a fresh id and ``payload`` encoded in its envelope."""
        job_id = f"{self._id_prefix}{next(self._ids)}"
        return Job(
            job_id, encode_envelope(job_id, kind, payload, priority, self._max_payload_bytes)
        )

    def _pusher(self, queue: str) -> Coalescer[tuple[Job, int | None], None]:
        pusher = self._pushers.get(queue)
        if pusher is None:
            broker = self._batch_finalize
            assert broker is not None

            async def push_many(items: list[tuple[Job, int | None]]) -> list[None]:
                await broker.push_many(queue, [j for j, _ in items], [p for _, p in items])
                return results_of(len(items))

            pusher = self._pushers[queue] = Coalescer(push_many)
        return pusher

    def _forget_pusher(self, queue: str) -> None:
        """Drop an idle queue's pusher: a queue addressed to one instance (a pod's inbox) is
        pushed to for as long as that instance lives, so a long-running control plane would
        otherwise keep one coalescer per pod it ever answered."""
        pusher = self._pushers.get(queue)
        if pusher is not None and pusher.idle:
            del self._pushers[queue]

    async def _push_job(self, queue: str, job: Job, priority: int | None = None) -> None:
        """Push an encoded job now, coalesced where the broker takes batches."""
        self._check_open_for_producers()
        if self._batch_finalize is not None:
            await self._pusher(queue).submit((job, priority))
        else:
            await self._broker.push_on(queue, job, priority=priority)

    def _finisher(self, queue: str) -> Coalescer[tuple[Lease, Job], bool]:
        """Results pushed with their tasks' acknowledgements: one broker call per batch."""
        finisher = self._finishers.get(queue)
        if finisher is None:
            broker = self._batch_finalize
            assert broker is not None
            results = self._names.results

            async def finish(items: list[tuple[Lease, Job]]) -> list[bool]:
                return await broker.push_and_complete_many(
                    results, [job for _, job in items], queue, [lease for lease, _ in items]
                )

            finisher = self._finishers[queue] = Coalescer(finish)
        return finisher

    def _completer(self, queue: str) -> Coalescer[Lease, bool]:
        completer = self._completers.get(queue)
        if completer is None:
            broker = self._batch_finalize
            assert broker is not None

            async def complete_many(leases: list[Lease]) -> list[bool]:
                return await broker.complete_many(queue, leases)

            completer = self._completers[queue] = Coalescer(complete_many)
        return completer

    async def dispatch(self, task: RemoteTask, *, delay: float = 0.0) -> str:
        """engine -> step worker: enqueue ``task`` on its routing token's task queue (T1, T3).

        Returns:
            The job id.

        Raises:
            PayloadTooLarge: the encoded task is over ``max_payload_bytes``.
            PayloadError: its input is not a JSON value (NaN, a set, nested deeper than
                ``MAX_JSON_DEPTH``, ...); ``path`` names where.
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

    async def dispatch_many(self, tasks: Sequence[RemoteTask]) -> list[str]:
        """Enqueue many tasks, in as few broker calls as the broker allows (one per routing
        queue on Redis and SQLite). Same errors as :meth:`dispatch`; on an error some tasks may
        have been enqueued already.

        Returns:
            The job ids, in order.
        """
        self._check_open_for_producers()
        by_queue: dict[str, list[tuple[Job, int | None]]] = {}
        ids = []
        for task in tasks:
            job = self._new_job(JobKind.TASK, task, task.priority)
            by_queue.setdefault(self.task_queue(task.routing_group), []).append(
                (job, task.priority)
            )
            ids.append(job.id)
        broker, many = self._broker, self._many
        for queue, items in by_queue.items():
            if many is not None:
                await many.push_many(queue, [j for j, _ in items], [p for _, p in items])
            else:
                for job, priority in items:
                    await broker.push_on(queue, job, priority=priority)
        return ids

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
