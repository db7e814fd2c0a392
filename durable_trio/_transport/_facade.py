"""The queue transport: a facade over the parts that carry tasks, results and control over a
broker, each owning its state and its tasks:

- ``Producers`` (``_producers``): job ids, envelopes, pushes coalesced per queue;
- ``ClaimTable`` (``_claims``): every claim held, and the one owner of its state changes;
- ``Consumers`` (``_consumers``): every poll loop, with its pop scope;
- ``JobRunner`` (``_jobs``): one job worker per running handler, with its finalize;
- ``StepServer`` (``_steps``): a task loop's jobs, a step's result;
- ``LeaseKeeper`` (``_renewal``): renewal, lost leases; ``Sweeper`` (``_sweep``): the reclaim
  sweep and the poison bridge;
- ``Liveness`` and ``ConcurrencyController``: the worker's keys and its limit;
- ``RemoteProtocols`` (``_remote``, as :attr:`QueueTransport.remote`): the remote protocols
  (step heartbeats and control messages among them);
- ``TransportHealth`` (``_health``, as :attr:`QueueTransport.health`): the health reads.

Their tasks run in one nursery tree, built by ``_tree``, whose nesting is the close order of
T24 (docs/spec.md; in depth: docs/close.md).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, cast

import trio

from .._arguments import check_seconds, check_task, check_tasks
from .._errors import ConfigError, TransportClosed
from .._failures import one_exception, raise_bare, report_through
from .._naming import QueueNames
from .._wire import JobKind, RemoteTask, StepResult
from ..brokers import ClaimedJob, SupportsRateLimits, SupportsRecovery, SupportsRenewal
from ._adaptive import ConcurrencyController
from ._claims import ClaimTable, Loop
from ._consumers import Consumers
from ._dead_workers import DeadWorkers, descriptor_fields, renew_period
from ._health import TransportHealth
from ._jobs import JobRunner
from ._liveness import Liveness, Vitals
from ._options import (
    DEFAULT_RENEWING_STALLED_THRESHOLD,
    DEFAULT_STALLED_THRESHOLD,
    TransportOptions,
)
from ._producers import Producers
from ._remote import RemoteProtocols
from ._renewal import LeaseKeeper
from ._slots import Slots
from ._steps import StartGate, StepHandler, StepServer
from ._sweep import Sweeper
from ._tree import TransportTree

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from ._ports import KeyStore, TransportBackend
    from ._statistics import TransportStatistics


__all__ = ["QueueTransport", "open_queue_transport", "stalled_threshold_of"]


ResultHandler = Callable[[StepResult], Awaitable[None]]


class QueueTransport:
    """Carries step tasks and results (and, through :attr:`remote`, heartbeats, control
    messages and the remote protocols) over a queue broker.

    A facade over its parts, each owning its state and its tasks (see the module docstring);
    the remote protocols are :attr:`remote`, the health reads :attr:`health`, the queue names
    and routing tokens :attr:`names`. Open one with :func:`open_queue_transport`; do not
    construct it directly.
    """

    def __init__(self, backend: TransportBackend, options: TransportOptions) -> None:
        self._backend = backend
        self._broker = backend.broker
        self._options = options
        self._names = QueueNames(options.namespace, options.partition)
        self._report_hook = options.on_error
        broker = self._broker
        self._can_renew = isinstance(broker, SupportsRenewal)
        self._can_recover = isinstance(broker, SupportsRecovery)
        self._producers = Producers(
            broker, self._names, options, check_open=self._check_open_for_producers
        )
        if options.stalled_threshold is not None:
            self._stalled_threshold = options.stalled_threshold
        elif self._can_renew:
            self._stalled_threshold = DEFAULT_RENEWING_STALLED_THRESHOLD
        else:
            self._stalled_threshold = DEFAULT_STALLED_THRESHOLD
        # Dead-worker reclaim (issue 30, item 9): renewals every third of its threshold, so only
        # a silent worker's claims grow that old; it needs liveness keys to tell who is dead.
        self._dead_threshold: float | None = None
        dead = options.dead_worker_threshold
        if (
            dead is not None
            and self._can_renew
            and backend.keys is not None
            and dead < self._stalled_threshold
        ):
            self._dead_threshold = dead
        self._renew_every = renew_period(self._stalled_threshold, self._dead_threshold)
        self._controller = ConcurrencyController(options.concurrency, on_limit=self._move_limit)
        self._task_slots = Slots(self._controller.limit, isolate=options.isolate_suspects)
        self._result_slots = Slots(options.result_concurrency)
        self._task_loops: set[str] = set()
        self._task_queues: set[str] = set()
        self._started_at = time.time()
        self._vitals = Vitals(
            self._controller,
            None if backend.keys is None else self._new_liveness(backend.keys),
            cleanup_timeout=options.cleanup_timeout,
        )
        self._max_payload_bytes = options.max_payload_bytes
        self._claims = ClaimTable()
        self._lease_keeper = LeaseKeeper(
            cast("SupportsRenewal", broker) if self._can_renew else None,
            self._claims,
            self._controller,
            period=self._renew_every,
            cancel_on_lost_lease=options.cancel_on_lost_lease,
            report=self._report,
            cleanup_timeout=options.cleanup_timeout,
        )
        self._steps = StepServer(
            self._producers,
            self._controller,
            options,
            results=self._names.results,
            task_queue=self._names.task_queue,
            publish_result=self.publish_result,
            report=self._report,
            instance_id=options.instance_id,
            lost_at=self._claims.lost_at,
            publish_beat=lambda beat: self.remote.heartbeat(beat),
            spawn=lambda sender: self._runner.level.nursery.start_soon(sender),
        )
        self._runner = JobRunner(
            broker,
            options,
            self._claims,
            completer=self._producers.completer,
            finisher=self._producers.finisher,
            batched=self._producers.batched,
            answer_bad_task=self._steps.answer_bad_task,
            report=self._report,
            finalize_retry_for=self._stalled_threshold,
            results_queue=self._names.results,
        )
        self._consumers = Consumers(
            broker,
            options,
            self._runner,
            self._claims,
            vitals=self._vitals,
            report=self._report,
        )
        self._sweeper: Sweeper | None = None
        if self._can_recover and options.stalled_check_interval > 0:
            self._sweeper = Sweeper(
                backend,
                self._names,
                options,
                stalled_threshold=self._stalled_threshold,
                consumed=self._consumers.consumed,
                inboxes=self._consumers.inbox_queues,
                task_queues=self._task_queues,
                publish_result=self.publish_result,
                result_job=lambda result: self._producers.new_job(JobKind.RESULT, result),
                answer_bad_task=self._steps.answer_bad_task,
                report=self._report,
                dead_workers=(
                    None
                    if self._dead_threshold is None or backend.keys is None
                    else DeadWorkers(
                        backend.keys,
                        self._names,
                        options.instance_id,
                        dead_threshold=self._dead_threshold,
                        window=self._stalled_threshold,
                    )
                ),
            )

        self.remote = RemoteProtocols(
            self,
            controller=self._controller,
            inboxes=self._consumers.inbox_level,
            report=self._report,
            check_open=self._check_open,
            serve_turns=self._serve_turns,
            adopt_liveness_store=self._adopt_liveness_store,
            forget_pusher=self._producers.forget_pusher,
        )
        """The remote protocols: step heartbeats and control messages, workflow turns,
        decisions, step events, the tenant protocol."""
        self.health = TransportHealth(backend, self._names, options, self._controller)
        """The health reads: worker status, queue depth, group health, worker descriptors."""
        # The nursery tree: the parts' levels nested in close order (see _tree).
        self._tree = TransportTree(
            options,
            self._report,
            keeper=self._lease_keeper,
            runner=self._runner,
            consumers=self._consumers,
            vitals=self._vitals,
            sweeper=self._sweeper,
            remote=self.remote,
        )
        self._closed = self._tree.closed

    # ------------------------------------------------------------------ identity and names

    @property
    def instance_id(self) -> str:
        """This instance's id (reply target, liveness key suffix)."""
        return self._options.instance_id

    @property
    def names(self) -> QueueNames:
        """The queue names of this transport's namespace, and the routing tokens of its
        ``partition`` (T1): ``names.task_queue(group)``, ``names.token_of(group)``."""
        return self._names

    @property
    def options(self) -> TransportOptions:
        return self._options

    @property
    def backend(self) -> TransportBackend:
        return self._backend

    def statistics(self) -> TransportStatistics:
        from ._statistics import TransportStatistics  # (imported with its first use)

        return TransportStatistics(
            in_flight=self._runner.running,
            open_claims=len(self._claims),
            task_limit=self._task_slots.limit,
            duplicates=self._controller.duplicates,
            queues=tuple(self._consumers.consumed),
            closed=self._closed.is_set(),
        )

    # ------------------------------------------------------------------ shared helpers

    @property
    def _liveness(self) -> Liveness | None:
        return self._vitals.liveness

    def _adopt_liveness_store(self, keys: KeyStore) -> None:
        """A store-less tenant pod's liveness, written through ``keys`` (forwarded to the
        control plane, T22); nothing when this transport already has a liveness."""
        if self._backend.keys is not None or self._vitals.liveness is not None:
            return
        self._vitals.adopt(self._new_liveness(keys))

    def _new_liveness(self, keys: KeyStore) -> Liveness:
        """This instance's liveness keys, written to ``keys``."""
        options = self._options
        return Liveness(
            keys,
            self._names,
            options.instance_id,
            interval=options.worker_heartbeat_interval,
            status=self._controller.snapshot,
            descriptor=self._descriptor,
            report=self._report,
        )

    def _move_limit(self, limit: int) -> None:
        # A move of the limit wakes the loops waiting for a slot at once.
        self._task_slots.set_limit(limit)

    def _descriptor(self) -> dict[str, Any]:
        return {
            "instance": self.instance_id,
            "steps": sorted(self._steps.handlers),
            "startedAt": self._started_at,
            **descriptor_fields(self._renew_every),
        }

    def _check_open_for_producers(self) -> None:
        if self._closed.is_set():
            # Producers work on through the close drain (a finishing handler publishes its
            # result); only a fully closed transport refuses.
            raise TransportClosed("the transport is closed")

    def _check_open(self) -> None:
        self._consumers.check_open()

    def _report(self, exc: BaseException) -> None:
        report_through(self._report_hook, exc)

    async def dispatch(
        self, task: RemoteTask, *, delay: float = 0.0, concurrency_key: str | None = None
    ) -> str:
        """engine -> step worker: enqueue ``task`` on its routing token's task queue (T1, T3).

        ``concurrency_key``: the job's key on a queue whose fleet-wide limit holds per key
        (``@app.step(concurrency_key=...)``; the broker's ``Job.key``).

        Returns:
            The job id.

        Raises:
            PayloadTooLarge: the encoded task is over ``max_payload_bytes``.
            PayloadError: its input is not a JSON value (NaN, a set, nested deeper than
                ``MAX_JSON_DEPTH``, ...); ``path`` names where.
            BrokerError: the broker did not take it.
            TransportClosed: the transport is closed.
            TypeError, ConfigError: ``task`` is not a well-typed ``RemoteTask`` or ``delay``
                not a finite number of seconds >= 0 (at once, naming the argument).
        """
        check_task(task, "transport.dispatch")
        delay = check_seconds(delay, "transport.dispatch", "delay")
        return await self._producers.push(
            self._names.task_queue(task.routing_group),
            JobKind.TASK,
            task,
            priority=task.priority,
            delay=delay,
            key=concurrency_key,
        )

    async def dispatch_many(self, tasks: Iterable[RemoteTask]) -> list[str]:
        """Enqueue many tasks, in as few broker calls as the broker allows (one per routing
        queue on Redis and SQLite). Same errors as :meth:`dispatch`; on an error some tasks may
        have been enqueued already.

        Returns:
            The job ids, in order.
        """
        tasks = check_tasks(tasks, "transport.dispatch_many")
        return await self._producers.push_tasks(
            [(self._names.task_queue(task.routing_group), task) for task in tasks]
        )

    async def publish_result(self, result: StepResult) -> str:
        """step worker -> engine: publish a step result (the transport does this for handlers)."""
        return await self._producers.push(self._names.results, JobKind.RESULT, result)

    # ------------------------------------------------------------------ consumers

    def handle(
        self,
        name: str,
        handler: StepHandler,
        *,
        rate: SupportsRateLimits | None = None,
        gate: StartGate | None = None,
    ) -> None:
        """Serve step ``name``: ``async def handler(task: RemoteTask) -> JSON value``.

        Starts (once per routing token) the task loop of ``name``'s queue. Re-registering a
        name swaps its handler. A handler that raises yields a failed :class:`StepResult`
        (retryable unless the exception has ``retryable = False``). ``rate``: the queue's
        rate is taken before each claim. ``gate``: asked after the claim, before the handler;
        a delay it returns hands the job back for that long, attempt-neutral (a per-key rate).
        """
        self._check_open()
        self._steps.handlers[name] = handler
        if gate is None:
            self._steps.gates.pop(name, None)
        else:
            self._steps.gates[name] = gate
        self._ensure_task_loop(name, rate)

    def _ensure_task_loop(self, name: str, rate: SupportsRateLimits | None = None) -> None:
        """Start (once per routing token) the task loop shared by steps and workflow turns;
        ``rate``: the broker keeping the queue's rate limit (the loop takes starts first)."""
        queue = self._names.task_queue(name)
        if queue in self._task_loops:
            for loop in self._consumers.loops_of(queue) if rate is not None else ():
                loop.rate = rate  # (a turn of the same token started the loop first)
            return
        self._task_loops.add(queue)
        self._task_queues.add(queue)
        self._consumers.start_loop(
            Loop(
                queue,
                self._steps.on_task_job,
                self._task_slots,
                self._options.idle_backoff_max,
                token=self._names.token_of(name),
                rate=rate,
            )
        )

    def _serve_turns(self, name: str, serve: Callable[[Any], Awaitable[None]]) -> None:
        """Serve the workflow turns on the task loop of ``name``'s routing token (T14: a turn
        shares its token's task loop, told apart from a step by its kind)."""
        self._steps.turns = serve
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
        self._consumers.start_loop(Loop(queue, on_job, Slots(1), self._options.idle_backoff_max))

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

    def defer_consumers(self) -> None:
        """Park every consumer loop started from now on until :meth:`start_consumers`.
        Producers are never deferred; a process that only dispatches never looks like a worker."""
        self._consumers.defer()

    def start_consumers(self) -> None:
        """Start every parked consumer loop (and stop deferring)."""
        self._consumers.start_deferred()

    # ------------------------------------------------------------------ lifecycle

    async def _start(self, root: trio.Nursery) -> None:
        await root.start(self._tree.run)

    # ------------------------------------------------------------------ close (T24)

    async def aclose(self) -> None:
        """Close by leaving the nursery tree level by level (T24; see ``_tree``). Idempotent;
        runs to its end even if cancelled.

        1. the consumers (poll loops and the sweep) stop: no new job is taken;
        2. liveness stops and withdraws this instance's keys (bounded);
        3. running handlers finish, up to ``close_timeout``, their claims still renewed;
        4. the handlers still running are cancelled, this instance's inboxes stop;
        5. renewal stops, letting the round in flight land;
        6. every still-open claim is handed back for immediate, attempt-neutral redelivery;
        7. the inbox registration is withdrawn and this instance's own inboxes drained;
        8. the backend belongs to whoever opened it and is closed by them.

        Cancellation:
            Shielded; every phase is bounded (``close_timeout`` for phase 3,
            ``cleanup_timeout`` for each cleanup phase), so close never hangs on a dead broker.
        """
        self._consumers.begin_close()
        self._tree.close()
        if self._tree.holds_current_task():
            # Called from a handler: the close waits for the handlers, so this one returns
            # (the close goes on, and cancels it at close_timeout like any other).
            await trio.lowlevel.checkpoint()
            return
        with trio.CancelScope(shield=True):
            await self._closed.wait()


@asynccontextmanager
async def open_queue_transport(
    backend: TransportBackend, **options: Any
) -> AsyncIterator[QueueTransport]:
    """Open a queue transport over ``backend``; leaving the block closes it (T24).

    Args:
        backend: from :func:`~durable_trio.open_backend` (any ``TransportBackend``: a
            broker, a key store or ``None``, and ``check_open``).
        **options: the fields of :class:`~durable_trio.TransportOptions`: ``namespace``,
            ``concurrency``, ``result_concurrency``, ``close_timeout``, ``cleanup_timeout``,
            ``poll_interval``, ``idle_backoff_max``, ``stalled_threshold``,
            ``stalled_check_interval``, ``max_stalled_count``, ``max_job_attempts``,
            ``worker_heartbeat_interval``, ``instance_id``, ``on_error``, ``partition``,
            ``cancel_on_lost_lease``, ``max_payload_bytes``.

    Raises:
        ConfigError: an option that cannot work.
        BrokerUnavailable: ``backend`` is closed.

    Error handling:
        The block ends with one exception, never an internal exception group. The body's own
        exception leaves as it is raised. Should one of the transport's loops fail at the same
        time (a programming error, or a broker that raised something other than
        :class:`~durable_trio.BrokerError` where the transport cannot go on), that failure is
        attached to it as ``__context__`` and named in a note; without a body exception the
        loop's failure itself is raised.
    """
    try:
        validated = TransportOptions(**options)
    except TypeError as exc:
        raise ConfigError(f"open_queue_transport: {exc}") from None
    backend.check_open()
    transport = QueueTransport(backend, validated)
    # What the opening or the body raises leaves bare, not wrapped in the root nursery's group;
    # a loop's failure meanwhile is attached to it, not dropped (see _failures).
    body_error: BaseException | None = None
    background: BaseException | None = None
    try:
        async with trio.open_nursery() as root:
            try:
                await transport._start(root)
            except BaseException as exc:
                body_error = exc
                root.cancel_scope.cancel()
            else:
                try:
                    yield transport
                except BaseException as exc:
                    body_error = exc
                finally:
                    await transport.aclose()
    except BaseExceptionGroup as group:
        background = group
    error = one_exception(
        body_error, [] if background is None else [background], owner="the queue transport"
    )
    if error is not None:
        raise_bare(error)


def stalled_threshold_of(transport: QueueTransport) -> float:
    """Seconds after which a claim of ``transport``'s that nobody renews or finalizes is taken
    back (its job delivered again) by the reclaim sweep: its ``stalled_threshold`` option or
    the default for its broker. (A function, not a property: the facade's surface is pinned,
    see docs/decisions.md, "The transport's public surface".)"""
    return transport._stalled_threshold
