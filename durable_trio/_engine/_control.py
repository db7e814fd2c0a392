"""The engine as the control plane of store-less tenant pods (T18–T23, docs/spec.md).

``open_engine(..., serve_tenants=True)`` makes the engine consume the start-run and
run-request queues and publish its tenants' run events:

- a tenant's runs are stored under ``"{tenant}/{runId}"``: every request is resolved inside
  the requester's tenant, so a pod can neither see nor touch another tenant's runs (T23);
- ``StartRunMessage`` starts the run (idempotent by run id) and replies ``{runId, status}``;
- ``RunRequest`` actions: ``status`` (alias ``result``): the run's status and, once it ended,
  its output or error; ``history``: its checkpoints; ``cancel``: cancel it;
- run lifecycle events (``run.started``, ``run.completed``, ``run.failed``,
  ``run.cancelled``) of the runs this engine starts or settles are published as
  :class:`~durable_trio.TenantEvent`\\ s to the tenant's live subscribers, in order.

A failing request (unknown workflow, bad input, no such run) gets a reply with ``ok=False``
and an error whose ``code`` says why; it never fails the request job.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

import trio

from .._errors import BrokerError, DurableTrioError, PayloadError, TransportClosed
from .._wire import RunReply, StepError, TenantEvent
from ._errors import EngineClosed, EngineError, RunNotFound, UnknownWorkflow
from ._records import step_to_json

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .._transport._facade import QueueTransport
    from .._wire import RunRequest, StartRunMessage
    from ._records import RunRecord, StepRecord
    from ._services import DriverServices

__all__ = ["ControlPlane", "RunOperations", "run_view", "scoped_run_id", "split_run_id"]

#: Tenant events buffered between the engine and the publisher (overflow is reported).
_EVENT_BUFFER = 10_000


def scoped_run_id(tenant: Any, run_id: Any) -> str:
    """The stored id of ``tenant``'s run ``run_id``.

    Raises:
        PayloadError: not a usable tenant name or run id.
    """
    if not isinstance(tenant, str) or not tenant or "/" in tenant:
        raise PayloadError(f"a tenant is a non-empty name without '/', got {tenant!r}")
    if not isinstance(run_id, str) or not run_id:
        raise PayloadError(f"a run id is a non-empty string, got {run_id!r}")
    return f"{tenant}/{run_id}"


def split_run_id(stored: str) -> tuple[str, str] | None:
    """``(tenant, run_id)`` of a tenant's run, ``None`` for a run no tenant started."""
    tenant, sep, run_id = stored.partition("/")
    return (tenant, run_id) if sep and tenant and run_id else None


def run_view(record: RunRecord, run_id: str) -> dict[str, Any]:
    """What a pod sees of a run (JSON): the ids are the pod's own."""
    view: dict[str, Any] = {
        "runId": run_id,
        "workflow": record.workflow,
        "status": record.status.value,
        "createdAt": record.created_at,
        "updatedAt": record.updated_at,
    }
    if record.output is not None:
        view["output"] = record.output
    if record.error is not None:
        view["error"] = record.error
    return view


def _error_reply(request_id: str, exc: BaseException) -> RunReply:
    if isinstance(exc, RunNotFound):
        code = "not_found"
    elif isinstance(exc, UnknownWorkflow):
        code = "unknown_workflow"
    elif isinstance(exc, PayloadError):
        code = "bad_request"
    else:
        code = type(exc).__name__
    return RunReply(request_id, False, error=StepError(str(exc), code, False))


class RunOperations(Protocol):
    """The engine's public run API, as far as the control plane serves it to pods."""

    async def start(self, workflow: str, input: Any = None, *, run_id: str | None = None) -> str:
        """Start a run (idempotent by ``run_id``); returns its id."""

    async def get(self, run_id: str) -> RunRecord:
        """The run as stored (raises ``RunNotFound``)."""

    async def history(self, run_id: str) -> list[StepRecord]:
        """The run's checkpoints (raises ``RunNotFound``)."""

    async def cancel(self, run_id: str, *, reason: str = "cancelled") -> bool:
        """Cancel the run; whether this call cancelled it."""

    async def signal(self, run_id: str, name: str, payload: Any = None) -> int:
        """Send a signal to the run; its sequence number (issue 18)."""

    async def events(self, run_id: str) -> dict[str, Any]:
        """The run's latest events (issue 18)."""


class ControlPlane:
    """Serves tenant pods for one engine (see the module docstring).

    Args:
        services: the engine's services (counters, error hook, run listeners).
        runs: the engine's run API (the engine itself).
        transport: the engine's transport (the pods' queues).
    """

    def __init__(
        self, services: DriverServices, runs: RunOperations, transport: QueueTransport
    ) -> None:
        self.services = services
        self.runs = runs
        self.transport = transport
        self._send, self._receive = trio.open_memory_channel[TenantEvent](_EVENT_BUFFER)

    def attach(self, nursery: trio.Nursery) -> None:
        transport = self.transport
        transport.remote.on_start_run(self._on_start_run)
        transport.remote.on_run_request(self._on_run_request)
        self.services.add_listener(self._on_run_event)
        nursery.start_soon(self._publish_forever)

    async def _reply(self, reply: RunReply) -> None:
        await self.transport.remote.publish_run_reply(reply)

    async def _serve(self, correlation: str, answer: Callable[[], Awaitable[Any]]) -> None:
        """Reply to one pod request with what ``answer`` computes, or with why it failed."""
        self.services.count("tenant_requests")
        try:
            data = await answer()
        except (BrokerError, TransportClosed):
            raise  # infrastructure: the message is redelivered
        except EngineClosed as exc:  # closing: handed back, for this engine or another
            raise TransportClosed("the engine is closing") from exc
        except (DurableTrioError, PayloadError) as exc:
            await self._reply(_error_reply(correlation, exc))
            return
        await self._reply(RunReply(correlation, True, data))

    async def _on_start_run(self, message: StartRunMessage) -> None:
        await self._serve(message.run_id, lambda: self._start(message))

    async def _on_run_request(self, request: RunRequest) -> None:
        await self._serve(request.request_id, lambda: self._answer(request))

    async def _start(self, message: StartRunMessage) -> Any:
        runs = self.runs
        stored = scoped_run_id(message.tenant, message.run_id)
        await runs.start(message.workflow, message.input, run_id=stored)
        return run_view(await runs.get(stored), message.run_id)

    async def _answer(self, request: RunRequest) -> Any:
        runs = self.runs
        stored = scoped_run_id(request.tenant, request.run_id)
        action = request.action
        if action in ("status", "result"):
            return run_view(await runs.get(stored), str(request.run_id))
        if action == "history":
            return [step_to_json(r) for r in await runs.history(stored)]
        if action == "cancel":
            reason = request.data.get("reason") if isinstance(request.data, dict) else None
            cancelled = await runs.cancel(stored, reason=str(reason or "cancelled by tenant"))
            view = run_view(await runs.get(stored), str(request.run_id))
            view["cancelled"] = cancelled
            return view
        if action == "signal":  # issue 18: {"name": ..., "payload": ...}
            data = request.data if isinstance(request.data, dict) else {}
            name = data.get("name")
            if not isinstance(name, str):
                raise PayloadError("a signal request names its signal: data.name (a str)")
            return {"seq": await runs.signal(stored, name, data.get("payload"))}
        if action == "events":
            return await runs.events(stored)
        raise PayloadError(
            f"unknown run request action {action!r} "
            "(status, result, history, cancel, signal, events)"
        )

    # ------------------------------------------------------------------ tenant run events

    def _on_run_event(self, kind: str, run: RunRecord) -> None:
        split = split_run_id(run.run_id)
        if split is None:
            return
        tenant, run_id = split
        event = TenantEvent(tenant, f"run.{kind}", run_id, time.time(), run_view(run, run_id))
        try:
            self._send.send_nowait(event)
        except trio.WouldBlock:
            self.services.report(
                EngineError(f"dropped tenant event {event.kind} of {run.run_id!r}: buffer full")
            )

    async def _publish_forever(self) -> None:
        """One publisher, in order: each subscriber sees this engine's events in the order the
        runs moved (T21)."""
        services = self.services
        transport = self.transport
        async for event in self._receive:

            async def publish(event: TenantEvent = event) -> None:
                await transport.remote.publish_tenant_event(event)

            # A payload that cannot go out is reported and skipped; the broker is retried.
            try:
                await services.guard(publish, "publishing a tenant event")
            except PayloadError as exc:
                services.report(exc)
                continue
            services.count("tenant_events")
