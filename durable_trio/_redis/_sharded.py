"""A sharded pub/sub subscription (``SSUBSCRIBE``) that follows its slot across the Cluster.

A sharded channel lives on the master of its slot. When the slot moves away (the node then
unsubscribes its subscribers) or the master fails, the subscription's connection ends; its task
(in the cluster client's nursery) reads the slot map again and subscribes on the new master,
backing off between attempts, until the subscription is closed.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import trio

from .._errors import BrokerError, TransportClosed

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._cluster_nodes import ClusterNodes
    from ._pubsub import Subscription

__all__ = ["ShardedSubscription"]


class ShardedSubscription:
    """Messages of sharded channels of one slot, as ``(channel, message)`` pairs.

    Made by :meth:`RedisClusterClient.ssubscribe`; ``async for channel, message in sub:``.
    Iteration ends once the subscription is closed.

    Attributes:
        channels: the channels (bytes).
        resubscribed: how many times it subscribed again after losing its node (messages
            published in between were not received).
        on_resubscribed: called (from the subscription's task) each time it has subscribed
            again, so its owner re-checks what it waits on at once; it must not raise.
    """

    def __init__(
        self,
        channels: tuple[bytes, ...],
        *,
        nodes: ClusterNodes,
        open_subscription: Callable[[], Awaitable[Subscription]],
        retry_delay: Callable[[int], float],
        buffer: int,
    ) -> None:
        self.channels = channels
        self.resubscribed = 0
        self.on_resubscribed: Callable[[], object] | None = None
        self._nodes = nodes
        self._open = open_subscription
        self._retry_delay = retry_delay
        self._send, self._receive = trio.open_memory_channel[tuple[bytes, bytes]](buffer)
        self._current: Subscription | None = None
        self._closing = False
        self._generation = 0  # of the slot map the current subscription went by

    async def _subscribe(self) -> Subscription:
        self._generation = self._nodes.generation
        return await self._open()

    async def run(self, *, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        """Subscribe (errors of the first attempt go to the opener), then forward messages and
        subscribe again whenever the connection ends, until cancelled or closed."""
        with trio.CancelScope() as scope:
            self._current = await self._subscribe()
            task_status.started(scope)
            try:
                await self._forward(self._current)
            except TransportClosed:
                return  # the client is closing (its nursery's cancellation is on its way)

    async def _forward(self, current: Subscription) -> None:
        failures = 0
        while True:
            try:
                async for message in current:
                    failures = 0
                    await self._send.send(message)
            except BrokerError:
                pass  # the node failed or gave the slot away: subscribe again
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # closed by its owner while a message was on its way
            if self._closing:
                return
            # Also a connection closed without an error: its node's pool was dropped (the node
            # left the cluster).
            current.close()
            while True:
                failures += 1
                await trio.sleep(self._retry_delay(failures))
                # The slot map this subscription went by is out of date: read it again (a
                # failure here is met again, and retried, by the subscription that follows).
                with contextlib.suppress(BrokerError):
                    await self._nodes.refresh(self._generation)
                try:
                    current = self._current = await self._subscribe()
                    break
                except BrokerError:
                    continue  # a long outage: keep trying, at the backoff's cap
            self.resubscribed += 1
            if self.on_resubscribed is not None:
                self.on_resubscribed()

    async def receive(self) -> tuple[bytes, bytes]:
        """Wait for the next message.

        Raises:
            TransportClosed: the subscription was closed.
        """
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise TransportClosed("the sharded subscription is closed") from None

    def __aiter__(self) -> ShardedSubscription:
        return self

    async def __anext__(self) -> tuple[bytes, bytes]:
        try:
            return await self.receive()
        except TransportClosed:
            raise StopAsyncIteration from None

    def close(self) -> None:
        """Close the subscription and its connection (idempotent)."""
        self._closing = True
        if self._current is not None:
            self._current.close()
        self._send.close()
        self._receive.close()
