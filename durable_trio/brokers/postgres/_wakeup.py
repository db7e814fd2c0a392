"""How the PostgreSQL broker's waiters wake (``PostgresBroker.wait_for_work``).

Every call that can make work ready on a queue (a push, a retry, a requeue, a recovery, a
lease ending on a queue with a fleet-wide limit: a slot freed, a limit changed) sends
``NOTIFY`` on the queue's channel inside its own transaction, so it is delivered on commit and
only then; PostgreSQL folds identical notifications of one transaction into one, and a batch
push sends one for all its jobs. The payload says what came: ``""`` work is ready (waiters
return at once, their consumer's pop is the look), ``"later"`` a delayed job (waiters look
again, to sleep until it is due).

:class:`WakeUps` owns the broker's waiters by queue and its subscriptions on the backend's
:class:`~durable_trio._postgres.NotifyHub` (one callback per queue, kept while the broker
lives). The hub calls it with ``None`` after its connection was lost and is back: every waiter
of the broker then returns once (what was notified meanwhile is lost).
"""

from __future__ import annotations

import functools
import hashlib
from typing import TYPE_CHECKING, Final

import attrs
import trio

if TYPE_CHECKING:
    from ..._postgres import NotifyHub

__all__ = ["LATER", "Waiter", "WakeUps", "channel_for"]

#: The payload of a ``NOTIFY`` for a delayed job (nothing to pop yet; look again).
LATER: Final = "later"


@functools.lru_cache(maxsize=1024)  # (a hash per call otherwise: claims, pushes)
def channel_for(schema: str, queue: str) -> str:
    """The ``NOTIFY`` channel of ``queue`` in ``schema``: a hash, so any queue name (any
    length, any character) makes a short, safe identifier, and two schemas on one server never
    wake each other's waiters."""
    digest = hashlib.blake2b(f"{schema}\x00{queue}".encode(), digest_size=12).hexdigest()
    return f"dtq_{digest}"


@attrs.define(eq=False)
class Waiter:
    """One task in :meth:`~durable_trio.brokers.postgres.PostgresBroker.wait_for_work`."""

    queue: str
    event: trio.Event = attrs.Factory(trio.Event)
    ready: bool = False
    """Set with ``event`` when the wake-up says work is ready (or may be: a reconnect): the
    waiter returns without looking again."""


class WakeUps:
    """The waiters of one broker and the subscriptions that wake them.

    Args:
        hub: the backend's notify hub.
        schema: the schema's name (part of each channel's name).
    """

    def __init__(self, hub: NotifyHub, schema: str) -> None:
        self._hub = hub
        self._schema = schema
        self._waiters: dict[str, set[Waiter]] = {}
        # queue -> set once its channel's first LISTEN ended (the callback stays subscribed)
        self._subscribed: dict[str, trio.Event] = {}

    def channel(self, queue: str) -> str:
        return channel_for(self._schema, queue)

    async def watch(self, waiter: Waiter) -> None:
        """Register ``waiter`` and make sure its queue's channel is listened to, before the
        waiter's first look: a push committed after the look is notified.

        Raises:
            BrokerUnavailable: the channel could not be listened to (the connection is down);
                it will be once the connection is back, and every waiter then wakes.
        """
        self._waiters.setdefault(waiter.queue, set()).add(waiter)
        listening = self._subscribed.get(waiter.queue)
        if listening is not None:
            await listening.wait()  # (a first waiter may still be subscribing)
            return
        listening = self._subscribed[waiter.queue] = trio.Event()
        try:
            await self._hub.subscribe(self.channel(waiter.queue), _Ring(self, waiter.queue))
        finally:
            # Even when it failed: the subscription stands and rings every waiter once the
            # connection is back.
            listening.set()

    def unwatch(self, waiter: Waiter) -> None:
        """Forget ``waiter`` (its wait is over)."""
        waiters = self._waiters.get(waiter.queue)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self._waiters[waiter.queue]

    def ring(self, queue: str, payload: str | None) -> None:
        """A notification for ``queue`` (``None``: the hub reconnected, anything may have
        happened)."""
        for waiter in self._waiters.get(queue, ()):
            if payload != LATER:
                waiter.ready = True
            waiter.event.set()


@attrs.frozen
class _Ring:
    """The hub's callback for one queue of one broker."""

    wakeups: WakeUps
    queue: str

    def __call__(self, payload: str | None) -> None:
        self.wakeups.ring(self.queue, payload)
