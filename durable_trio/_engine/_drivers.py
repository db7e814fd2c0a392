"""The drivers of the runs one engine drives: :class:`Drivers`, the one owner of that registry.

Every change to it is a method here: a driver added when the engine spawns it, forgotten when it
stops (kept as *unreleased* when a cancel from outside stopped it), and, at the close, the runs
in flight taken and every driver cancelled. The other pieces read it as a mapping (run id ->
driver): the lease renewal, reconcile, cancel delivery, result application, ``engine.result``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

import trio

if TYPE_CHECKING:
    from ._app import WorkflowDefinition
    from ._records import RunRecord

__all__ = ["Driver", "Drivers"]


class Driver(Protocol):
    """One run's driver as the engine sees it (a local or a remote workflow's)."""

    @property
    def run(self) -> RunRecord:
        """The run it drives (as it was when the driver started)."""

    @property
    def scope(self) -> trio.CancelScope:
        """Cancelled to stop it where it waits (a cancel, a lost lease, the engine closing)."""

    @property
    def done(self) -> trio.Event:
        """Set once it stopped."""

    @property
    def final(self) -> RunRecord | None:
        """The run as it ended (``None``: it stopped without seeing it end)."""

    @property
    def settling(self) -> bool:
        """It is writing the run's outcome: a lease renewal must not cancel it."""

    async def drive(self, definition: WorkflowDefinition) -> None:
        """Drive the run until it ends or :attr:`scope` is cancelled."""


class Drivers(Mapping[str, Driver]):
    """The drivers of the runs this engine drives, by run id (a read-only mapping), and the
    runs whose driver a cancel from outside stopped, still owned here (:meth:`in_flight`)."""

    def __init__(self) -> None:
        self._drivers: dict[str, Driver] = {}
        self._unreleased: set[str] = set()
        self._claimed: set[str] = set()
        """Runs claimed here whose driver is not started yet (nor the run settled): released
        by the close if it comes between (a claim is a write the store has made)."""
        self._claims: set[trio.CancelScope] = set()
        self._claims_end = math.inf  # the close's bound on the claims still in flight

    def __getitem__(self, run_id: str) -> Driver:
        return self._drivers[run_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._drivers)

    def __len__(self) -> int:
        return len(self._drivers)

    def add(self, driver: Driver) -> None:
        """``driver`` drives its run here from now on."""
        self._drivers[driver.run.run_id] = driver
        self._claimed.discard(driver.run.run_id)

    @contextlib.contextmanager
    def claiming(self) -> Iterator[trio.CancelScope]:
        """The shield of one claim call: a close does not cut it (the store may have made the
        claim), but bounds it (:meth:`cancel_all`'s ``bound``). Its runs go to :meth:`claimed`
        inside it; a claim cut at that bound (``cancelled_caught``) claimed nothing known."""
        scope = trio.CancelScope(shield=True, deadline=self._claims_end)
        self._claims.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._claims.discard(scope)

    def claimed(self, run_ids: list[str]) -> None:
        """``run_ids`` were just claimed here: owned, not driven yet (one driven here already,
        its lease lapsed and claimed again, is its driver's)."""
        self._claimed.update(run_id for run_id in run_ids if run_id not in self._drivers)

    def settled(self, run_id: str) -> None:
        """A run claimed here was not driven after all (failed, set aside, timed out)."""
        self._claimed.discard(run_id)

    def forget(self, driver: Driver) -> None:
        """``driver`` stopped: it no longer drives its run."""
        run_id = driver.run.run_id
        if self._drivers.get(run_id) is driver:
            del self._drivers[run_id]
            # A cancel from around open_engine reaches the drivers before (or while) aclose
            # runs: what aclose must release is kept here, not lost with the driver. Not a
            # driver this engine stopped itself (a lost lease, a cancelled run, aclose: its run
            # is owned elsewhere, settled, or on aclose's list), nor one that ended without a
            # cancel (its run settled elsewhere): only those still under a cancel from outside.
            if (
                driver.final is None
                and not driver.scope.cancel_called
                and trio.current_effective_deadline() == -math.inf
            ):
                self._unreleased.add(run_id)

    def cancel_all(self, bound: float = math.inf) -> list[str]:
        """The close: cancel every driver where it waits, and let the claims in flight run to
        the Trio time ``bound`` at most; returns the runs still owned here (those driven, those
        a cancel from outside stopped, those claimed and not yet driven), to release."""
        self._claims_end = bound
        for scope in self._claims:
            scope.deadline = min(scope.deadline, bound)
        in_flight = [*self._drivers, *self.left_over()]
        for driver in list(self._drivers.values()):
            driver.scope.cancel()
        return in_flight

    def left_over(self) -> list[str]:
        """The runs owned here and driven by none (stopped by a cancel from outside, claimed
        and not yet driven), taken off these lists to be released. Once the loops and drivers
        stopped, what :meth:`cancel_all` could not list yet (a claim that landed after it, a
        driver stopped by its cancel before it ran)."""
        left = [*self._unreleased, *self._claimed]
        self._unreleased.clear()
        self._claimed.clear()
        return left

    async def wait_stopped(self) -> None:
        """Until every driver registered now has stopped (bound it with a cancel scope)."""
        for driver in list(self._drivers.values()):
            await driver.done.wait()
