"""The calendar clock of an engine's schedules: the one its durable timers follow.

Durable timers (``ctx.sleep``, signal timeouts) read the run store's clock (``store.now()``):
the memory store's is trio's, so under a ``MockClock`` (pytest-trio's ``autojump_clock``, the
``durable_trio.testing.fixtures`` plugin, the ``Simulation``) a timer of hours takes no wall
time. Schedules read a calendar (Unix seconds, for cron and ``every``); if that were always
``time.time()``, a test whose timers are virtual would see no tick at all in hours of virtual
time. So unless ``open_engine(wall_clock=...)`` names one, the engine's calendar follows the
store: virtual (:func:`~durable_trio.testing.virtual_wall_clock`, a fixed whole-hour epoch plus
trio's time) exactly when the store's timers are virtual, ``time.time`` otherwise.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["calendar_clock", "follow_the_timers", "virtual_wall_clock"]


def follow_the_timers() -> float:
    """``EngineOptions.wall_clock``'s default: a marker that ``open_engine`` replaces with
    :func:`calendar_clock` of its run store. Called as it is (an engine built by hand), it is
    ``time.time()``."""
    return time.time()


def calendar_clock(store: object) -> Callable[[], float]:
    """The calendar that moves with ``store``'s timers, in the current trio run.

    Virtual (``virtual_wall_clock()``: 2027-01-15 08:00:00 UTC at trio time 0, so
    ``every=60`` ticks fall at exactly t = 60, 120, ...) when the store's clock is trio's (the
    memory store; a SQLite or Redis store after ``follow_trio_clock()``) and trio's clock is a
    ``MockClock``; ``time.time`` otherwise (trio's real clock moves with the wall clock, and
    a SQLite or Redis store reads the wall clock itself).
    """
    # A MockClock exists only once trio.testing is imported (which imports pytest, when it is
    # installed: production code does not import it itself).
    testing = sys.modules.get("trio.testing")
    if (
        getattr(store, "trio_clock", False)
        and testing is not None
        and isinstance(trio.lowlevel.current_clock(), testing.MockClock)
    ):
        return virtual_wall_clock()
    return time.time


def virtual_wall_clock(epoch: float = 1_800_000_000.0) -> Callable[[], float]:
    """A wall clock for tests: ``epoch + trio.current_time()``, so a scheduler under trio's
    virtual clock (``autojump_clock``) sees calendar time move with it. The default epoch,
    2027-01-15 08:00:00 UTC, is a whole hour, so ``every=60`` ticks fall at virtual
    t = 60, 120, ..."""
    return lambda: epoch + trio.current_time()
