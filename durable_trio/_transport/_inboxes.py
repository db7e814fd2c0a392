"""The inbox registry of the store-less tenant protocol (T21, T22, docs/spec.md).

A queue job has one consumer, so what BullMQ broadcasts on pub/sub (run replies, tenant events)
rides per-instance *inbox* queues here: ``{prefix}:run-replies:{instance}`` and
``{prefix}:tenant-events:{instance}``. An instance that subscribes to a tenant's events
*announces* an :class:`InboxRegistration` on ``{prefix}:inbox-registrations`` (at once, and again
every ``inbox_ttl / 3`` while it lasts); the control plane *records* each in its key store as
``{prefix}-inbox:{instance}`` with that time-to-live, and reads them (through a short cache) to
know whose inbox a tenant's event goes to. A *janitor* on the control plane drains the inboxes it
pushed to whose owner stopped announcing: what is addressed to a process that went away has no
one else to go to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
import trio

from .._errors import BrokerError, DurableTrioError
from .._periodic import fixed_rate
from .._wire import InboxRegistration, JobKind, WorkerAdvertisement

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from .._naming import QueueNames
    from ._ports import KeyEntry, KeyStore

__all__ = ["ForwardingKeyStore", "InboxRegistry"]


class InboxRegistry:
    """Both halves of the registration protocol: announcing (any instance) and recording,
    reading and sweeping (the control plane)."""

    def __init__(
        self,
        *,
        names: QueueNames,
        instance: str,
        keys: KeyStore | None,
        ttl: float,
        cache: float,
        announce: Callable[[JobKind, Any], Awaitable[None]],
        drain: Callable[[str, int], Awaitable[bool]],
        report: Callable[[BaseException], None],
    ) -> None:
        self._names = names
        self._instance = instance
        self._keys = keys
        self.ttl = ttl
        self._cache_for = cache
        self._announce = announce
        self._drain = drain
        self._report = report
        self.tenants: dict[str, None] = {}  # ordered set of subscribed tenants
        self.active = False  # an inbox of this instance is consumed: announce it alive
        self._nursery: trio.Nursery | None = None
        self._announcing = False
        self._cache: tuple[float, Sequence[KeyEntry]] | None = None
        self._pushed: dict[str, str] = {}  # inbox queue -> owner instance
        self._announcements = trio.Lock()  # announcements leave in the order they were made

    def attach(self, nursery: trio.Nursery) -> None:
        """Where announcements and the periodic tasks run (the transport's inboxes group)."""
        self._nursery = nursery

    # ---- the announcing side -------------------------------------------------------------

    def activate(self) -> None:
        """An inbox of this instance is being consumed (its reply inbox, say): announce it
        alive, now and every ``ttl / 3``, so the janitor leaves it alone."""
        if self.active:
            return
        self.active = True
        self._send_now()
        if not self._announcing and self._nursery is not None:
            self._announcing = True
            self._nursery.start_soon(self._reannounce_forever)

    def subscribe(self, tenant: str) -> None:
        if tenant in self.tenants:
            return
        self.tenants[tenant] = None
        if self.active:
            self._send_now()
        else:
            self.activate()

    def unsubscribe(self, tenant: str) -> None:
        if tenant in self.tenants:
            del self.tenants[tenant]
            self._send_now()  # the last handler of that tenant went: withdraw the subscription

    def _registration(self) -> InboxRegistration:
        return InboxRegistration(
            self._instance, tuple(self.tenants), self.ttl, withdrawn=not self.active
        )

    def _send_now(self) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(self._send)

    async def _send(self) -> None:
        """Announce this instance's registration as it stands when the announcement LEAVES
        (not when it was asked for): announcement tasks may start in any order, so a snapshot
        taken earlier could land last and overwrite a newer state (a subscription lost)."""
        async with self._announcements:
            try:
                await self._announce(JobKind.INBOX_REGISTRATION, self._registration())
            except (BrokerError, DurableTrioError) as exc:
                self._report(exc)

    async def _reannounce_forever(self) -> None:
        async for _ in fixed_rate(self.ttl / 3):
            if self.active:
                await self._send()

    async def withdraw(self) -> None:
        """Close: withdraw this instance's registration (the caller bounds it)."""
        if self.active:
            self.active = False
            self.tenants.clear()
            await self._send()

    # ---- the control-plane side ------------------------------------------------------------

    async def record(self, registration: InboxRegistration) -> None:
        """Record (or withdraw) one registration in this control plane's key store."""
        if self._keys is None:
            raise BrokerError("this control plane has no key store to record registrations in")
        key = self._names.inbox(registration.instance)
        if registration.withdrawn:
            await self._keys.remove([key])
        else:
            value = orjson.dumps(
                {"instance": registration.instance, "tenants": list(registration.tenants)}
            )
            await self._keys.put(key, value, registration.ttl)
        self._cache = None  # a change made here is seen here at once

    async def record_advertisement(self, advertisement: WorkerAdvertisement) -> None:
        """Record a store-less pod's forwarded key (its liveness, its descriptor)."""
        if self._keys is None:
            raise BrokerError("this control plane has no key store to record advertisements in")
        if advertisement.withdrawn:
            await self._keys.remove([advertisement.key])
        else:
            value = orjson.dumps(advertisement.value)
            await self._keys.put(advertisement.key, value, advertisement.ttl)

    async def _registrations(self) -> Sequence[KeyEntry]:
        if self._keys is None:
            return []
        now = trio.current_time()
        if self._cache is None or now - self._cache[0] >= self._cache_for:
            self._cache = (now, await self._keys.entries(self._names.inbox("")))
        return self._cache[1]

    async def subscribers_of(self, tenant: str) -> list[str]:
        """The instances with a live subscription to ``tenant`` (read through the cache)."""
        return [
            instance for instance, tenants in await self._live_registrations() if tenant in tenants
        ]

    async def _live_registrations(self) -> list[tuple[str, list[str]]]:
        found = []
        for entry in await self._registrations():
            try:
                raw = orjson.loads(entry.value)
                instance, tenants = raw["instance"], raw["tenants"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                continue
            if type(instance) is str and type(tenants) is list:
                found.append((instance, tenants))
        return found

    def note_push(self, queue: str, owner: str) -> None:
        """Remember an inbox this control plane pushed to, for the janitor."""
        self._pushed[queue] = owner

    async def sweep(self, live_owners: Sequence[str] | None = None) -> int:
        """The janitor: drain the inboxes this control plane pushed to whose owner stopped
        announcing (no live registration). Returns how many inboxes it emptied."""
        if live_owners is None:
            self._cache = None
            live_owners = [instance for instance, _ in await self._live_registrations()]
        live = set(live_owners)
        emptied = 0
        for queue, owner in list(self._pushed.items()):
            if owner in live:
                continue
            try:
                if await self._drain(queue, 1000):
                    del self._pushed[queue]
                    emptied += 1
            except (BrokerError, DurableTrioError) as exc:
                self._report(exc)
        return emptied

    async def janitor_forever(self, interval: float) -> None:
        async for _ in fixed_rate(interval):
            try:
                await self.sweep()
            except (BrokerError, DurableTrioError) as exc:
                self._report(exc)


class ForwardingKeyStore:
    """The key store of a store-less pod: writes are forwarded to the control plane as
    :class:`WorkerAdvertisement` jobs, which it records in its own store (T22). Reads find
    nothing: a pod has no store to read."""

    def __init__(self, announce: Callable[[JobKind, Any], Awaitable[None]]) -> None:
        self._announce = announce

    async def put(self, key: str, value: bytes, ttl: float) -> None:
        advertisement = WorkerAdvertisement(key=key, value=orjson.loads(value), ttl=ttl)
        await self._announce(JobKind.ADVERTISEMENT, advertisement)

    async def put_many(self, items: Sequence[tuple[str, bytes, float]]) -> None:
        for key, value, ttl in items:
            await self.put(key, value, ttl)

    async def remove(self, keys: Sequence[str]) -> None:
        for key in keys:
            await self._announce(JobKind.ADVERTISEMENT, WorkerAdvertisement(key, withdrawn=True))

    async def entries(self, prefix: str) -> list[KeyEntry]:
        await trio.lowlevel.checkpoint()
        return []

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
