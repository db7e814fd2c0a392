"""One ``LISTEN`` connection per PostgreSQL backend, shared by every part that waits on it.

The broker waits on its queues' channels, the run store on its runs'; a backend opens ONE
:class:`NotifyHub` and each part subscribes callbacks to the channels it cares about::

    async with open_notify_hub(url) as hub:
        await hub.subscribe("jobs", lambda payload: ...)

A callback is called with the payload of each ``NOTIFY`` on its channel, and once with
``None`` after the listener's connection was lost and is back (or a slow hub dropped
notifications): whatever it waits for may have happened meanwhile, so it looks again. The
hub's one task (in its own nursery) reads the listener and calls the callbacks in turn; a
callback must be quick and must not raise (it sets an event, at most).
"""

from __future__ import annotations

import contextlib
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio

from .._errors import BrokerUnavailable, ConfigError, TransportClosed
from .._logs import get_logger
from ._listen import NotificationsMissed, PgListener, open_listener

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

__all__ = ["NotifyHub", "open_notify_hub"]

log = get_logger("durable_trio.postgres")


class NotifyHub:
    """Fans one :class:`~._listen.PgListener`'s notifications out to callbacks by channel.

    Made and run by :func:`open_notify_hub`. Subscriptions stay until
    :meth:`unsubscribe`; a channel is ``LISTEN`` ed while it has a callback.

    Attributes:
        listener: the one listening connection (its ``reconnects``, ``connected``).
    """

    def __init__(self, listener: PgListener, nursery: trio.Nursery | None = None) -> None:
        self.listener = listener
        self._nursery = nursery
        self._callbacks: dict[str, list[Callable[[str | None], None]]] = {}

    @property
    def channels(self) -> frozenset[str]:
        """The channels with at least one callback."""
        return frozenset(self._callbacks)

    async def subscribe(self, channel: str, callback: Callable[[str | None], None]) -> None:
        """Call ``callback(payload)`` for every ``NOTIFY`` on ``channel`` from now on, and
        ``callback(None)`` once after each reconnect (notifications may have been missed).

        Returns once the channel is listened to: a ``NOTIFY`` committed after that reaches
        the callback.

        Args:
            channel: the channel (1 to 63 bytes; case-sensitive).
            callback: quick, never raising; called in the hub's task.

        Raises:
            BrokerUnavailable: the channel is not active in time (the connection is down). The
                subscription stands: once the connection is back the callback gets ``None``
                and then the channel's notifications.
            ConfigError: not a valid channel name (nothing subscribed).
            TransportClosed: the hub is closed.
        """
        callbacks = self._callbacks.get(channel)
        if callbacks is None:
            callbacks = self._callbacks[channel] = []
        callbacks.append(callback)
        try:
            await self.listener.listen(channel)
        except ConfigError:
            self._forget(channel, callback)
            raise

    def subscribe_soon(self, channel: str, callback: Callable[[str | None], None]) -> None:
        """:meth:`subscribe` from synchronous code (a run store's first waiter): the callback
        is registered now and the ``LISTEN`` sent by the hub's own task, after which the
        callback is called with ``None`` (a ``NOTIFY`` committed before the channel was active
        was not heard: the caller's waiters look again). A channel that cannot be listened
        to now is listened to after the reconnect (whose ``callback(None)`` covers the gap).

        Raises:
            TransportClosed: the hub is closed (or was made without its task's nursery).
        """
        if self._nursery is None:
            raise TransportClosed("the PostgreSQL notify hub is not running")
        self._callbacks.setdefault(channel, []).append(callback)
        self._nursery.start_soon(self._listen_quietly, channel, callback)

    async def _listen_quietly(self, channel: str, callback: Callable[[str | None], None]) -> None:
        """``LISTEN``, then ``callback(None)``: what was notified before the channel was
        active is looked at again now, not at the waiters' next poll (as a reconnect does)."""
        with contextlib.suppress(BrokerUnavailable, TransportClosed, ConfigError):
            await self.listener.listen(channel)
            if callback in self._callbacks.get(channel, ()):
                callback(None)

    async def unsubscribe(self, channel: str, callback: Callable[[str | None], None]) -> None:
        """Remove one subscription of ``callback`` to ``channel`` (the last one of a channel
        ``UNLISTEN`` s it). No-op if there is none.

        Raises:
            BrokerUnavailable: the ``UNLISTEN`` was not done in time (it will not be listened
                to again after a reconnect).
        """
        if self._forget(channel, callback) and channel in self.listener.channels:
            await self.listener.unlisten(channel)
        else:
            await trio.lowlevel.checkpoint()

    def _forget(self, channel: str, callback: Callable[[str | None], None]) -> bool:
        """Drop one subscription; ``True`` if the channel has none left."""
        callbacks = self._callbacks.get(channel)
        if callbacks is None or callback not in callbacks:
            return False
        callbacks.remove(callback)
        if callbacks:
            return False
        del self._callbacks[channel]
        return True

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Read the listener and call the callbacks until it is closed."""
        task_status.started()
        while True:
            try:
                event = await self.listener.receive()
            except TransportClosed:
                return
            if isinstance(event, NotificationsMissed):
                # Every callback of every channel: each looks again once.
                targets: list[tuple[Callable[[str | None], None], Any]] = [
                    (callback, None) for cbs in self._callbacks.values() for callback in cbs
                ]
            else:
                targets = [(cb, event.payload) for cb in self._callbacks.get(event.channel, ())]
            for callback, payload in targets:
                try:
                    callback(payload)
                except Exception:
                    # A broken callback must not stop the other parts' wake-ups.
                    log.exception("PostgreSQL notify hub: a callback raised")


@asynccontextmanager
async def open_notify_hub(conninfo: str, **listener_options: Any) -> AsyncIterator[NotifyHub]:
    """Open the hub (its listener's connection and its task) for the block.

    Args:
        conninfo: a ``postgresql://`` URL or a ``key=value`` string.
        **listener_options: passed to :func:`~._listen.open_listener` (``command_timeout``,
            ``ping_interval``, ``backoff_initial``, ...).

    Yields:
        the running hub.

    Raises:
        ConfigError: a bad URL or option.
    """
    async with open_listener(conninfo, **listener_options) as listener, trio.open_nursery() as n:
        hub = NotifyHub(listener, n)
        await n.start(hub.run)
        try:
            yield hub
        finally:
            # The hub's task ends by this nursery's own cancel (the listener, closed after,
            # is not the hub's to close).
            n.cancel_scope.cancel()
