"""Consumers: the poll loops (T4, T5; the ids are sections of docs/spec.md) and their
registration."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio

from .._backoff import Backoff
from .._codec import decode_envelope
from .._errors import BrokerError, PayloadError, TransportClosed
from .._telemetry import hop
from ..brokers import (
    ClaimedJob,
    QueueBroker,
    RateGrant,
    SupportsBatchPop,
    SupportsClaimAhead,
    SupportsRateLimits,
    SupportsWakeup,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from .._wire import (
        JobKind,
    )
    from ._claims import ClaimTable
    from ._jobs import JobRunner
    from ._liveness import Vitals
    from ._options import TransportOptions
    from ._slots import Slots
    from ._sweep import Sweeper

from ._claims import Level, Loop, OnJob, quarantined, unexpected

#: A loop that polls this many jobs in a row without waiting yields once, so a loop with a large
#: limit over a broker that answers at once never starves the handlers it starts.
_FAIRNESS_BATCH = 64
#: Most jobs one pop claims (a loop with more free slots than this pops again at once).
_MAX_BATCH = 64
#: Shortest wait of a loop past its queue's rate (a retry_after rounded to 0 never spins).
_MIN_RATE_WAIT = 0.001
#: Longest sleep after consecutive broker errors in a poll loop.
_MAX_ERROR_BACKOFF = 10.0


class Consumers:
    """Every poll loop of a transport (T4, T5): the task, result, heartbeat, control and engine
    loops in the consumers level (:meth:`intake`), this instance's own inboxes in the inboxes
    level (:meth:`inbox_intake`). Owns the loops and their pop scopes, and starts the close
    (:meth:`begin_close`: the job runner's ``closing``, which every job's finalize reads); a
    popped job goes to the job runner."""

    def __init__(
        self,
        broker: QueueBroker,
        options: TransportOptions,
        runner: JobRunner,
        table: ClaimTable,
        *,
        vitals: Vitals,
        report: Callable[[BaseException], None],
    ) -> None:
        self._broker = broker
        self._options = options
        self._runner = runner
        self._table = table
        self.level = Level("consumers")
        """The tree level of the poll loops and the reclaim sweep (open inside :meth:`intake`)."""
        self.inbox_level = Level("inboxes")
        """The tree level of this instance's own inboxes (open inside :meth:`inbox_intake`)."""
        self._vitals = vitals
        self._report = report
        self._wait_for_work = broker.wait_for_work if isinstance(broker, SupportsWakeup) else None
        self.instance_id = options.instance_id
        self.loops: list[Loop] = []
        self.consumed: list[str] = []
        """Every queue consumed (not the inboxes), in start order."""
        self.inbox_queues: list[str] = []
        """This instance's own inboxes consumed, in start order."""
        self._deferred: list[Loop] | None = None
        self._kind_handlers: dict[JobKind, Callable[[Any], Awaitable[None]]] = {}

    def check_open(self) -> None:
        """Raises:
        TransportClosed: the close has begun."""
        if self._runner.closing:
            raise TransportClosed("the transport is closed")

    def begin_close(self) -> None:
        """Close: take no more work (idempotent); the parked loops are never started."""
        self._runner.closing = True
        self._deferred = None

    @asynccontextmanager
    async def intake(self, sweeper: Sweeper | None) -> AsyncIterator[None]:
        """The consumers level: every poll loop and the reclaim sweep (``sweeper``). Leaving it
        is close phase 1 (T24): stop taking work; the pops and finalizes in flight land by
        ``cleanup_timeout``."""
        async with trio.open_nursery() as consumers:
            self.level.nursery = consumers
            try:
                if sweeper is not None:
                    await consumers.start(sweeper.run)
                yield
            finally:
                self.begin_close()
                self.stop_intake(trio.current_time() + self._options.cleanup_timeout)
                consumers.cancel_scope.cancel()

    @asynccontextmanager
    async def inbox_intake(self, runner: JobRunner) -> AsyncIterator[None]:
        """The inboxes level: this instance's own inbox loops (and the tasks of its inbox
        registry). Leaving it is close phases 3 and 4: the running handlers first drain (they
        may wait for a reply on an inbox; ``runner.drain``), then these loops stop, their pops
        in flight bounded by the deadline the drain set (shielded)."""
        async with trio.open_nursery() as inboxes:
            self.inbox_level.nursery = inboxes
            try:
                yield
            finally:
                with trio.CancelScope(shield=True):
                    bound = await runner.drain()
                    self.stop_intake(bound, inbox=True)
                    inboxes.cancel_scope.cancel()

    def consume(
        self,
        kind: JobKind,
        queue: str,
        handler: Callable[[Any], Awaitable[None]],
        slots: Slots,
        *,
        backoff_max: int | None = None,
        inbox: bool = False,
    ) -> None:
        """Hand every ``kind`` job of ``queue`` to ``handler``: the first call starts the loop,
        a later one swaps the handler for the next job."""
        self.check_open()
        first = kind not in self._kind_handlers
        self._kind_handlers[kind] = handler
        if first:
            self.start_loop(
                Loop(
                    queue,
                    self.typed(kind, queue, lambda: self._kind_handlers[kind]),
                    slots,
                    self._options.idle_backoff_max if backoff_max is None else backoff_max,
                    inbox=inbox,
                )
            )

    def defer(self) -> None:
        """Park every loop started from now on (but the inboxes) until :meth:`start_deferred`."""
        if self._deferred is None:
            self._deferred = []

    def start_deferred(self) -> None:
        """Start every parked loop (and stop deferring)."""
        parked, self._deferred = self._deferred or [], None
        for loop in parked:
            self.start_loop(loop)

    def loops_of(self, queue: str) -> list[Loop]:
        """The loops of ``queue``, started or parked."""
        return [loop for loop in [*self.loops, *(self._deferred or ())] if loop.queue == queue]

    def start_loop(self, loop: Loop) -> None:
        if loop.inbox:
            self.loops.append(loop)
            self.inbox_queues.append(loop.queue)
            self.inbox_level.nursery.start_soon(self._poll_loop, loop, name=f"inbox {loop.queue}")
            return
        if self._deferred is not None:
            self._deferred.append(loop)
            return
        self.consumed.append(loop.queue)
        self.loops.append(loop)
        liveness = self._vitals.liveness
        if loop.token is not None and liveness is not None:
            # Only a loop that really consumes makes this instance a live worker of the token:
            # a deferred (producer-only) process never looks like one.
            liveness.serve(loop.token)
        self.level.nursery.start_soon(self._poll_loop, loop, name=f"poll {loop.queue}")

    def stop_intake(self, bound: float, *, inbox: bool = False) -> None:
        """Close: the pops in flight of the task/engine loops (or, with ``inbox``, of this
        instance's own inboxes) land by ``bound`` (absolute time); with the task/engine loops,
        so do the finalizes in flight (the job runner's own scopes)."""
        for loop in self.loops:
            if loop.pop_scope is not None and loop.inbox is inbox:
                loop.pop_scope.deadline = bound
        if not inbox:
            self._runner.bound_finalizes(bound)
            self._runner.abandon_waiting()

    def typed(
        self,
        kind: JobKind,
        queue: str,
        current: Callable[[], Callable[[Any], Awaitable[None]] | None],
    ) -> OnJob:
        """A job callback that decodes ``kind`` jobs of ``queue`` and hands their payload to
        the handler registered now (``current()``), so re-registering swaps it for the next
        job."""
        max_bytes = self._options.max_payload_bytes

        async def on_job(job: ClaimedJob) -> None:
            envelope = decode_envelope(job.data, max_bytes=max_bytes)
            hop(envelope, queue)  # its trace span, when traced (docs/observability.md)
            if envelope.kind is not kind:
                raise PayloadError(f"a {envelope.kind.value!r} job does not belong on this queue")
            handler = current()
            assert handler is not None
            await handler(envelope.payload)

        return on_job

    # ------------------------------------------------------------------ the poll loop (T4, T5)

    async def _poll_loop(self, loop: Loop) -> None:
        broker = self._broker
        wait_for_work = self._wait_for_work
        queue = loop.queue
        slots = loop.slots
        poll_interval = self._options.poll_interval
        # After the n-th broker error in a row: 2 ** n poll intervals (the exponent capped at
        # 16), at most _MAX_ERROR_BACKOFF; idle, after the n-th empty pop in a row: 2 ** (n - 1)
        # poll intervals, at most the loop's backoff_max of them.
        error_cap = min(_MAX_ERROR_BACKOFF, poll_interval * 2**16)
        error_backoff = Backoff(initial=min(poll_interval * 2, error_cap), maximum=error_cap)
        idle_backoff = Backoff(initial=min(1, loop.backoff_max), maximum=loop.backoff_max)
        worker = self.instance_id
        empty = 0
        errors = 0
        streak = 0
        # Pops are shielded (one scope per loop, its shield switched on around each pop, which
        # costs far less than a scope per pop) so a close never cancels a claim half-made: a
        # job the broker handed over is always tracked, then run or handed back. Close bounds a
        # pop still in flight by setting this scope's deadline.
        pop_many = broker.pop_many if isinstance(broker, SupportsBatchPop) else None
        # Claims only for free slots unless prefetch is asked for, and then only on a broker
        # that stores them as not started (so a claim that never ran is never a suspect).
        pop_ahead = broker.pop_ahead if isinstance(broker, SupportsClaimAhead) else None
        prefetch = self._options.prefetch  # (None: the loop's concurrency, as it moves)
        if pop_ahead is None or pop_many is None:
            prefetch = 0
        buffer = loop.buffer
        runner = self._runner
        start_claim, begin_job = runner.start_claim, runner.begin_job
        table = self._table
        with trio.CancelScope() as pop_scope:
            loop.pop_scope = pop_scope
            while True:
                await slots.acquire()
                # N free slots, one round trip: claim as many jobs as there are free slots
                # (and, with prefetch, that many more, so the next freed slots need no wait).
                extra = slots.take_free(_MAX_BATCH - 1) if pop_many is not None else 0
                take = 1 + extra
                while take and buffer:
                    claim = buffer.popleft()
                    if table.start_buffered(claim):  # (a lost lease took it out meanwhile)
                        start_claim(loop, claim)
                        take -= 1
                if take == 0:
                    streak += 1 + extra
                    if streak >= _FAIRNESS_BATCH:
                        streak = 0
                        await trio.lowlevel.checkpoint()
                    continue
                ahead = 0
                rate = loop.rate  # (read each time: a handler registered later may set it)
                if prefetch != 0 and rate is None:  # (a rated loop never claims ahead)
                    wanted = slots.limit if prefetch is None else prefetch
                    ahead = max(0, min(wanted, _MAX_BATCH) - len(buffer))
                try:
                    # No pop starts once close has begun (a loop first scheduled after the
                    # close started would otherwise shield a pop nobody bounds).
                    await trio.lowlevel.checkpoint_if_cancelled()
                except trio.Cancelled:
                    slots.release(take)
                    raise
                grant = None
                if rate is not None:
                    grant = await self._take_starts(rate, queue, take, pop_scope)
                    if grant is None or grant.granted < take:
                        slots.release(take - (grant.granted if grant is not None else 0))
                    if grant is None:
                        errors += 1
                        await trio.sleep(error_backoff.delay(errors))
                        continue
                    take = grant.granted
                    if take == 0:
                        # Past the rate: no slot held and no claim made; the jobs wait in the
                        # broker until a start leaves the window.
                        streak = 0
                        await trio.sleep(max(grant.retry_after, _MIN_RATE_WAIT))
                        continue
                pop_scope.shield = True
                try:
                    if ahead:
                        assert pop_ahead is not None
                        batch = await pop_ahead(queue, take, ahead, worker=worker)
                    elif pop_many is not None:
                        batch = await pop_many(queue, take, worker=worker)
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
                    self._report(unexpected(exc, f"claiming from {queue!r}"))
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
                if grant is not None:
                    loop.backlog = False  # (a finalize must not claim past the rate)
                    if len(batch) < take:
                        await self._return_starts(rate, queue, grant, take - len(batch), pop_scope)
                else:
                    loop.backlog = len(batch) >= take + ahead
                if len(batch) < take:
                    slots.release(take - len(batch))
                if batch:
                    errors = empty = 0
                    for job in batch[:take]:
                        begin_job(loop, job)
                    for job in batch[take:]:
                        buffer.append(table.buffer(queue, job, ahead=True))
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
                    await trio.sleep(error_backoff.delay(errors))
                elif wait_for_work is not None:
                    await wait_for_work(queue)
                else:
                    empty += 1
                    await trio.sleep(poll_interval * idle_backoff.delay(empty))

    async def _take_starts(
        self, rate: SupportsRateLimits, queue: str, want: int, pop_scope: trio.CancelScope
    ) -> RateGrant | None:
        """Take up to ``want`` starts of ``queue``'s rate (shielded as a pop is); ``None``:
        the broker failed (reported)."""
        pop_scope.shield = True
        try:
            return await rate.take_starts(queue, want)
        except BrokerError as exc:
            self._report(exc)
        except Exception as exc:
            self._report(unexpected(exc, f"taking starts of {queue!r}"))
        finally:
            pop_scope.shield = False
        return None

    async def _return_starts(
        self,
        rate: SupportsRateLimits | None,
        queue: str,
        grant: RateGrant,
        n: int,
        pop_scope: trio.CancelScope,
    ) -> None:
        """Give back the ``n`` starts of ``grant`` the claim did not use. A failure is
        reported only: the starts stay logged (the rate is under-used, never exceeded)."""
        assert rate is not None
        pop_scope.shield = True
        try:
            await rate.return_starts(queue, grant.at, n)
        except BrokerError as exc:
            self._report(exc)
        except Exception as exc:
            self._report(unexpected(exc, f"returning starts of {queue!r}"))
        finally:
            pop_scope.shield = False

    def _drop_quarantined(self, queue: str, batch: list[ClaimedJob]) -> list[ClaimedJob]:
        """Report the entries the broker could not tie to a job (already in its quarantine,
        no lease to finalize) and keep the real claims."""
        kept = []
        for job in batch:
            if job.damage is not None and not job.lease.token:
                self._report(quarantined(queue, job))
            else:
                kept.append(job)
        return kept
