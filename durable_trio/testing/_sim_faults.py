"""The scheduled faults of a simulation: kills, graceful restarts, renewal pauses and stalls of
the workers, and kills of the engines, at Poisson times drawn from the seed."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from ._report import Faults
    from ._sim_engines import Engines
    from ._sim_workers import WorkerSlots

__all__ = ["FaultSchedule"]

_HOUR = 3600.0


def _arrivals(rng: random.Random, rate_per_hour: float, duration: float) -> list[float]:
    """Poisson arrival times in ``[0, duration)``."""
    if rate_per_hour <= 0:
        return []
    times = []
    t = rng.expovariate(rate_per_hour / _HOUR)
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate_per_hour / _HOUR)
    return times


class FaultSchedule:
    """The seeded plan of scheduled faults, and the task that strikes each at its time.

    Args:
        seed: the simulation's seed (the plan draws from ``"{seed}:faults"``).
        faults: the rates and durations.
        duration: virtual seconds during which faults strike.
        workers, engines: the processes struck.
    """

    def __init__(
        self,
        *,
        seed: int,
        faults: Faults,
        duration: float,
        workers: WorkerSlots,
        engines: Engines,
    ) -> None:
        self.seed = seed
        self.faults = faults
        self.duration = duration
        self.workers = workers
        self.engines = engines

    def plan(self) -> list[tuple[float, str, int, float]]:
        """``(at, kind, process index, seconds)`` of every scheduled fault, in time order."""
        faults = self.faults
        rng = random.Random(f"{self.seed}:faults")
        plan: list[tuple[float, str, int, float]] = []
        kinds: list[tuple[str, float, tuple[float, float]]] = [
            ("kill", faults.kills_per_hour, (0.0, 0.0)),
            ("restart", faults.restarts_per_hour, (0.0, 0.0)),
            ("pause-renewal", faults.renewal_pauses_per_hour, faults.renewal_pause),
            ("stall", faults.stalls_per_hour, faults.stall),
        ]
        worker_count = len(self.workers.slots)
        for kind, rate, (low, high) in kinds:
            for at in _arrivals(rng, rate, self.duration):
                plan.append((at, kind, rng.randrange(worker_count), rng.uniform(low, high)))
        # (drawn last: a simulation without engine kills draws what it drew before they were)
        engine_count = self.engines.count
        for at in _arrivals(rng, faults.engine_kills_per_hour, self.duration):
            victim = rng.randrange(engine_count) if engine_count > 1 else 0
            plan.append((at, "engine-kill", victim, 0.0))
        plan.sort()
        return plan

    async def run(self, t0: float) -> None:
        """Strike each planned fault at its time (from ``t0``)."""
        for at, kind, index, seconds in self.plan():
            await trio.sleep_until(t0 + at)
            if kind == "engine-kill":
                self.engines.kill(index)
            else:
                self.workers.strike(index, kind, seconds)
