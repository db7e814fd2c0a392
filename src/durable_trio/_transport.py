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

from ._errors import BrokerError, ConfigError
from ._failures import one_exception, raise_bare
from ._options import (
    TransportOptions,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from .backends._backend import Backend

from ._health import HealthMixin
from ._leases import LeaseMixin
from ._remote import RemoteMixin
from ._transport_base import _ABANDONED, _BUFFERED, _FINALIZING, _RUNNING, TransportStatistics

__all__ = ["QueueTransport", "TransportStatistics", "open_queue_transport"]


class QueueTransport(RemoteMixin, LeaseMixin, HealthMixin):
    """Carries step tasks, results, heartbeats and control messages over a queue broker.

    Open one with :func:`open_queue_transport`; do not construct it directly.
    """

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
                    if loop.pop_scope is not None and not loop.inbox:
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
                    elif claim.state is _BUFFERED:  # prefetched, never started
                        claim.state = _ABANDONED
                # this instance's own inboxes stop taking jobs too (phase 7 drains them)
                self._inboxes.cancel()
                bound = trio.current_time() + options.cleanup_timeout
                for loop in self._loops:
                    if loop.pop_scope is not None and loop.inbox:
                        loop.pop_scope.deadline = bound
                with trio.move_on_after(options.cleanup_timeout):
                    await self._jobs_idle.wait()
                self._jobs.cancel()
                # 5. stop renewal; a round in flight is shielded and lands first (bounded: its
                # own bound is half the stalled threshold, which the keeper's nursery would
                # otherwise make close wait out on a slow broker)
                self._keeper.cancel()
                round_in_flight = self._renewal_round
                if round_in_flight is not None:
                    bound = trio.current_time() + options.cleanup_timeout
                    round_in_flight.deadline = min(round_in_flight.deadline, bound)
                with trio.move_on_after(options.cleanup_timeout):
                    await self._keeper.done.wait()
                # 6. hand back every claim still open: immediate and attempt-neutral
                await self._hand_back_open_claims()
                # 7. withdraw the inbox registration, drain this instance's own inboxes
                with trio.move_on_after(options.cleanup_timeout) as inboxes_bound:
                    try:
                        await self._close_inboxes()
                    except BrokerError as exc:
                        self._report(exc)
                if inboxes_bound.cancelled_caught:
                    self._report(BrokerError("close: draining this instance's inboxes timed out"))
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
