"""A pub/sub subscription on its own connection, iterated as ``(channel, message)`` pairs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from .._errors import TransportClosed
from ._commands import pack as _pack
from ._errors import RedisReplyError, raisable

if TYPE_CHECKING:
    from ._connection import Connection

__all__ = ["Subscription"]


def _as_bytes(name: str | bytes) -> bytes:
    return name.encode() if isinstance(name, str) else bytes(name)


class Subscription:
    """Messages of the channels and patterns subscribed on one dedicated connection.

    Made by :meth:`RedisClient.subscribe`. ``async for channel, message in sub:`` yields
    ``bytes`` pairs (for a pattern subscription, the channel the message was published to).
    Messages wait in a bounded buffer; when it is full the connection stops reading (and Redis
    eventually drops a subscriber that stays that slow).

    If the connection dies, iteration raises
    :class:`~durable_trio._errors.BrokerUnavailable` after the buffered messages; messages
    published meanwhile are lost, so a doorbell user should resubscribe and then re-check the
    state it is waiting on. Iteration ends (``StopAsyncIteration``) once the subscription is
    closed.
    """

    def __init__(self, conn: Connection) -> None:
        assert conn._push_receive is not None, "not a pub/sub connection"
        self._conn = conn
        self._messages = conn._push_receive
        self._channels: set[bytes] = set()
        self._patterns: set[bytes] = set()

    @property
    def channels(self) -> frozenset[bytes]:
        """The channels currently subscribed."""
        return frozenset(self._channels)

    @property
    def patterns(self) -> frozenset[bytes]:
        """The patterns currently subscribed."""
        return frozenset(self._patterns)

    @property
    def connection(self) -> Connection:
        """The dedicated connection underneath (for its health and stats)."""
        return self._conn

    async def _command(self, kind: str, names: tuple[bytes, ...]) -> list[Any]:
        if not names:
            await trio.lowlevel.checkpoint()
            return []
        # One confirmation per name, routed to the request like any other reply.
        return await self._conn._request(_pack((kind, *names)), len(names), None)

    async def subscribe(self, *channels: str | bytes) -> None:
        """Subscribe to more channels (returns once Redis confirmed every one).

        Args:
            *channels: channel names (``str`` is UTF-8 encoded).
        """
        names = tuple(_as_bytes(c) for c in channels)
        await self._command("SUBSCRIBE", names)
        self._channels.update(names)

    async def unsubscribe(self, *channels: str | bytes) -> None:
        """Unsubscribe from channels (all of them if none are named).

        Args:
            *channels: channel names.
        """
        names = tuple(_as_bytes(c) for c in channels) or tuple(self._channels)
        await self._command("UNSUBSCRIBE", names)
        self._channels.difference_update(names)

    async def ssubscribe(self, *channels: str | bytes) -> None:
        """Subscribe to sharded channels (``SSUBSCRIBE``, Redis 7; on a Cluster they must share
        one slot and this connection must be to its master: see
        :meth:`RedisClusterClient.ssubscribe`, which sees to both).

        Args:
            *channels: channel names.
        """
        names = tuple(_as_bytes(c) for c in channels)
        # One command per channel: a refusal (MOVED, CROSSSLOT) is one reply for the whole
        # command, which would leave the other channels' confirmations awaited forever.
        replies = await self._conn._request(
            b"".join(_pack(("SSUBSCRIBE", name)) for name in names), len(names), None
        )
        for reply in replies:
            if isinstance(reply, RedisReplyError):
                raise raisable(reply, self._conn.url.address)
        self._channels.update(names)

    async def psubscribe(self, *patterns: str | bytes) -> None:
        """Subscribe to glob-style patterns (``jobs:*``).

        Args:
            *patterns: the patterns; messages of matching channels are yielded as
                ``(channel, message)`` like any other.
        """
        names = tuple(_as_bytes(p) for p in patterns)
        await self._command("PSUBSCRIBE", names)
        self._patterns.update(names)

    async def punsubscribe(self, *patterns: str | bytes) -> None:
        """Unsubscribe from patterns (all of them if none are named).

        Args:
            *patterns: the patterns.
        """
        names = tuple(_as_bytes(p) for p in patterns) or tuple(self._patterns)
        await self._command("PUNSUBSCRIBE", names)
        self._patterns.difference_update(names)

    async def ping(self, *, reply_timeout: float | None = None) -> None:
        """Round-trip a ``PING`` (a liveness check for an otherwise silent subscription).

        Args:
            reply_timeout: seconds to wait (``None``: the client's ``command_timeout``).

        Raises:
            RedisCommandTimeout: no answer in time (the subscription's connection is discarded).
            BrokerUnavailable: the connection is down.
        """
        await self._conn._request(_pack(("PING",)), 1, reply_timeout)

    async def receive(self) -> tuple[bytes, bytes]:
        """Wait for the next message.

        Returns:
            ``(channel, message)``.

        Raises:
            BrokerUnavailable: the connection died (after the buffered messages were received).
            TransportClosed: the subscription was closed.
        """
        try:
            return await self._messages.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise self._conn._dead() from None

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> tuple[bytes, bytes]:
        try:
            return await self.receive()
        except TransportClosed:
            raise StopAsyncIteration from None

    def close(self) -> None:
        """Close the subscription and its connection (idempotent)."""
        self._conn.close()
        self._messages.close()
