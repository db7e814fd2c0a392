"""The Redis broker's doorbell listeners, base classes of the brokers (kept in a module of
their own so the broker's class stays under the size limit).

:class:`PubSubDoorbell` (one node): ONE ``SUBSCRIBE`` connection for every waited queue, its
*epoch* counted per (re)subscription. :class:`ShardedDoorbell` (a Cluster): one sharded
subscription (``SSUBSCRIBE``) per waited queue, on the master of the queue's slot, its epoch
counted per queue (a sharded channel lives on one master; a connection per master would have to
re-shard itself on every failover, which :class:`~durable_trio._redis.ShardedSubscription`
already does per subscription). Either way the broker asks the same three things: is a queue's
channel subscribed now (:meth:`_covers`), in which epoch (:meth:`_live_epoch`: an empty pop
covered by an older epoch may have missed a ring), and wait until it is (:meth:`_cover`). A
(re)subscription rings its queues: messages may have been lost while nobody listened.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Protocol

import trio

from .._errors import BrokerError, TransportClosed
from .._redis import RedisClient, RedisClusterClient

if TYPE_CHECKING:
    from trio_util import RepeatedEvent

    from .._redis import ShardedSubscription, Subscription

__all__ = ["PubSubDoorbell", "ShardedDoorbell"]


class _Queue(Protocol):
    """What a listener needs of a queue (the broker's ``_Queue``)."""

    channel: bytes
    covered_epoch: int
    """The epoch in which its channel was confirmed subscribed; 0: none."""

    def ring_bell(self) -> None:
        """Count a ring and wake its waiters."""


class _DoorbellState:
    """What both listeners share with the broker (set by its ``__init__``)."""

    _client: Any
    _closed: bool
    _wanted: dict[bytes, _Queue]
    _want: RepeatedEvent
    _changed: trio.Event
    _epoch: int
    _subscriptions: int
    _subscription_failures: int
    _safety_poll_interval: float
    _ping_timeout: float
    _backoff: tuple[float, float]

    def _report(self, exc: Exception, doing: str = "doorbell") -> None:
        raise NotImplementedError

    def _signal_changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _backoff_delay(self, failures: int) -> float:
        first, largest = self._backoff
        delay = min(largest, first * 2.0 ** min(failures - 1, 32))
        return delay * random.uniform(0.5, 1.0)

    _listener_scope: trio.CancelScope

    async def _doorbell_loop(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The listener, until the broker closes (see the subclasses)."""
        with self._listener_scope:
            task_status.started()
            await self._listen_forever()

    async def _listen_forever(self) -> None:
        raise NotImplementedError

    def _want_channel(self, q: _Queue) -> None:
        if q.channel not in self._wanted:
            self._wanted[q.channel] = q
            self._want.set()


class PubSubDoorbell(_DoorbellState):
    """One ``SUBSCRIBE`` connection for every waited queue of one Redis server."""

    _sub: Subscription | None = None

    def _covers(self, q: _Queue) -> bool:
        return self._sub is not None and q.covered_epoch == self._epoch

    def _live_epoch(self, q: _Queue) -> int:
        """The epoch of the live subscription (every queue's: there is one)."""
        return self._epoch

    def _drop_subscriptions(self) -> None:
        sub = self._sub
        if sub is not None:
            sub.close()

    async def _cover(self, q: _Queue) -> None:
        """Return once ``q``'s channel is subscribed on the live subscription."""
        while not self._covers(q):
            if self._closed:
                return
            self._want_channel(q)
            sub = self._sub
            if sub is None:
                await self._changed.wait()  # the listener (re)connects and subscribes it
                continue
            epoch = self._epoch
            changed = self._changed
            try:
                await sub.subscribe(q.channel)
            except (BrokerError, TransportClosed):
                # Dead: the listener notices, reports and reconnects (or, closed, stops).
                await changed.wait()
                continue
            if self._sub is sub and self._epoch == epoch:
                q.covered_epoch = epoch

    async def _listen_forever(self) -> None:
        client = self._client
        assert isinstance(client, RedisClient)  # (a Cluster's broker has ShardedDoorbell)
        failures = 0
        while True:
            while not self._wanted:
                await self._want.wait()
            try:
                async with client.subscribe() as sub:
                    channels = list(self._wanted)
                    await sub.subscribe(*channels)
                    self._epoch += 1
                    self._subscriptions += 1
                    self._sub = sub
                    for channel in channels:
                        self._wanted[channel].covered_epoch = self._epoch
                    # Messages may have been lost while we were not subscribed: a
                    # (re)subscription rings every queue (its waiters re-check).
                    for q in list(self._wanted.values()):
                        q.ring_bell()
                    self._signal_changed()
                    failures = 0
                    await self._listen(sub)
            except BrokerError as exc:
                self._subscription_failures += 1
                self._report(exc)
            except TransportClosed:
                # The client is closed: this broker cannot work any more. Waiters return.
                self._closed = True
                return
            finally:
                self._sub = None
                self._signal_changed()
            failures += 1
            await trio.sleep(self._backoff_delay(failures))

    async def _listen(self, sub: Subscription) -> None:
        """Count rings until the subscription fails; ``PING`` it after a silence."""
        wanted = self._wanted
        while True:
            with trio.move_on_after(self._safety_poll_interval):
                channel, _ = await sub.receive()
                q = wanted.get(channel)
                if q is not None:
                    q.ring_bell()
                continue
            await sub.ping(reply_timeout=self._ping_timeout)


class ShardedDoorbell(_DoorbellState):
    """One sharded subscription per waited queue, each on the master of its queue's slot.

    A queue's epoch grows on every (re)subscription of its channel (the first one, a failover
    followed by :class:`~durable_trio._redis.ShardedSubscription`, a subscription reopened
    after an error); each one rings the queue. There is no ``PING`` of a silent subscription:
    the safety poll (the armed flags, every ``safety_poll_interval``) bounds what a silently
    dead connection costs, as it does for a lost message.
    """

    _live: dict[bytes, int]
    """Channel -> its queue's epoch, for the channels subscribed now."""
    _epochs: dict[bytes, int]
    """Channel -> its queue's epoch (kept while it is not subscribed, so it only grows)."""

    def _covers(self, q: _Queue) -> bool:
        epoch = self._live.get(q.channel)
        return epoch is not None and q.covered_epoch == epoch

    def _live_epoch(self, q: _Queue) -> int:
        return self._epochs.get(q.channel, 0)

    def _drop_subscriptions(self) -> None:
        self._live.clear()  # (each subscription ends with the listener's scope)

    async def _cover(self, q: _Queue) -> None:
        """Return once ``q``'s channel is subscribed (by its own listener task)."""
        while not self._covers(q) and not self._closed:
            changed = self._changed
            self._want_channel(q)
            await changed.wait()

    async def _listen_forever(self) -> None:
        started: set[bytes] = set()
        async with trio.open_nursery() as nursery:
            while True:
                for channel, q in list(self._wanted.items()):
                    if channel not in started:
                        started.add(channel)
                        nursery.start_soon(self._listen_to, q)
                await self._want.wait()

    def _subscribed(self, q: _Queue) -> None:
        """(Re)subscribed: a new epoch for ``q``, and a ring (messages may have been lost)."""
        epoch = self._epochs[q.channel] = self._epochs.get(q.channel, 0) + 1
        self._live[q.channel] = q.covered_epoch = epoch
        q.ring_bell()
        self._signal_changed()

    async def _listen_to(self, q: _Queue) -> None:
        client = self._client
        assert isinstance(client, RedisClusterClient)
        failures = 0
        while True:
            try:
                async with client.ssubscribe(q.channel) as sub:
                    self._subscriptions += 1
                    sub.on_resubscribed = lambda: self._subscribed(q)
                    self._subscribed(q)
                    failures = 0
                    await self._ring_on_messages(q, sub)
            except BrokerError as exc:
                self._subscription_failures += 1
                self._report(exc)
            except TransportClosed:
                self._closed = True
                self._signal_changed()
                return
            finally:
                self._live.pop(q.channel, None)
            failures += 1
            await trio.sleep(self._backoff_delay(failures))

    @staticmethod
    async def _ring_on_messages(q: _Queue, sub: ShardedSubscription) -> None:
        async for _ in sub:
            q.ring_bell()
        # The iteration ended: the subscription was closed under us (the client closing).
        raise TransportClosed("the sharded doorbell subscription was closed")
