"""Claim renewal (T7, docs/spec.md) and lost leases (T8): the lease keeper."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

from .._errors import BrokerError, LeaseLost
from .._periodic import fixed_rate
from ._claims import unexpected

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from ..brokers import SupportsRenewal
    from ._adaptive import ConcurrencyController
    from ._claims import ClaimTable

__all__ = ["LeaseKeeper"]


class LeaseKeeper:
    """Renews every claim this instance holds, every ``stalled_threshold / 2`` (T7), and acts
    on the leases the broker says were lost (T8). Owns its task (in :meth:`renewing`) and the
    scope of the round in flight: :meth:`stop` bounds that round, so close never waits out a
    slow broker. With no ``broker`` (one that cannot renew) it renews nothing."""

    def __init__(
        self,
        broker: SupportsRenewal | None,
        claims: ClaimTable,
        controller: ConcurrencyController,
        *,
        period: float,
        cancel_on_lost_lease: bool,
        report: Callable[[BaseException], None],
        cleanup_timeout: float,
    ) -> None:
        self._broker = broker
        self._cleanup_timeout = cleanup_timeout
        self._claims = claims
        self._controller = controller
        self._period = period
        self._cancel_on_lost_lease = cancel_on_lost_lease
        self._report = report
        self._round: trio.CancelScope | None = None

    @asynccontextmanager
    async def renewing(self) -> AsyncIterator[None]:
        """The keeper level, the outermost of the tree: renewal runs while the levels inside
        it close. Leaving it is close phase 5 (T24): renewal stops, the round in flight is
        shielded and lands, bounded by ``cleanup_timeout``."""
        async with trio.open_nursery() as keeper:
            if self._broker is not None:
                await keeper.start(self.run)
            try:
                yield
            finally:
                if self._broker is not None:
                    self.stop(trio.current_time() + self._cleanup_timeout)
                keeper.cancel_scope.cancel()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Renew on ``start + k * period``; a round is shielded (a claim is never left half
        renewed) and bounded by one period."""
        period = self._period
        ticks = fixed_rate(period)  # a slow round skips the ticks it overran (no stacking)
        task_status.started()
        async for _ in ticks:
            with trio.move_on_after(period, shield=True) as round_scope:
                self._round = round_scope
                await self._renew_open_claims()
            self._round = None

    def stop(self, bound: float) -> None:
        """Close: the round in flight lands by ``bound`` (absolute time), then the task ends."""
        round_in_flight = self._round
        if round_in_flight is not None:
            round_in_flight.deadline = min(round_in_flight.deadline, bound)

    async def _renew_open_claims(self) -> None:
        broker = self._broker
        assert broker is not None
        for queue, leases in self._claims.leases_by_queue().items():
            try:
                outcome = await broker.renew_jobs(queue, leases)
            except BrokerError as exc:
                self._report(exc)
                continue
            except Exception as exc:  # never let a broker defect end the keeper
                self._report(unexpected(exc, f"renewing the claims on {queue!r}"))
                continue
            for lease in outcome.lost:
                # A claim that never started here is dropped (no double run); one that
                # finished during the round trip was finalized, not lost; a running one is
                # lost (and, with cancel_on_lost_lease, its handler cancelled).
                held = self._claims.lose(
                    lease.token, trio.current_time(), cancel=self._cancel_on_lost_lease
                )
                if held is None:
                    continue
                self._controller.duplicates += 1
                what = "cancelled" if self._cancel_on_lost_lease else "left to finish"
                self._report(
                    LeaseLost(
                        f"lost the claim before renewing it: the job was re-delivered and may "
                        f"run twice; its handler is {what} and its outcome discarded "
                        f"(raise stalled_threshold if this worker blocks its event loop)",
                        queue=queue,
                        job_id=lease.job_id,
                    )
                )
