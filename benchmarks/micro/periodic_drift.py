"""Drift of ``trio_util.periodic`` against ``fixed_rate``, under the real clock:
``python -m benchmarks.micro.periodic_drift [TICKS] [PERIOD]``.

Each timer ticks ``TICKS`` times (default 500) every ``PERIOD`` seconds (default 0.01), idle and
then beside busy tasks (each holds the event loop 1 ms between two checkpoints, as a handler's
synchronous stretch would). Per timer: how late the last tick is against ``start + TICKS *
PERIOD`` (the drift: ``periodic`` schedules each tick from the last one's actual wake time, so
every wake-up's latency adds up; ``fixed_rate`` aims at the grid), the median and the largest
lateness of one tick against its own grid point, and the grid points ``fixed_rate`` skipped (it
woke a whole period late or more; ``periodic`` never skips, it starts at once).
docs/decisions.md ("Periodic loops: trio_util.periodic or fixed_rate") records a run.
"""

from __future__ import annotations

import statistics
import sys
import time
from contextlib import aclosing

import trio
import trio.lowlevel
from trio_util import periodic

from durable_trio._periodic import fixed_rate

__all__ = ["measure"]

#: Busy tasks beside the timer in the loaded case, and how long each holds the loop.
_BUSY_TASKS = 4
_BUSY_HOLD = 0.001


async def _busy() -> None:
    while True:
        end = time.perf_counter() + _BUSY_HOLD
        while time.perf_counter() < end:
            pass
        await trio.lowlevel.checkpoint()


async def _one(timer: str, ticks: int, period: float, busy: bool) -> dict[str, float]:
    late: list[float] = []
    skipped = 0

    def tick(k: int) -> bool:
        nonlocal skipped
        skipped += k - (len(late) + skipped) - 1
        late.append(trio.current_time() - (start + k * period))
        return len(late) == ticks

    async with trio.open_nursery() as nursery:
        for _ in range(_BUSY_TASKS if busy else 0):
            nursery.start_soon(_busy)
        await trio.lowlevel.checkpoint()
        start = trio.current_time()
        if timer == "periodic":
            async with aclosing(periodic(period)) as each:
                async for _, since_last in each:
                    # Its first iteration is at once; the loops it would replace wait first.
                    if since_last is not None and tick(len(late) + 1):
                        break
        else:
            async for k in fixed_rate(period):
                if tick(k):
                    break
        nursery.cancel_scope.cancel()
    return {
        "drift_ms": late[-1] * 1000,
        "median_late_ms": statistics.median(late) * 1000,
        "max_late_ms": max(late) * 1000,
        "skipped": skipped,
    }


async def measure(ticks: int, period: float) -> dict[str, dict[str, float]]:
    """The figures per timer and case."""
    figures = {}
    for busy in (False, True):
        for timer in ("periodic", "fixed_rate"):
            figures[f"{timer}, {'busy' if busy else 'idle'}"] = await _one(
                timer, ticks, period, busy
            )
    return figures


def main() -> None:
    ticks = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    period = float(sys.argv[2]) if len(sys.argv) > 2 else 0.01
    print(f"{ticks} ticks of {period * 1000:g} ms, real clock (trio.run)")
    print(
        f"{'timer':<20} {'drift ms':>10} {'median late ms':>15} {'max late ms':>12} {'skipped':>8}"
    )
    for name, row in trio.run(measure, ticks, period).items():
        print(
            f"{name:<20} {row['drift_ms']:>10.2f} {row['median_late_ms']:>15.3f} "
            f"{row['max_late_ms']:>12.3f} {row['skipped']:>8.0f}"
        )


if __name__ == "__main__":
    main()
