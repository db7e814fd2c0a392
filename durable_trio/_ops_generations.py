"""A run's generations as the operations API shows them (continue-as-new, issue 34, item 5):
``Operations.show_run(run_id, generation=N)`` and ``durable-trio runs show RUN --generation
N``. The current generation's mark is not shown as a step: its number is the view's
``generation``, the numbers of the previous ones its ``previous``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from ._engine._errors import RunNotFound
from ._engine._generations import CONTINUE_STEP_ID, continuation_of
from ._engine._stores._generations import generations_of
from ._errors import ConfigError
from ._ops_views import RunDetails, details_of

if TYPE_CHECKING:
    from ._engine._records import RunRecord, StepRecord
    from ._engine._stores import RunStore

__all__ = ["count_generations", "generation_details", "prune_generations"]


async def generation_details(store: RunStore, run: RunRecord, generation: int | None) -> RunDetails:
    """``run`` with the history of its ``generation`` (``None``: the current one).

    A previous generation is shown with the input it started with and as ``continued``: its
    steps as they ended (a step still pending in it is ``interrupted``).

    Retention deletes the oldest previous generations first (``previous`` lists those kept):
    one older than the oldest kept (or, none kept, than the current one) was removed by it.

    Raises:
        ConfigError: the run has no previous generation ``generation`` (the message says when
            retention removed it).
    """
    current = await store.get_steps(run.run_id)
    try:
        keeper = generations_of(store)
    except TypeError:  # a store that keeps no generations: its current one only
        return details_of(run, _numbered(current), store.now())
    previous = tuple(await keeper.list_generations(run.run_id))
    now = store.now()
    mark = next((s for s in current if s.step_id == CONTINUE_STEP_ID), None)
    number = continuation_of(mark).generation
    if generation is None or generation == number:
        details = details_of(run, _numbered(current), now)
        return attrs.evolve(details, generation=number, previous=previous)
    steps = await keeper.get_generation(run.run_id, generation)
    if steps is None:
        shown = ", ".join(map(str, previous)) or "none"
        if 0 <= generation < (previous[0] if previous else number):
            raise ConfigError(
                f"generation {generation} of run {run.run_id!r} was removed by retention "
                f"(kept: {shown}; current: {number})"
            )
        raise ConfigError(
            f"run {run.run_id!r} has no previous generation {generation} (previous: {shown}; "
            f"current: {number})"
        )
    start = continuation_of(next((s for s in steps if s.step_id == CONTINUE_STEP_ID), None))
    # Shown as a run that ended: what it left pending will never settle in it.
    ended = attrs.evolve(run, input=start.input, status=type(run.status).COMPLETED, output=None)
    details = details_of(ended, _numbered(steps), now)
    shown_run = attrs.evolve(run, input=start.input)
    return attrs.evolve(details, run=shown_run, generation=generation, previous=previous)


def _numbered(steps: list[StepRecord]) -> list[StepRecord]:
    return [s for s in steps if s.step_id != CONTINUE_STEP_ID]


async def show_run_generation(store: RunStore, run_id: str, generation: int | None) -> RunDetails:
    """:func:`generation_details` of run ``run_id``.

    Raises:
        RunNotFound: no such run.
    """
    run = await store.get_run(run_id)
    if run is None:
        raise RunNotFound(run_id)
    return await generation_details(store, run, generation)


async def count_generations(store: RunStore, ended_before: float, workflow: str | None) -> int:
    """How many previous generations ended before ``ended_before`` (0: a store that keeps
    none)."""
    try:
        keeper = generations_of(store)
    except TypeError:
        return 0
    return await keeper.count_generations(ended_before, workflow=workflow)


async def prune_generations(
    store: RunStore, ended_before: float, workflow: str | None, batch: int
) -> int:
    """Delete the previous generations that ended before ``ended_before``, batch after batch;
    how many."""
    try:
        keeper = generations_of(store)
    except TypeError:
        return 0
    deleted = 0
    while True:
        n = await keeper.prune_generations(ended_before, workflow=workflow, limit=batch)
        deleted += n
        if n < batch:
            return deleted
