"""Remote workflow turns (T14, docs/spec.md), decisions (T15), step events (T16) and the
store-less tenant protocol (T18–T23): start-run and run-request queues to the control plane,
replies and tenant events through per-instance inboxes (see
:mod:`durable_trio._transport._inboxes`)."""

from __future__ import annotations

import contextvars
import time
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, Protocol

import trio
from trio_util import periodic, run_and_cancelling

from .._codec import decode_envelope
from .._errors import BrokerError, DurableTrioError, JobError, PayloadError
from .._wire import (
    ControlMessage,
    DecisionStatus,
    InboxRegistration,
    JobKind,
    RunReply,
    RunRequest,
    StartRunMessage,
    StepError,
    StepEvent,
    StepHeartbeat,
    TenantEvent,
    WorkerAdvertisement,
    WorkflowDecision,
    WorkflowTask,
)
from ._inboxes import ForwardingKeyStore, InboxRegistry

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .._naming import QueueNames
    from ..brokers import ClaimedJob
    from ._adaptive import ConcurrencyController
    from ._claims import Level
    from ._options import TransportOptions
    from ._ports import KeyStore, TransportBackend

__all__ = ["RemoteProtocols"]


class Carrier(Protocol):
    """What the remote layer uses of a transport: its names, options and backend, and its
    generic consume/publish surface. The transport's internal hooks it needs are handed to
    :class:`RemoteProtocols` as callables (see its constructor), not read off the carrier."""

    @property
    def names(self) -> QueueNames: ...
    @property
    def options(self) -> TransportOptions: ...
    @property
    def backend(self) -> TransportBackend: ...
    def consume(
        self,
        kind: JobKind,
        queue: str,
        handler: Callable[[Any], Awaitable[None]],
        *,
        concurrency: int = 1,
        backoff_max: int | None = None,
        inbox: bool = False,
    ) -> None: ...
    def consume_jobs(self, queue: str, on_job: Callable[[ClaimedJob], Awaitable[None]]) -> None: ...
    async def publish(
        self, kind: JobKind, queue: str, payload: Any, *, priority: int | None = None
    ) -> str: ...


#: ``(correlation id, requester)`` of the request the current task is handling.
_CURRENT_ROUTE: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "durable_trio_reply_route", default=None
)


class RemoteProtocols:
    """The remote protocols, as ``transport.remote``: step heartbeats and control messages
    (T17), workflow turns and decisions, step events, and the tenant protocol (start-run, run
    requests and replies, tenant events, the inbox registry). Built on the transport's generic
    surface: :meth:`QueueTransport.consume`, :meth:`QueueTransport.consume_jobs`,
    :meth:`QueueTransport.publish` and its names; its own tasks (the registry's announcements
    and janitor) live in the inboxes level of the transport's tree.

    Args:
        transport: the :class:`Carrier` (the transport).
        controller: the transport's concurrency controller (a turn counts as in-flight work).
        inboxes: the tree level the registry's tasks run in.
        report: the transport's error report.
        check_open: raises ``TransportClosed`` once the transport is closing.
        serve_turns: ``serve_turns(name, serve)`` serves the workflow turns on the task loop of
            ``name``'s routing token (T14: a turn shares its token's task loop).
        adopt_liveness_store: ``adopt_liveness_store(keys)`` writes a store-less pod's
            liveness through ``keys`` (T22).
        forget_pusher: ``forget_pusher(queue)`` drops the push coalescer of a drained queue.
    """

    def __init__(
        self,
        transport: Carrier,
        *,
        controller: ConcurrencyController,
        inboxes: Level,
        report: Callable[[BaseException], None],
        check_open: Callable[[], None],
        serve_turns: Callable[[str, Callable[[Any], Awaitable[None]]], None],
        adopt_liveness_store: Callable[[KeyStore], None],
        forget_pusher: Callable[[str], None],
    ) -> None:
        self._transport = transport
        self._controller = controller
        self._inboxes = inboxes
        self._report = report
        self._check_open = check_open
        self._serve_turns = serve_turns
        self._adopt_liveness_store = adopt_liveness_store
        self._forget_pusher = forget_pusher
        options = self._options = transport.options
        self._names = transport.names
        self.instance_id = options.instance_id
        backend = transport.backend
        self._broker = backend.broker
        self._workflow_turns: dict[str, Callable[[WorkflowTask], Awaitable[WorkflowDecision]]] = {}
        self._decision_handlers: list[Callable[[WorkflowDecision], Awaitable[None]]] = []
        self._start_run_handler: Callable[[StartRunMessage], Awaitable[None]] | None = None
        self._run_request_handler: Callable[[RunRequest], Awaitable[None]] | None = None
        self._run_reply_handler: Callable[[RunReply], Any] | None = None
        self._tenant_handlers: dict[str, list[Callable[[TenantEvent], Any]]] = {}
        self._reply_routes: dict[str, list[str]] = {}
        """correlation id -> the requesters whose request with that id is being handled"""
        self._replies_loop = False
        self._events_loop = False
        self._registrations_loop = False
        self._publish_lock = trio.Lock()  # tenant events leave one publisher in publish order
        self._registry = InboxRegistry(
            names=self._names,
            instance=options.instance_id,
            keys=backend.keys,
            ttl=options.inbox_ttl,
            cache=options.tenant_subscribers_cache,
            announce=self._announce,
            drain=self._drain_queue,
            report=self._report,
        )

    async def _announce(self, kind: JobKind, payload: Any) -> None:
        await self._transport.publish(kind, self._names.registrations, payload)

    # ------------------------------------------------------------------ heartbeats, control

    async def heartbeat(self, beat: StepHeartbeat) -> None:
        """step worker -> engine: a long step is alive."""
        await self._transport.publish(JobKind.HEARTBEAT, self._names.heartbeats, beat)

    def on_heartbeat(self, handler: Callable[[StepHeartbeat], Awaitable[None]]) -> None:
        """engine side: consume step heartbeats."""
        self._transport.consume(JobKind.HEARTBEAT, self._names.heartbeats, handler)

    async def send_control(self, message: ControlMessage) -> None:
        """Best-effort, POINT-TO-POINT control (T17): exactly one consumer takes each message.
        It is not a broadcast: with several consumers, only one of them sees it."""
        await self._transport.publish(JobKind.CONTROL, self._names.control, message)

    def on_control(self, handler: Callable[[ControlMessage], Awaitable[None]]) -> None:
        """Consume control messages (T17: point-to-point, best-effort)."""
        self._transport.consume(JobKind.CONTROL, self._names.control, handler)

    # ------------------------------------------------------------------ workflow turns (T14)

    async def dispatch_workflow_task(self, task: WorkflowTask) -> str:
        """engine -> workflow worker: a turn on the workflow's routing-token task queue."""
        return await self._transport.publish(
            JobKind.WORKFLOW, self._names.task_queue(task.group), task, priority=task.priority
        )

    def handle_workflow(
        self, name: str, turn: Callable[[WorkflowTask], Awaitable[WorkflowDecision]]
    ) -> None:
        """Serve turns of workflow ``name``. Shares the step task loop of ``name``'s routing
        token (the queue :meth:`dispatch_workflow_task` targets) and tells the two kinds apart
        by shape. An unknown workflow or a raising turn yields a ``failed`` decision; the turn
        heartbeats while it runs; a failed push of the decision redelivers the job."""
        self._check_open()
        self._workflow_turns[name] = turn
        self._serve_turns(name, self._serve_workflow_turn)

    async def _serve_workflow_turn(self, task: WorkflowTask) -> None:
        controller = self._controller
        controller.on_start()
        started = trio.current_time()
        try:
            decision = await self._run_turn(task)
        finally:
            # a turn counts as in-flight work, never as a step latency (T6)
            controller.on_settle(started, trio.current_time(), step=False)
        await self._transport.publish(JobKind.DECISION, self._names.decisions, decision)

    async def _run_turn(self, task: WorkflowTask) -> WorkflowDecision:
        turn = self._workflow_turns.get(task.workflow)
        if turn is None:
            error = StepError(f"no workflow registered for {task.workflow!r}", "no_workflow", False)
            return WorkflowDecision(task.task_id, task.run_id, DecisionStatus.FAILED, error=error)
        decision: WorkflowDecision | None = None
        failure: Exception | None = None
        async with run_and_cancelling(self._beat_turn, task):
            try:
                decision = await turn(task)
            except Exception as exc:  # caught inside: the nursery must not wrap it
                failure = exc
        if failure is not None:
            self._report(
                JobError(
                    f"workflow turn {task.workflow!r} raised {failure!r}",
                    queue=self._names.task_queue(task.group),
                    job_id=task.task_id,
                )
            )
            error = StepError(f"{type(failure).__name__}: {failure}", "turn_failed", True)
            return WorkflowDecision(task.task_id, task.run_id, DecisionStatus.FAILED, error=error)
        assert decision is not None
        return decision

    async def _beat_turn(self, task: WorkflowTask) -> None:
        """A running turn heartbeats, so the engine can tell a long turn from a dead one."""
        # aclosing: the turn's end cancels this in the body as well as in periodic's sleep.
        async with aclosing(periodic(self._options.turn_heartbeat_interval)) as ticks:
            async for _, since_last in ticks:
                if since_last is None:
                    continue  # periodic's first iteration is at once; the first beat is not
                beat = StepHeartbeat(
                    task.run_id, f"turn:{task.task_id}", 1, time.time(), {"workflow": task.workflow}
                )
                try:
                    await self.heartbeat(beat)
                except (BrokerError, DurableTrioError) as exc:
                    self._report(exc)

    # ------------------------------------------------------------------ decisions (T15)

    def on_decision(self, handler: Callable[[WorkflowDecision], Awaitable[None]]) -> None:
        """engine <- workflow worker: ONE loop per transport; every registered handler sees
        every decision, concurrently; all settle before a failure redelivers the decision."""
        self._check_open()
        self._decision_handlers.append(handler)
        if len(self._decision_handlers) > 1:
            return
        self._transport.consume(
            JobKind.DECISION,
            self._names.decisions,
            self._fan_out,
            concurrency=self._options.result_concurrency,
            backoff_max=1,
        )

    async def _fan_out(self, decision: WorkflowDecision) -> None:
        failures: list[Exception] = []

        async def one(handler: Callable[[WorkflowDecision], Awaitable[None]]) -> None:
            try:
                await handler(decision)
            except Exception as exc:
                failures.append(exc)

        async with trio.open_nursery() as nursery:
            for handler in list(self._decision_handlers):
                nursery.start_soon(one, handler)
        for failure in failures[1:]:
            self._report(failure)
        if failures:
            raise failures[0]

    # ------------------------------------------------------------------ step events (T16)

    async def dispatch_step_event(self, event: StepEvent) -> None:
        """workflow worker -> engine: point-to-point, so ONE engine instance checkpoints it."""
        await self._transport.publish(JobKind.STEP_EVENT, self._names.step_events, event)

    def on_step_event(self, handler: Callable[[StepEvent], Awaitable[None]]) -> None:
        """engine: consume step events. A second call swaps the handler."""
        self._transport.consume(JobKind.STEP_EVENT, self._names.step_events, handler)

    # ------------------------------------------------------------------ tenant pods (T18-T20)

    async def dispatch_start_run(self, message: StartRunMessage) -> None:
        """tenant pod -> control plane, stamped with this instance as the reply target (T18)."""
        self._ensure_replies_loop()
        stamped = StartRunMessage(
            message.run_id, message.workflow, message.input, message.tenant, self.instance_id
        )
        await self._transport.publish(JobKind.START_RUN, self._names.start_run, stamped)

    async def dispatch_run_request(self, request: RunRequest) -> None:
        """tenant pod -> control plane, stamped with this instance as the reply target (T18)."""
        self._ensure_replies_loop()
        stamped = RunRequest(
            request.request_id,
            request.action,
            request.run_id,
            request.tenant,
            request.data,
            self.instance_id,
        )
        await self._transport.publish(JobKind.RUN_REQUEST, self._names.run_request, stamped)

    def on_start_run(self, handler: Callable[[StartRunMessage], Awaitable[None]]) -> None:
        """control plane: consume start-run messages (a reply inside ``handler`` goes to the
        sender: the route is held while it runs, T19)."""
        self._check_open()
        self._ensure_registrations_loop()
        self._start_run_handler = handler
        self._transport.consume(
            JobKind.START_RUN,
            self._names.start_run,
            self._routed_start,
            concurrency=self._options.result_concurrency,
        )

    def on_run_request(self, handler: Callable[[RunRequest], Awaitable[None]]) -> None:
        """control plane: consume run requests; reply with :meth:`publish_run_reply` while
        handling one (T19)."""
        self._check_open()
        self._ensure_registrations_loop()
        self._run_request_handler = handler
        self._transport.consume(
            JobKind.RUN_REQUEST,
            self._names.run_request,
            self._routed_request,
            concurrency=self._options.result_concurrency,
        )

    async def _routed_start(self, message: StartRunMessage) -> None:
        assert self._start_run_handler is not None
        await self._with_route(message.run_id, message.reply_to, self._start_run_handler, message)

    async def _routed_request(self, request: RunRequest) -> None:
        assert self._run_request_handler is not None
        await self._with_route(
            request.request_id, request.reply_to, self._run_request_handler, request
        )

    async def _with_route(
        self,
        correlation: str,
        reply_to: str | None,
        handler: Callable[[Any], Awaitable[None]],
        message: Any,
    ) -> None:
        if reply_to is None:
            await handler(message)
            return
        # The route is held twice: in the handler's own context (exact, even when two pods'
        # requests share a correlation id, as two tenants' start of "order-1" do), and in a
        # table for a reply published from another task.
        routes = self._reply_routes.setdefault(correlation, [])
        routes.append(reply_to)
        token = _CURRENT_ROUTE.set((correlation, reply_to))
        try:
            await handler(message)
        finally:
            _CURRENT_ROUTE.reset(token)
            routes.remove(reply_to)
            if not routes:
                del self._reply_routes[correlation]

    async def publish_run_reply(self, reply: RunReply) -> None:
        """control plane -> the pod that sent the request: onto ITS reply inbox (T19). A reply
        with no known requester (or, published outside the request's handler, with several
        requesters of the same id in flight) is dropped and reported."""
        current = _CURRENT_ROUTE.get()
        if current is not None and current[0] == reply.request_id:
            owner: str | None = current[1]
        else:
            owners = set(self._reply_routes.get(reply.request_id, ()))
            owner = owners.pop() if len(owners) == 1 else None
        if owner is None:
            self._report(
                DurableTrioError(
                    f"dropped the run reply for {reply.request_id!r}: no requester is known for "
                    "it on this instance (reply while handling the request)"
                )
            )
            return
        queue = self._names.run_replies(owner)
        await self._transport.publish(JobKind.RUN_REPLY, queue, reply)
        self._registry.note_push(queue, owner)

    def on_run_reply(self, handler: Callable[[RunReply], Any]) -> None:
        """tenant pod: consume this instance's reply inbox (T20). A throwing listener never
        redelivers a reply (it is reported)."""
        self._run_reply_handler = handler
        self._ensure_replies_loop()

    def _ensure_replies_loop(self) -> None:
        """Started on the first request, so no reply is left behind; never deferred, never
        backed off (the reply is on the critical path of every proxied call)."""
        if self._replies_loop:
            return
        self._check_open()
        self._replies_loop = True
        self._registry.attach(self._inboxes.nursery)
        self._registry.activate()
        self._transport.consume(
            JobKind.RUN_REPLY,
            self._names.run_replies(self.instance_id),
            self._deliver_reply,
            backoff_max=1,
            inbox=True,
        )

    async def _deliver_reply(self, reply: RunReply) -> None:
        handler = self._run_reply_handler
        if handler is None:
            return
        try:
            outcome = handler(reply)
            if hasattr(outcome, "__await__"):
                await outcome
        except Exception as exc:  # never redeliver a reply for a throwing listener
            self._report(exc)

    # ------------------------------------------------------------------ tenant events (T21-T23)

    async def publish_tenant_event(self, event: TenantEvent) -> None:
        """control plane -> the inbox of every live subscriber of ``event.tenant`` (none:
        nothing is pushed). Publishes are serialized: each subscriber sees one publisher's
        events in publish order (T21)."""
        async with self._publish_lock:
            if not self._registrations_loop:
                # The first control-plane surface used: record what was announced before this
                # instance listened (inline, before the loop exists to race it), or the first
                # events would miss every subscriber.
                await self._catch_up_registrations()
                self._ensure_registrations_loop()
            for owner in await self._registry.subscribers_of(event.tenant):
                queue = self._names.tenant_events(owner)
                await self._transport.publish(JobKind.TENANT_EVENT, queue, event)
                self._registry.note_push(queue, owner)

    def on_tenant_event(
        self, tenant: str, handler: Callable[[TenantEvent], Any]
    ) -> Callable[[], None]:
        """tenant pod: receive ``tenant``'s events. Announces the subscription (again every
        ``inbox_ttl / 3``) and consumes this instance's event inbox (never deferred). Returns
        an unsubscribe; the last one for a tenant withdraws the subscription, and the inbox
        keeps draining what was pushed before."""
        self._check_open()
        self._tenant_handlers.setdefault(tenant, []).append(handler)
        self._registry.attach(self._inboxes.nursery)
        self._registry.subscribe(tenant)
        if not self._events_loop:
            self._events_loop = True
            self._transport.consume(
                JobKind.TENANT_EVENT,
                self._names.tenant_events(self.instance_id),
                self._deliver_event,
                inbox=True,
            )

        def unsubscribe() -> None:
            handlers = self._tenant_handlers.get(tenant, [])
            if handler in handlers:
                handlers.remove(handler)
                if not handlers:
                    del self._tenant_handlers[tenant]
                    self._registry.unsubscribe(tenant)

        return unsubscribe

    async def _deliver_event(self, event: TenantEvent) -> None:
        # T23: only tenants this instance subscribed to reach a handler, whatever arrives.
        for handler in list(self._tenant_handlers.get(event.tenant, ())):
            try:
                outcome = handler(event)
                if hasattr(outcome, "__await__"):
                    await outcome
            except Exception as exc:  # never redeliver (and so reorder) an event
                self._report(exc)

    # ------------------------------------------------------------------ registrations (T22)

    def _ensure_registrations_loop(self) -> None:
        """control plane: record the registrations and advertisements instances announce, and
        run the janitor. Started by the first control-plane surface used."""
        if self._registrations_loop:
            return
        self._check_open()
        self._registrations_loop = True
        self._registry.attach(self._inboxes.nursery)
        self._transport.consume_jobs(self._names.registrations, self._on_registration)
        if self._options.inbox_sweep_interval > 0:
            self._inboxes.nursery.start_soon(
                self._registry.janitor_forever, self._options.inbox_sweep_interval
            )

    async def _catch_up_registrations(self, most: int = 1000) -> None:
        """Record the registrations waiting on the queue now, inline."""
        broker, queue = self._broker, self._names.registrations
        for _ in range(most):
            job = await broker.pop_from(queue, worker=self.instance_id)
            if job is None:
                return
            try:
                await self._on_registration(job)
            except PayloadError as exc:
                self._report(exc)
                await broker.fail_job(job.lease, queue, f"bad input: {exc}")
                continue
            await broker.complete_job(job.lease, queue)

    async def _on_registration(self, job: ClaimedJob) -> None:
        envelope = decode_envelope(job.data, max_bytes=self._options.max_payload_bytes)
        if isinstance(envelope.payload, InboxRegistration):
            await self._registry.record(envelope.payload)
        elif isinstance(envelope.payload, WorkerAdvertisement):
            await self._registry.record_advertisement(envelope.payload)
        else:
            raise PayloadError(f"a {envelope.kind.value!r} job does not belong on this queue")

    def use_tenant_role(self) -> None:
        """Declare this transport a store-less tenant pod: with no key store of its own, its
        worker advertisements (liveness, descriptors) are forwarded to the control plane, which
        records them in its store (T22). Call before serving steps."""
        self._adopt_liveness_store(ForwardingKeyStore(self._announce))

    # ------------------------------------------------------------------ close, phase 7

    async def close_inboxes(self) -> None:
        """Withdraw this instance's registration, then drop what is left in its own inboxes:
        replies and events addressed to a process going away have no one else to go to."""
        await self._registry.withdraw()
        own = []
        if self._replies_loop:
            own.append(self._names.run_replies(self.instance_id))
        if self._events_loop:
            own.append(self._names.tenant_events(self.instance_id))
        for queue in own:
            await self._drain_queue(queue, 1000)

    async def _drain_queue(self, queue: str, most: int) -> bool:
        """Pop and complete up to ``most`` jobs of ``queue`` without running them. True once
        the queue came back empty."""
        broker = self._broker
        for _ in range(most):
            job = await broker.pop_from(queue, worker=self.instance_id)
            if job is None:
                # its owner went away: nothing more goes there
                self._forget_pusher(queue)
                return True
            await broker.complete_job(job.lease, queue)
        return False
