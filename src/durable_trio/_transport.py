"""The queue transport: one nursery tree that carries tasks, results and control over a broker.

::

    transport (root nursery, lives as long as the ``async with``)
    ├── consumers      every poll loop (task queues, results, heartbeats, control)
    ├── inboxes        this instance's own reply / tenant-event inbox loops
    ├── jobs           one task per running handler, each in its own cancel scope
    ├── lease keeper   claim renewal every threshold/2
    └── reclaim sweep  recover stalled jobs every stalled_check_interval; poison-job bridge

Leaving the ``async with`` (or ``await transport.aclose()``) runs the bounded close of T24
(docs/spec.md; in depth: docs/close.md).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio

from ._errors import ConfigError
from ._failures import one_exception, raise_bare
from ._options import (
    TransportOptions,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from .backends._backend import Backend

from ._health import HealthMixin
from ._remote import RemoteProtocols
from ._steps import ConsumeMixin
from ._transport_base import TransportStatistics

__all__ = ["QueueTransport", "TransportStatistics", "open_queue_transport"]


class QueueTransport(ConsumeMixin, HealthMixin):
    """Carries step tasks, results, heartbeats and control messages over a queue broker.

    Open one with :func:`open_queue_transport`; do not construct it directly.
    """

    def __init__(self, backend: Backend, options: TransportOptions) -> None:
        super().__init__(backend, options)
        self.remote = RemoteProtocols(
            self, controller=self._controller, inboxes=self._inboxes, report=self._report
        )
        """The remote protocols: workflow turns, decisions, step events, the tenant protocol."""

    # ------------------------------------------------------------------ lifecycle

    async def _start(self, root: trio.Nursery) -> None:
        self._tree.attach(
            runner=self._runner,
            keeper=self._lease_keeper,
            sweeper=self._sweeper,
            controller=self._controller,
            liveness=lambda: self._liveness,
            stop_intake=self._consumers.stop_intake,
            begin_close=self._begin_close,
            close_inboxes=self.remote.close_inboxes,
            closed=self._mark_closed,
        )
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
        self._begin_close()
        self._tree.close()
        with trio.CancelScope(shield=True):
            await self._closed.wait()

    def _begin_close(self) -> None:
        if not self._closing:
            self._closing = True
            self._consumers.stop_deferring()

    def _mark_closed(self) -> None:
        self._fully_closed = True
        self._closed.set()


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
