"""A store-less tenant pod's view of the control plane: :func:`open_tenant_client`.

The pod owns no run store (and needs no key store): it starts runs, asks about them and watches
its tenant's run events through queues alone — start-run and run-request out, replies on its
own inbox, events on its own event inbox (T18–T23, docs/spec.md). See ``docs/remote.md``.
"""

from __future__ import annotations

import uuid
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .._errors import ConfigError
from .._transport._facade import open_queue_transport
from .._wire import RunReply, RunRequest, StartRunMessage
from ._control import scoped_run_id
from ._errors import EngineError, RunCancelled, RunNotFound, UnknownWorkflow, run_failure
from ._records import RunStatus

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from .._transport._facade import QueueTransport
    from .._wire import TenantEvent
    from ..backends._backend import Backend

__all__ = ["RunView", "TenantClient", "open_tenant_client"]

_ENDED = frozenset({"run.completed", "run.failed", "run.cancelled"})


@attrs.frozen
class RunView:
    """A run as the control plane reports it to its tenant."""

    run_id: str
    workflow: str
    status: RunStatus
    output: Any = None
    error: Any = None
    created_at: float = 0.0
    updated_at: float = 0.0

    @classmethod
    def from_json(cls, data: Any) -> RunView:
        """From a reply's ``data``.

        Raises:
            EngineError: not a run view.
        """
        try:
            return cls(
                run_id=str(data["runId"]),
                workflow=str(data["workflow"]),
                status=RunStatus(data["status"]),
                output=data.get("output"),
                error=data.get("error"),
                created_at=float(data.get("createdAt", 0.0)),
                updated_at=float(data.get("updatedAt", 0.0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise EngineError(f"the control plane replied with no run view: {data!r}") from exc


class TenantClient:
    """One tenant's handle on the control plane. Open one with :func:`open_tenant_client`.

    Attributes:
        tenant: the tenant it acts for.
        transport: its queue transport (its instance id is its inbox).
    """

    def __init__(
        self,
        tenant: str,
        transport: QueueTransport,
        request_timeout: float,
        result_poll: float,
    ) -> None:
        self.tenant = tenant
        self.transport = transport
        self.request_timeout = request_timeout
        self.result_poll = result_poll
        # correlation id -> the calls waiting for its reply (two starts of one run id share it)
        self._waiting: dict[str, list[tuple[trio.Event, list[RunReply]]]] = {}
        transport.remote.on_run_reply(self._on_reply)

    def _on_reply(self, reply: RunReply) -> None:
        for arrived, box in self._waiting.get(reply.request_id, ()):
            if not box:
                box.append(reply)
                arrived.set()

    async def _ask(self, correlation: str, send: Callable[[], Any]) -> Any:
        box: list[RunReply] = []
        waiter = (trio.Event(), box)
        waiting = self._waiting.setdefault(correlation, [])
        waiting.append(waiter)
        try:
            await send()
            with trio.move_on_after(self.request_timeout):
                await waiter[0].wait()
        finally:
            waiting.remove(waiter)
            if not waiting:
                del self._waiting[correlation]
        if not box:
            raise EngineError(
                f"no reply from the control plane within {self.request_timeout} s "
                f"(is an engine with serve_tenants=True running on this namespace?)"
            )
        reply = box[0]
        if reply.ok:
            return reply.data
        error = reply.error
        message = error.message if error is not None else "the request failed"
        code = error.code if error is not None else None
        if code == "not_found":
            raise RunNotFound(message)
        if code == "unknown_workflow":
            raise UnknownWorkflow(message)
        raise EngineError(f"{code or 'error'}: {message}")

    async def start(self, workflow: str, input: Any = None, *, run_id: str | None = None) -> str:
        """Start a run of ``workflow`` for this tenant; returns its run id once the control
        plane recorded it. Idempotent by ``run_id``.

        Raises:
            UnknownWorkflow: the control plane's app does not register ``workflow``.
            EngineError: the control plane refused the run, or did not reply in time.
        """
        run_id = run_id or uuid.uuid4().hex
        scoped_run_id(self.tenant, run_id)  # a bad id fails here, not on the control plane
        message = StartRunMessage(run_id, workflow, input, self.tenant)
        await self._ask(run_id, lambda: self.transport.remote.dispatch_start_run(message))
        return run_id

    async def _request(self, action: str, run_id: str, data: Any = None) -> Any:
        request = RunRequest(uuid.uuid4().hex, action, run_id, self.tenant, data)
        return await self._ask(
            request.request_id, lambda: self.transport.remote.dispatch_run_request(request)
        )

    async def status(self, run_id: str) -> RunView:
        """The run now.

        Raises:
            RunNotFound: this tenant has no such run.
        """
        return RunView.from_json(await self._request("status", run_id))

    async def history(self, run_id: str) -> list[dict[str, Any]]:
        """The run's checkpoints (``{stepId, kind, name, status, attempt, output?, ...}``)."""
        data = await self._request("history", run_id)
        return list(data) if isinstance(data, list) else []

    async def cancel(self, run_id: str, *, reason: str = "cancelled by tenant") -> bool:
        """Cancel the run; ``False`` if it had already ended."""
        data = await self._request("cancel", run_id, {"reason": reason})
        return bool(isinstance(data, dict) and data.get("cancelled"))

    async def signal(self, run_id: str, name: str, payload: Any = None) -> int:
        """Send signal ``name`` with JSON ``payload`` to this tenant's run (issue 18); returns
        its sequence number once the control plane stored it.

        Raises:
            RunNotFound: this tenant has no such run.
            EngineError: the run has finished (``RunNotSignalable``), or a bad payload.
        """
        data = await self._request("signal", run_id, {"name": name, "payload": payload})
        return int(data["seq"]) if isinstance(data, dict) else 0

    async def events(self, run_id: str) -> dict[str, Any]:
        """The run's latest events (``ctx.set_event``), by key (issue 18)."""
        data = await self._request("events", run_id)
        return dict(data) if isinstance(data, dict) else {}

    async def result(self, run_id: str) -> Any:
        """Wait for the run to end; return its output. Woken by the tenant's run events, and
        re-asks every ``result_poll`` seconds (an event published before this pod's
        subscription was recorded is not missed). Bound it with ``trio.fail_after``.

        Raises:
            RunFailed, RunCancelled: the run failed (``RunTimedOut``: past its timeout) or
                was cancelled.
            RunNotFound: this tenant has no such run.
        """
        ended = trio.Event()

        def on_event(event: TenantEvent) -> None:
            if event.run_id == run_id and event.kind in _ENDED:
                ended.set()

        unsubscribe = self.watch(on_event)
        try:
            while True:
                view = await self.status(run_id)
                if view.status is RunStatus.COMPLETED:
                    return view.output
                if view.status is RunStatus.CANCELLED:
                    raise RunCancelled(run_id, view.error)
                if view.status is RunStatus.FAILED:
                    raise run_failure(run_id, view.error)
                with trio.move_on_after(self.result_poll):
                    await ended.wait()
        finally:
            unsubscribe()

    def watch(self, handler: Callable[[TenantEvent], Any]) -> Callable[[], None]:
        """Receive this tenant's run events (``run.started``, ``run.completed``,
        ``run.failed``, ``run.cancelled``; ``data`` is the run's view). Returns an
        unsubscribe. Events of other tenants never reach it (T23)."""
        return self.transport.remote.on_tenant_event(self.tenant, handler)


@asynccontextmanager
async def open_tenant_client(
    backend: Backend,
    tenant: str,
    *,
    namespace: str,
    request_timeout: float = 30.0,
    result_poll: float = 5.0,
    **transport_options: Any,
) -> AsyncIterator[TenantClient]:
    """Open tenant ``tenant``'s client of the control plane serving ``namespace`` (an engine
    opened with ``serve_tenants=True``; the namespace is its app's name by default).

    Args:
        backend: the shared broker (a key store is not needed: the pod is store-less).
        tenant: the tenant's name (no ``/``).
        namespace: the control plane's transport namespace.
        request_timeout: seconds to wait for a reply before raising.
        result_poll: see :meth:`TenantClient.result`.
        **transport_options: :func:`~durable_trio.open_queue_transport` options.

    Raises:
        ConfigError: a bad tenant name or option.
    """
    try:
        scoped_run_id(tenant, "x")
    except Exception as exc:
        raise ConfigError(str(exc)) from None
    for name, value in (("request_timeout", request_timeout), ("result_poll", result_poll)):
        if not (isinstance(value, int | float) and value > 0):
            raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
    async with open_queue_transport(backend, namespace=namespace, **transport_options) as transport:
        transport.remote.use_tenant_role()
        yield TenantClient(tenant, transport, float(request_timeout), float(result_poll))
