"""A ``NotifyHub`` for the tests: the run store's wakes heard on a real ``LISTEN`` connection
(:func:`~durable_trio._postgres.open_listener`), so two stores on two pools wake each other as
two processes would. The backend's own hub is ``durable_trio/_postgres/_hub.py``; this one has
only what the store's protocol asks for."""

from __future__ import annotations

import contextlib
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

from durable_trio._errors import BrokerUnavailable, TransportClosed
from durable_trio._postgres import NotificationsMissed, PgListener, open_listener

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

__all__ = ["ListenerHub", "open_listener_hub"]


class ListenerHub:
    """Callbacks by channel, fed by one listener (see :func:`open_listener_hub`)."""

    def __init__(self, listener: PgListener, nursery: trio.Nursery) -> None:
        self._listener = listener
        self._nursery = nursery
        self._callbacks: dict[str, list[Callable[[str | None], None]]] = {}
        self.subscriptions = 0

    def subscribe(self, channel: str, callback: Callable[[str | None], None]) -> None:
        """Call ``callback(payload)`` per notification on ``channel``; ``callback(None)`` when
        some may have been missed."""
        self.subscriptions += 1
        self._callbacks.setdefault(channel, []).append(callback)
        self._nursery.start_soon(self._listen, channel)

    async def _listen(self, channel: str) -> None:
        # Not active in time: it stays wanted, and the reconnect's "missed" covers it.
        with contextlib.suppress(BrokerUnavailable, TransportClosed):
            await self._listener.listen(channel)

    async def run(self) -> None:
        async for event in self._listener:
            if isinstance(event, NotificationsMissed):
                for callbacks in list(self._callbacks.values()):
                    for callback in list(callbacks):
                        callback(None)
            else:
                for callback in list(self._callbacks.get(event.channel, ())):
                    callback(event.payload)


@asynccontextmanager
async def open_listener_hub(url: str) -> AsyncIterator[ListenerHub]:
    """A hub on a listener of its own to ``url``, closed on leaving."""
    async with open_listener(url) as listener, trio.open_nursery() as nursery:
        hub = ListenerHub(listener, nursery)
        nursery.start_soon(hub.run)
        yield hub
        nursery.cancel_scope.cancel()
