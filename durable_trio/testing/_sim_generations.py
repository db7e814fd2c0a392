"""Continue-as-new in a simulation (issue 34, item 5): a run's whole history across its
generations, and the invariant that a continued run's histories chain without gap.

For each run, previous generations ``0 .. G-1`` and the current one ``G``: generation ``g``'s
mark (``continue:run``; the first generation may have none) says ``g``, its numbered steps are
exactly ``lastStep + 1 .. `` the next generation's ``lastStep`` (no step id skipped, none
reused), and the signals the next generation's mark carries over are exactly the signals the
generations before it consumed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from .._engine import StepKind, StepState
from .._engine._generations import CONTINUE_STEP_ID, continuation_of
from .._engine._records import step_position
from .._engine._stores._generations import MemoryGenerations, generations_of

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._engine import StepRecord
    from .._engine._stores import RunStore

__all__ = [
    "GuardedGenerations",
    "PrunedGeneration",
    "RecordingGenerations",
    "check_generations",
    "run_history",
]


async def generations(store: RunStore, run_id: str) -> list[list[StepRecord]]:
    """Each generation's checkpoints, the first generation first, the current one last."""
    keeper = generations_of(store)
    out = [
        await keeper.get_generation(run_id, g) or [] for g in await keeper.list_generations(run_id)
    ]
    return [*out, await store.get_steps(run_id)]


async def run_history(store: RunStore, run_id: str) -> list[StepRecord]:
    """The run's numbered checkpoints (and marks of cancels, versions) of every generation, in
    order: step ids never repeat across generations, so it reads as one history."""
    return [
        step
        for history in await generations(store, run_id)
        for step in history
        if step.step_id != CONTINUE_STEP_ID
    ]


async def check_generations(
    store: RunStore, run_ids: list[str], violation: Callable[[str], None]
) -> int:
    """The invariant of the module docstring, over ``run_ids``. With retention, the oldest
    previous generations may be gone: those kept must be ``K .. G-1`` (none missing between
    the oldest kept and the current one), checked from ``K`` on.

    Returns:
        How many of them continued as new at least once.
    """
    continued = 0
    for run_id in run_ids:
        histories = await generations(store, run_id)
        current = continuation_of(
            next((s for s in histories[-1] if s.step_id == CONTINUE_STEP_ID), None)
        ).generation
        if current == 0:
            continue
        continued += 1
        numbers = await generations_of(store).list_generations(run_id)
        first = current - (len(histories) - 1)
        if numbers != list(range(first, current)):
            violation(
                f"{run_id}: previous generations {numbers}, not {first} .. {current - 1} "
                "(kept without gap up to the current one)"
            )
            continue
        kept_from = continuation_of(
            next((s for s in histories[0] if s.step_id == CONTINUE_STEP_ID), None)
        )
        consumed: dict[str, int] = dict(kept_from.signals) if first > 0 else {}
        for g, history in enumerate(histories, start=first):
            mark = next((s for s in history if s.step_id == CONTINUE_STEP_ID), None)
            start = continuation_of(mark)
            if (mark is not None or g > 0) and start.generation != g:
                violation(f"{run_id}: generation {g}'s mark says {start.generation}")
            if g > 0 and start.signals != {k: v for k, v in consumed.items() if v}:
                violation(
                    f"{run_id}: generation {g} carries signals {start.signals} over, the "
                    f"generations before it consumed {consumed}"
                )
            positions = sorted(step_position(s.step_id) for s in history if s.step_id.isdigit())
            if g < current:  # ended: its ids run up to the next generation's start
                following = next(
                    (s for s in histories[g + 1 - first] if s.step_id == CONTINUE_STEP_ID), None
                )
                end = continuation_of(following).last_step
                if positions != list(range(start.last_step + 1, end + 1)):
                    violation(
                        f"{run_id}: generation {g} holds steps {positions}, not "
                        f"{start.last_step + 1} .. {end} (a gap, or an id reused)"
                    )
            elif positions and positions[0] != start.last_step + 1:
                violation(
                    f"{run_id}: the current generation {g} starts at step {positions[0]}, "
                    f"not {start.last_step + 1}"
                )
            for step in history:
                if step.kind is StepKind.SIGNAL and step.status is StepState.COMPLETED:
                    consumed[step.name] = consumed.get(step.name, 0) + 1
    return continued


class GuardedGenerations:
    """The generations of the shared store through one engine's view of it (``_EngineStore``:
    once that engine is killed, every call raises, as its other calls do)."""

    def __init__(self, view: Any) -> None:
        self._view = view

    async def continue_run(self, run_id: str, mark: StepRecord, input: Any) -> bool:
        keeper = generations_of(self._view.inner)
        return bool(await self._view._call(lambda: keeper.continue_run(run_id, mark, input)))

    async def get_generation(self, run_id: str, generation: int) -> list[StepRecord] | None:
        keeper = generations_of(self._view.inner)
        result: list[StepRecord] | None = await self._view._call(
            lambda: keeper.get_generation(run_id, generation)
        )
        return result

    async def list_generations(self, run_id: str) -> list[int]:
        keeper = generations_of(self._view.inner)
        result: list[int] = await self._view._call(lambda: keeper.list_generations(run_id))
        return result

    async def prune_generations(
        self, ended_before: float, *, workflow: str | None = None, limit: int = 100
    ) -> int:
        keeper = generations_of(self._view.inner)
        result: int = await self._view._call(
            lambda: keeper.prune_generations(ended_before, workflow=workflow, limit=limit)
        )
        return result

    async def count_generations(self, ended_before: float, *, workflow: str | None = None) -> int:
        keeper = generations_of(self._view.inner)
        result: int = await self._view._call(
            lambda: keeper.count_generations(ended_before, workflow=workflow)
        )
        return result

    async def generation_workflows(self) -> list[str]:
        keeper = generations_of(self._view.inner)
        result: list[str] = await self._view._call(keeper.generation_workflows)
        return result


@attrs.frozen
class PrunedGeneration:
    """A previous generation a prune deleted: its run, number, the run's workflow, when it
    ended (the next generation's mark), when it was pruned and the prune's cut-off."""

    run_id: str
    generation: int
    workflow: str
    ended_at: float
    at: float
    ended_before: float


class RecordingGenerations(MemoryGenerations):
    """The generations of a simulation's shared store (``RecordingStore.generations``): every
    previous generation a prune deletes is recorded (``store.generation_prunes``)."""

    async def prune_generations(
        self, ended_before: float, *, workflow: str | None = None, limit: int = 100
    ) -> int:
        store = self._store
        before = {  # (the prune is atomic: no checkpoint until it has run)
            (run.run_id, g): (run.workflow, ended)
            for run in store._runs.values()
            for g, ended in run.generation_ends.items()
        }
        pruned = await super().prune_generations(ended_before, workflow=workflow, limit=limit)
        now = store.now()
        after = {
            (run.run_id, g) for run in store._runs.values() for g in run.generation_ends
        }
        for (run_id, g), (name, ended) in sorted(before.items()):
            if (run_id, g) not in after and run_id in store._runs:
                store.generation_prunes.append(
                    PrunedGeneration(run_id, g, name, ended, now, ended_before)
                )
        return pruned
