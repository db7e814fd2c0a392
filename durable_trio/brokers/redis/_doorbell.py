"""The Redis broker's doorbell: the listener that counts the rings of the queues waited on.

An object the broker owns (:attr:`RedisBrokerBase._doorbell`), run as one task of the broker's
nursery (:meth:`Doorbell.run`) and asked three things by the broker's waiters: is a queue's
channel subscribed now (:meth:`~Doorbell.covers`), in which epoch
(:meth:`~Doorbell.live_epoch`: an empty pop covered by an older epoch may have missed a ring),
and wait until it is (:meth:`~Doorbell.cover`). A (re)subscription rings its queues: messages
may have been lost while nobody listened.

:class:`PubSubDoorbell` (one node): ONE ``SUBSCRIBE`` connection for every waited queue, its
*epoch* counted per (re)subscription. :class:`ShardedDoorbell` (a Cluster): one sharded
subscription (``SSUBSCRIBE``) per waited queue, on the master of the queue's slot, its epoch
counted per queue (a sharded channel lives on one master; a connection per master would have to
re-shard itself on every failover, which :class:`~durable_trio._redis.ShardedSubscription`
already does per subscription).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import trio
from trio_util import RepeatedEvent

from ..._coalesce import Coalescer
from ..._errors import BrokerError, TransportClosed
from ..._redis import RedisClient, is_cluster_client
from ._replies import read_seconds

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ..._backoff import Backoff
    from ..._redis import RedisClusterClient, Script, ShardedSubscription, Subscription
    from ._queue import Queue

__all__ = ["Doorbell", "PubSubDoorbell", "ShardedDoorbell"]


class Doorbell:
    """What both listeners share: the channels wanted, the change signal, the counters.

    Args:
        client: the broker's client.
        safety_poll_interval: seconds of silence after which a subscription is ``PING``\\ ed.
        ping_timeout: seconds that ``PING`` may take.
        backoff: the delays between two attempts to reopen a lost subscription.
        report: the broker's report of an error (log and ``on_error``).
        read_flags: which of some keys exist (the broker's: the safety checks' one read).
    """

    def __init__(
        self,
        client: RedisClient | RedisClusterClient,
        *,
        safety_poll_interval: float,
        ping_timeout: float,
        backoff: Backoff,
        report: Callable[[Exception], None],
        read_flags: Callable[[list[str]], Awaitable[list[bool]]],
    ) -> None:
        self._client = client
        self._safety_poll_interval = safety_poll_interval
        self._ping_timeout = ping_timeout
        self._backoff = backoff
        self._report = report
        self._read_flags = read_flags
        self._safety: Coalescer[str, bool] = Coalescer(self._check_armed)
        self.closed = False
        """Set once the broker closes, or its client is found closed: waiters return."""
        self.subscriptions = 0
        """Subscriptions opened (1 + reconnections)."""
        self.subscription_failures = 0
        """Subscriptions lost or refused (each reported)."""
        self._wanted: dict[bytes, Queue] = {}
        self._want = RepeatedEvent()  # a channel was added to _wanted
        # Set and replaced on every change of a subscription. An Event, not a RepeatedEvent:
        # cover() takes it before its SUBSCRIBE and waits on it after, so a change meanwhile
        # is not missed.
        self._changed = trio.Event()
        self._scope = trio.CancelScope()

    def _signal_changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The listener, until :meth:`close`."""
        with self._scope:
            task_status.started()
            await self._listen_forever()

    def close(self) -> None:
        """Stop the listener (from any task; it does not wait) and wake every waiter."""
        self.closed = True
        self._scope.cancel()
        self._drop_subscriptions()
        self._signal_changed()

    async def wait(self, q: Queue, peek: Script) -> None:
        """Return when ``q`` may have work: at once if a job is ready (``peek``, the broker's
        peek script, arms the queue); else on a ring after the broker's last empty pop, when
        the earliest delayed job comes due, when a safety check finds the queue's armed flag
        gone, or when no subscription could be made within ``safety_poll_interval``. Never
        raises :class:`~durable_trio.BrokerError`: a failed check is reported and the call
        returns (the caller's next pop meets the error itself)."""
        bell = q.bell
        if self.closed:
            await trio.lowlevel.checkpoint()
            return
        with trio.move_on_after(self._safety_poll_interval) as covering:
            await self.cover(q)
        if covering.cancelled_caught or self.closed:
            return  # no subscription for that long: let the caller look (and meet the error)
        if bell.empty_epoch is None or bell.empty_epoch != self.live_epoch(q):
            # The last pop was not covered by this subscription: look (which arms) now that
            # the subscription is in place.
            rings = bell.rings
            try:
                reply = await peek(q.peek_keys)
            except BrokerError as exc:
                self._report(exc)
                return
            if reply[0]:
                return
            epoch = self.live_epoch(q)
            bell.note_empty(rings, epoch, read_seconds(reply[1]) if len(reply) > 1 else None)
        with trio.move_on_at(bell.due_at):
            while bell.rings == bell.empty_rings:
                # Safety checks fall on a grid shared by every waiter of this broker, so the
                # checks of all idle queues leave together, as ONE read (see _check_armed).
                with trio.move_on_at(self._next_safety_tick()):
                    await bell.ring.wait()
                    return
                # The slow safety poll: the empty pop (or peek) set the armed flag, and every
                # push, retry or recovery since then clears it. Still set: nothing was made
                # ready since some consumer last found the queue empty, whatever happened to the
                # doorbell. Gone (a push, or the flag lost to a flush or an eviction): return,
                # and the caller's pop looks and re-arms.
                try:
                    armed = await self._safety.submit(q.armed_key)
                except BrokerError as exc:
                    self._report(exc)
                    return
                if not armed:
                    return

    def _next_safety_tick(self) -> float:
        interval = self._safety_poll_interval
        return (math.floor(trio.current_time() / interval) + 1) * interval

    async def _check_armed(self, keys: list[str]) -> list[bool]:
        """One read of the armed flags of every queue whose safety check fell on this tick
        (the broker's ``read_flags``: one ``MGET``; a Cluster: one pipeline per master)."""
        return await self._read_flags(keys)

    def snapshot(self, q: Queue) -> tuple[int, int | None]:
        """``q``'s ring count and the epoch that covers it (``None``: none does), taken before
        a pop is sent: a ring counted after this may be for an older push (a spurious
        wake-up), but no push after the pop can be missed."""
        return q.bell.rings, (self.live_epoch(q) if self.covers(q) else None)

    def covers(self, q: Queue) -> bool:
        """Whether ``q``'s channel is subscribed now."""
        raise NotImplementedError

    def live_epoch(self, q: Queue) -> int:
        """The epoch of ``q``'s subscription."""
        raise NotImplementedError

    async def cover(self, q: Queue) -> None:
        """Return once ``q``'s channel is subscribed (or the doorbell is closed)."""
        raise NotImplementedError

    def _drop_subscriptions(self) -> None:
        raise NotImplementedError

    async def _listen_forever(self) -> None:
        raise NotImplementedError

    def _want_channel(self, q: Queue) -> None:
        if q.channel not in self._wanted:
            self._wanted[q.channel] = q
            self._want.set()


class PubSubDoorbell(Doorbell):
    """One ``SUBSCRIBE`` connection for every waited queue of one Redis server."""

    _sub: Subscription | None = None
    """The live subscription, if any."""
    _epoch: int = 0
    """Its epoch: counted per (re)subscription."""

    def covers(self, q: Queue) -> bool:
        return self._sub is not None and q.bell.covered_epoch == self._epoch

    def live_epoch(self, q: Queue) -> int:
        """The epoch of the live subscription (every queue's: there is one)."""
        return self._epoch

    def _drop_subscriptions(self) -> None:
        sub = self._sub
        if sub is not None:
            sub.close()

    async def cover(self, q: Queue) -> None:
        """Return once ``q``'s channel is subscribed on the live subscription."""
        while not self.covers(q):
            if self.closed:
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
                q.bell.covered_epoch = epoch

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
                    self.subscriptions += 1
                    self._sub = sub
                    for channel in channels:
                        self._wanted[channel].bell.covered_epoch = self._epoch
                    # Messages may have been lost while we were not subscribed: a
                    # (re)subscription rings every queue (its waiters re-check).
                    for q in list(self._wanted.values()):
                        q.bell.ring_bell()
                    self._signal_changed()
                    failures = 0
                    await self._listen(sub)
            except BrokerError as exc:
                self.subscription_failures += 1
                self._report(exc)
            except TransportClosed:
                # The client is closed: this broker cannot work any more. Waiters return.
                self.closed = True
                return
            finally:
                self._sub = None
                self._signal_changed()
            failures += 1
            await trio.sleep(self._backoff.delay(failures))

    async def _listen(self, sub: Subscription) -> None:
        """Count rings until the subscription fails; ``PING`` it after a silence."""
        wanted = self._wanted
        while True:
            with trio.move_on_after(self._safety_poll_interval):
                channel, _ = await sub.receive()
                q = wanted.get(channel)
                if q is not None:
                    q.bell.ring_bell()
                continue
            await sub.ping(reply_timeout=self._ping_timeout)


class ShardedDoorbell(Doorbell):
    """One sharded subscription per waited queue, each on the master of its queue's slot.

    A queue's epoch grows on every (re)subscription of its channel (the first one, a failover
    followed by :class:`~durable_trio._redis.ShardedSubscription`, a subscription reopened
    after an error); each one rings the queue. There is no ``PING`` of a silent subscription:
    the safety poll (the armed flags, every ``safety_poll_interval``) bounds what a silently
    dead connection costs, as it does for a lost message.
    """

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self._live: dict[bytes, int] = {}
        """Channel -> its queue's epoch, for the channels subscribed now."""
        self._epochs: dict[bytes, int] = {}
        """Channel -> its queue's epoch (kept while it is not subscribed, so it only grows)."""

    def covers(self, q: Queue) -> bool:
        epoch = self._live.get(q.channel)
        return epoch is not None and q.bell.covered_epoch == epoch

    def live_epoch(self, q: Queue) -> int:
        return self._epochs.get(q.channel, 0)

    def _drop_subscriptions(self) -> None:
        self._live.clear()  # (each subscription ends with the listener's scope)

    async def cover(self, q: Queue) -> None:
        """Return once ``q``'s channel is subscribed (by its own listener task)."""
        while not self.covers(q) and not self.closed:
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

    def _subscribed(self, q: Queue) -> None:
        """(Re)subscribed: a new epoch for ``q``, and a ring (messages may have been lost)."""
        epoch = self._epochs[q.channel] = self._epochs.get(q.channel, 0) + 1
        self._live[q.channel] = q.bell.covered_epoch = epoch
        q.bell.ring_bell()
        self._signal_changed()

    async def _listen_to(self, q: Queue) -> None:
        client = self._client
        assert is_cluster_client(client)
        failures = 0
        while True:
            try:
                async with client.ssubscribe(q.channel) as sub:
                    self.subscriptions += 1
                    sub.on_resubscribed = lambda: self._subscribed(q)
                    self._subscribed(q)
                    failures = 0
                    await self._ring_on_messages(q, sub)
            except BrokerError as exc:
                self.subscription_failures += 1
                self._report(exc)
            except TransportClosed:
                self.closed = True
                self._signal_changed()
                return
            finally:
                self._live.pop(q.channel, None)
            failures += 1
            await trio.sleep(self._backoff.delay(failures))

    @staticmethod
    async def _ring_on_messages(q: Queue, sub: ShardedSubscription) -> None:
        async for _ in sub:
            q.bell.ring_bell()
        # The iteration ended: the subscription was closed under us (the client closing).
        raise TransportClosed("the sharded doorbell subscription was closed")
