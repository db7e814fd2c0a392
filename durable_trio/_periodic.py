"""Fixed-rate ticks: the timer of every loop whose ticks are due on a fixed grid.

``async for tick in fixed_rate(period)`` wakes on ``start + k * period`` (``start``: when
:func:`fixed_rate` was called; ``k`` = 1, 2, ...) and yields ``k``. The grid never drifts,
whatever the scheduler's latency on each wake-up. A body that overran one or more grid
points is followed by the next point still ahead (the ticks it overran are skipped, not
stacked); with ``catch_up=True`` by every point it overran instead, one at once after the
other. Where a loop uses ``trio_util.periodic`` and where this: docs/decisions.md
("Periodic loops: trio_util.periodic or fixed_rate").

A plain class, not an async generator: a loop left by a cancellation or a ``break`` leaves
nothing to finalize.
"""

from __future__ import annotations

import math

import trio

__all__ = ["FixedRate", "fixed_rate"]


class FixedRate:
    """The ticks of :func:`fixed_rate` (an async iterator of the tick numbers)."""

    __slots__ = ("_catch_up", "_period", "_start", "_tick")

    def __init__(self, period: float, *, catch_up: bool = False) -> None:
        self._period = period
        self._catch_up = catch_up
        self._start = trio.current_time()
        self._tick = 0

    def __aiter__(self) -> FixedRate:
        return self

    async def __anext__(self) -> int:
        period, start = self._period, self._start
        tick = self._tick + 1
        if not self._catch_up:
            # The next grid point still ahead: a slow body skips the ticks it overran.
            tick = max(tick, math.floor((trio.current_time() - start) / period) + 1)
        self._tick = tick
        await trio.sleep_until(start + tick * period)
        return tick


def fixed_rate(period: float, *, catch_up: bool = False) -> FixedRate:
    """Ticks on ``now + k * period`` for k = 1, 2, ... (see the module docstring)."""
    return FixedRate(period, catch_up=catch_up)
