"""The workload of a simulation: its runs started at seeded arrival times, each on an engine up
(again on the next one if that engine dies), and each one's outcome awaited."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import trio

from .._engine import RunCancelled, RunFailed, RunNotFound

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._sim_engines import Engines
    from ._sim_ledger import Ledger

__all__ = ["Runs"]


class Runs:
    """The runs the workload starts: what each was started with, and how each ended.

    Args:
        workload: ``(rng, index) -> (workflow, input)`` for the ``index``-th run.
        seed: the simulation's seed (arrivals and inputs draw from ``"{seed}:workload"``).
        count: runs started.
        duration: virtual seconds during which they start.
        engines: where they are started and awaited.
        ledger: where they are recorded.
    """

    def __init__(
        self,
        workload: Callable[[random.Random, int], tuple[str, Any]],
        *,
        seed: int,
        count: int,
        duration: float,
        engines: Engines,
        ledger: Ledger,
    ) -> None:
        self.workload = workload
        self.seed = seed
        self.count = count
        self.duration = duration
        self.engines = engines
        self.ledger = ledger
        self.inputs: dict[str, tuple[str, Any]] = {}
        """Run id: (workflow, input), for every run started."""
        self.outcomes: dict[str, tuple[str, Any]] = {}
        """Run id: (status, output or error), for every run that ended."""
        self.signals: Any = None
        """Issue 18: ``(rng, workflow, input) -> [(delay, name, payload)]``, each run's
        signals (see :mod:`._sim_signals`), or ``None``."""
        self.updates: Any = None
        """Issue 34: ``(rng, workflow, input) -> [(delay, name, payload, value)]``, each
        run's updates (see :mod:`._sim_updates`), or ``None``."""
        self.cancels: Any = None
        """Issue 18: ``(rng, workflow, input) -> delay or None``, each run's cancel (see
        :mod:`._sim_cancels`), or ``None``."""
        self.tags: Any = None
        """Issue 34: ``(workflow, input) -> tags`` of each run started, or ``None``."""
        self.asked: dict[str, bool] = {}
        """Run id: whether its cancel said it cancelled it, for every run cancelled."""

    @property
    def unfinished(self) -> int:
        return len(self.inputs) - len(self.outcomes)

    async def start(self, runs: trio.Nursery) -> None:
        """Start each run at its time, and await its outcome in ``runs``."""
        rng = random.Random(f"{self.seed}:workload")
        arrivals = sorted(rng.uniform(0, self.duration) for _ in range(self.count))
        for index, at in enumerate(arrivals):
            await trio.sleep_until(self.ledger.t0 + at)
            workflow, value = self.workload(rng, index)
            run_id = f"run-{index:05d}"
            self.inputs[run_id] = (workflow, value)
            # Idempotent by run id: started again on the next engine if need be. (Awaited here:
            # the loop's variables cannot move under the call.)
            tags = {} if self.tags is None else {"tags": self.tags(workflow, value)}
            await self.engines.call(
                lambda engine: engine.start(workflow, value, run_id=run_id, **tags),  # noqa: B023
                index,
            )
            self.ledger.event("start", run=run_id, workflow=workflow)
            runs.start_soon(self._await, run_id)
            if self.signals is not None:
                from ._sim_signals import send_signals

                runs.start_soon(
                    send_signals,
                    self.signals, self.seed, run_id, workflow, value, self.engines, self.ledger,
                )  # fmt: skip
            if self.updates is not None:
                from ._sim_updates import send_updates

                runs.start_soon(
                    send_updates,
                    self.updates, self.seed, run_id, workflow, value, self.engines, self.ledger,
                )  # fmt: skip
            if self.cancels is not None:
                from ._sim_cancels import cancel_later

                runs.start_soon(
                    cancel_later,
                    self.cancels, self.seed, run_id, workflow, value, self.engines, self.ledger,
                    self.asked,
                )  # fmt: skip

    async def _await(self, run_id: str) -> None:
        try:
            output = await self.engines.call(lambda engine: engine.result(run_id))
        except RunCancelled as exc:  # (a RunFailed: caught first)
            self.outcomes[run_id] = ("cancelled", exc.error)
        except RunFailed as exc:
            self.outcomes[run_id] = ("failed", exc.error)
        except RunNotFound:
            # Retention pruned it before it was read (its engine killed meanwhile): its end is
            # the one the prune deleted.
            pruned = self.engines.store.prunes.get(run_id)
            if pruned is None:
                raise
            run = pruned.run
            self.outcomes[run_id] = (
                run.status.value,
                run.output if run.status.value == "completed" else run.error,
            )
        else:
            self.outcomes[run_id] = ("completed", output)
        self.ledger.event("end-run", run=run_id, status=self.outcomes[run_id][0])
