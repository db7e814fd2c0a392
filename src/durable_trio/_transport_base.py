"""The state of a queue transport and what all its parts use: the task groups of its
nursery tree, claims, producers and the error hook. The behaviours live in mixins, one
module each: ``_consume`` (poll loops, job workers, finalize), ``_leases`` (renewal, the
sweep, poison), ``_health`` (liveness and health), ``_remote`` (remote workflows, tenant
pods); ``_transport`` puts them together with the close."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs
import trio

from ._adaptive import ConcurrencyController
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
from ._producers import Producers
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
        self._producers = Producers(
            broker, self._names, options, check_open=self._check_open_for_producers
        )
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
            completer=self._producers.completer,
            finisher=self._producers.finisher,
            batched=self._producers.batched,
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

    def _forget_pusher(self, queue: str) -> None:
        self._producers.forget_pusher(queue)

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
        return await self._producers.push(
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
        return await self._producers.push_tasks(
            [(self.task_queue(task.routing_group), task) for task in tasks]
        )

    async def publish_result(self, result: StepResult) -> str:
        """step worker -> engine: publish a step result (the transport does this for handlers)."""
        return await self._producers.push(self._names.results, JobKind.RESULT, result)

    async def heartbeat(self, beat: StepHeartbeat) -> None:
        """step worker -> engine: a long step is alive."""
        await self._producers.push(self._names.heartbeats, JobKind.HEARTBEAT, beat)

    async def send_control(self, message: ControlMessage) -> None:
        """Best-effort, POINT-TO-POINT control (T17): exactly one consumer takes each message.
        It is not a broadcast: with several consumers, only one of them sees it."""
        await self._producers.push(self._names.control, JobKind.CONTROL, message)
