"""Continue-as-new, the driver's side (issue 34, item 5; values: :mod:`._generations`; the
stores' atomic change: ``_stores/_generations.py``).

:func:`run_generations` calls the workflow; when it raises :class:`ContinueAsNew`, it

1. checks the generation replayed its whole history (else :class:`NonDeterminismError`: the
   run is blocked, as a workflow that returned early would be), and that no cancel was
   delivered inside it (else the run ends cancelled, its compensation's
   ``continue_as_new`` refused with ``RunCancelled``);
2. in the run's first generation, checkpoints a mark of generation 0 holding its input (so the
   previous generation shows it; a crash right after it changes nothing);
3. makes the store's one atomic change: the history becomes previous generation ``g``, the mark
   of ``g + 1`` (its step numbering, the signals consumed so far, its input) the new history,
   the input the run's;
4. calls the workflow again, from the top, with a fresh context over that history.

An engine killed after 3 takes the run over as any other: its history is the new generation's
mark, its input the new one: the new generation starts once, the old one never runs again. The
change is a compare-and-set on the generation: an engine that lost the run (split brain) and
continues it too changes nothing and stops driving it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import attrs

from ._context import WorkflowContext
from ._generations import Continuation, ContinueAsNew, continuation_of
from ._payloads import call_workflow
from ._replay import History
from ._stores._generations import generations_of
from ._updates import UpdatingDriver

if TYPE_CHECKING:
    from ._app import WorkflowDefinition
    from ._cancel import CancelState
    from ._records import RunRecord
    from ._services import DriverServices

__all__ = ["run_generations"]


class RunDriver(Protocol):
    """What of :class:`~._runtime.RunDriver` a continuation changes."""

    services: DriverServices
    run: RunRecord
    history: History
    markers: list[str]
    cancel: CancelState

    async def _stop(self) -> None: ...


async def run_generations(
    driver: RunDriver, definition: WorkflowDefinition, ctx: WorkflowContext
) -> Any:
    """The workflow's return value, across every generation it continues into."""
    assert definition.fn is not None  # a remote workflow has a RemoteRunDriver
    while True:
        run = driver.run
        try:
            return await call_workflow(definition.fn, ctx, run.input, run.workflow)
        except ContinueAsNew as exc:
            ctx = await _continue(driver, ctx, exc.input)


async def _continue(driver: RunDriver, ctx: WorkflowContext, input: Any) -> WorkflowContext:
    services, run = driver.services, driver.run
    store = services.store
    driver.history.check_exhausted()
    if driver.cancel.requested:  # a cancelled run ends cancelled: it does not go on
        raise driver.cancel.error(run.run_id)
    now = continuation_of(driver.history.continued)
    if driver.history.continued is None:  # keep the first generation's input with it
        first = attrs.evolve(now, input=run.input).mark(run.run_id)
        await services.guard(lambda: store.begin_step(first), "checkpointing")
    following = Continuation(
        generation=now.generation + 1,
        last_step=ctx._next,
        signals=dict(ctx.__dict__.get("_signal_counts", {})),
        input=input,
    )
    mark = following.mark(run.run_id)
    generations = generations_of(store)
    moved = await services.guard(
        lambda: generations.continue_run(run.run_id, mark, input), "continuing as new"
    )
    if not moved:  # the run ended, or another engine continued it: not ours to drive
        await driver._stop()
        raise AssertionError("unreachable")  # pragma: no cover
    driver.markers.clear()
    driver.run = attrs.evolve(run, input=input)
    driver.history = History(run.run_id, [mark])
    engine_driver: Any = driver  # the RunDriver itself: every call of _Driver
    servant = getattr(driver, "updates", None)
    if servant is not None:  # its calls counted again, from this generation's start
        servant.next_generation(following.generation)
        engine_driver = UpdatingDriver(driver, servant)
    return WorkflowContext(engine_driver, driver.run, driver.history, app=services.app)
