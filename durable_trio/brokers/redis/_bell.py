"""One queue's wake-up state in a Redis broker: the doorbell's rings counted, and what the
broker's last empty pop saw (see Wake-up in :mod:`durable_trio.brokers.redis`). The doorbell
rings it (:meth:`Bell.ring_bell`); a pop notes an empty queue (:meth:`Bell.note_empty`); a waiter
compares the two."""

from __future__ import annotations

import math

import attrs
import trio
from trio_util import RepeatedEvent

from ..._attrs_shared import shared_repr

__all__ = ["Bell"]


@attrs.define(eq=False, repr=False)
class Bell:
    """The rings of one queue's doorbell channel and the broker's last empty pop of it."""

    __repr__ = shared_repr

    rings: int = 0
    """Doorbell rings received (plus one per resubscription)."""
    ring: RepeatedEvent = attrs.Factory(RepeatedEvent)
    """Set on every ring (its waiters wake on the next one; ``rings`` counts them)."""
    covered_epoch: int = 0
    """The subscription (epoch) in which this queue's channel was confirmed; 0: none."""
    empty_rings: int = 0
    """``rings`` just before this broker's last empty pop was sent."""
    empty_epoch: int | None = None
    """The subscription that covered that pop, ``None`` if it was not covered (or the last pop
    was not empty): the next wait must re-check instead of trusting the ring count."""
    due_at: float = math.inf
    """Trio time the earliest delayed job comes due, as of that pop."""

    def ring_bell(self) -> None:
        """Count a ring and wake the waiters."""
        self.rings += 1
        self.ring.set()

    def note_empty(self, rings: int, epoch: int | None, due_in: float | None) -> None:
        """Record an empty pop or peek.

        Args:
            rings: ``rings`` just before it was sent.
            epoch: the subscription that covered it, ``None`` if none did.
            due_in: seconds until the earliest delayed job comes due, ``None`` if none.
        """
        self.empty_rings = rings
        self.empty_epoch = epoch
        self.due_at = math.inf if due_in is None else trio.current_time() + due_in
