"""The engine's periodic work: lease renewal (and the engine's key, ._advert), reconcile and
the store watch.

Each loop is a task in the engine's loops nursery, ticking at ``start + k * period`` (no
drift: ``fixed_rate``; a tick that overran is followed at once by the ones it overran,
``catch_up``); a store error is reported and the next tick tries again.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import trio

from .._errors import BrokerError
from .._periodic import fixed_rate
from ._stores._wakes import STARTS, STEPS, SupportsRunWakes, following

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._advert import EngineAdvert
    from ._services import EngineServices

__all__ = ["EngineTimers"]


class EngineTimers:
    """The loops that keep one engine's runs owned and its waiters fresh."""

    def __init__(self, services: EngineServices, advert: EngineAdvert) -> None:
        self.services = services
        self.advert = advert

    def start(self, nursery: trio.Nursery, reconcile: Callable[[], Awaitable[object]]) -> None:
        """Start the loops the options ask for in ``nursery`` (which the engine cancels to
        stop them); ``reconcile`` takes over runs nobody drives."""
        options = self.services.options
        if options.reconcile and options.reconcile_interval:
            nursery.start_soon(self.reconcile_forever, reconcile, options.reconcile_interval)
        if options.reconcile:
            nursery.start_soon(self.reconcile_on_starts, reconcile)
        nursery.start_soon(self.renew_leases)
        nursery.start_soon(self.advertise)
        if options.watch_interval:
            nursery.start_soon(self.watch_forever, options.watch_interval)

    async def renew_leases(self) -> None:
        """Every ``run_lease / 3``: renew the leases of the runs driven here; stop the driver
        of a run whose lease was not renewed."""
        async for _ in fixed_rate(self.services.options.run_lease / 3, catch_up=True):
            await self._renew()

    async def advertise(self) -> None:
        """Every ``run_lease / 3``: write the engine's key again (._advert). Its own loop, not
        a step of the renewal's: a slow or failing key store must never delay a lease renewal
        (a lapsed lease hands the engine's runs to another engine)."""
        interval = self.services.options.run_lease / 3
        async for _ in fixed_rate(interval, catch_up=False):
            with trio.move_on_after(interval):
                await self.advert.write()

    async def _renew(self) -> None:
        services = self.services
        options = services.options
        owned = list(services.drivers)
        if not owned:
            return
        try:
            kept = await services.store.renew_runs(options.engine_id, owned, options.run_lease)
        except BrokerError as exc:
            services.report(exc)
            return
        for run_id in owned:
            driver = services.drivers.get(run_id)
            if run_id not in kept and driver is not None and not driver.settling:
                # Taken over (our lease lapsed), or settled elsewhere (cancelled).
                services.count("lost_runs")
                driver.scope.cancel()

    async def reconcile_forever(
        self, reconcile: Callable[[], Awaitable[object]], interval: float
    ) -> None:
        """Every ``interval``: ``await reconcile()``."""
        async for _ in fixed_rate(interval, catch_up=True):
            try:
                await reconcile()
            except BrokerError as exc:
                self.services.report(exc)

    async def reconcile_on_starts(self, reconcile: Callable[[], Awaitable[object]]) -> None:
        """``await reconcile()`` at once whenever the store rings :data:`STARTS` (a detached
        run recorded by any process: issue 30, item 1), or may have lost rings; the rings
        that come meanwhile make one more. A store without wakes: only the periodic
        reconcile."""
        bell = trio.Event()
        # Followed (not watched) for the loop's life: a ring during a reconcile is kept.
        with following(self.services.store, STARTS, lambda: bell.set()) as rings:
            if not rings:
                await trio.lowlevel.checkpoint()
                return
            while True:
                await bell.wait()
                bell = trio.Event()
                try:
                    await reconcile()
                except BrokerError as exc:
                    self.services.report(exc)

    async def watch_forever(self, interval: float) -> None:
        """Every ``interval``: re-read the checkpoints waited on (results applied by another
        engine reach their waiters this way); at once for a run whose result another engine
        applied and rang the store's wakes about (``step_key``)."""
        services = self.services
        store = services.store
        wakes = store.wakes if isinstance(store, SupportsRunWakes) else None
        rung: set[str] = set()
        all_rung = False
        bell = trio.Event()

        def follower(key: str | None) -> None:
            nonlocal all_rung
            if key is None:
                all_rung = True
            elif key.startswith(STEPS):
                rung.add(key[len(STEPS) :])
            else:
                return
            bell.set()

        stop = wakes.follow(follower) if wakes is not None else (lambda: None)
        try:
            next_tick = trio.current_time() + interval
            while True:
                with trio.move_on_at(next_tick):
                    await bell.wait()
                bell = trio.Event()
                now = trio.current_time()
                older = -math.inf  # between ticks: only the runs rung
                if now >= next_tick:
                    next_tick += interval * (int((now - next_tick) // interval) + 1)
                    # Only waiters older than a tick: a younger one read the store since.
                    older = now - interval
                keys = [
                    key
                    for key, w in services.waiters.items()
                    if w.record is not None and (all_rung or key[0] in rung or w.since <= older)
                ]
                rung.clear()
                all_rung = False
                if not keys:
                    continue
                try:
                    records = await store.get_steps_many(keys)
                except BrokerError as exc:
                    services.report(exc)
                    continue
                for key, record in zip(keys, records, strict=True):
                    waiter = services.waiters.get(key)
                    if waiter is not None and record is not None:
                        waiter.update(record)
        finally:
            stop()
