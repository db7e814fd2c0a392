"""Child workflows in the simulation (issue 18, item 3): a workload whose ``family`` runs fan
out to ``order`` children, and the invariant that no child is orphaned and each is started
once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._engine import App, RunStatus, StepKind, WorkflowContext
from ._sample import expected as order_expected
from ._sample import workload as order_workload

if TYPE_CHECKING:
    import random
    from collections.abc import Callable, Container

    from .._engine import RunStore

__all__ = [
    "add_family",
    "check_children",
    "family_expected",
    "family_workload",
]

_ENDED = (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED)


async def family(ctx: WorkflowContext, sizes: list[int]) -> list[Any]:
    """Starts one ``order`` child per size (ids ``{run}/1``, ...) and gathers them."""
    handles = [await ctx.start_child("order", size) for size in sizes]
    return list(await ctx.gather(*handles))


def add_family(app: App, *, remote: bool = False) -> App:
    """Register ``family`` on a sample app (which serves ``order``); its code on the workers
    with ``remote``."""
    app.workflow("family", remote=remote)(family)
    return app


def family_workload(rng: random.Random, index: int) -> tuple[str, Any]:
    """Every third run is a ``family`` of 1-3 ``order`` children; the others are orders."""
    if index % 3 == 0:
        return "family", [rng.randrange(1, 5) for _ in range(rng.randrange(1, 4))]
    return order_workload(rng, index)


def family_expected(workflow: str, value: Any) -> Any:
    """The right output of a ``family`` or an ``order`` run."""
    if workflow == "family":
        return [order_expected("order", size) for size in value]
    return order_expected(workflow, value)


async def check_children(
    store: RunStore, violation: Callable[[str], None], *, gone: Container[str] = ()
) -> int:
    """Every CHILD checkpoint names a child run that exists (or was pruned: ``gone``), no
    child run is named twice or by no checkpoint (started once), and a parent that ended left
    no child running unless it chose ``abandon``. Returns how many children were checked."""
    listed = await store.list_runs(limit=10**9)
    runs = {run.run_id: run for run in sorted(listed, key=lambda run: run.run_id)}
    named: dict[str, str] = {}
    for parent in runs.values():
        for step in await store.get_steps(parent.run_id):
            if step.kind is not StepKind.CHILD or not isinstance(step.input, dict):
                continue
            child_id = str(step.input.get("runId"))
            if child_id in named:
                violation(f"child run {child_id} started by {named[child_id]} and {parent.run_id}")
            named[child_id] = parent.run_id
            child = runs.get(child_id)
            if child is None and child_id in gone:
                continue  # retention deleted it (_sim_retention checks the prune)
            if child is None:
                violation(f"child run {child_id} of {parent.run_id} was never started")
            elif (
                parent.status in _ENDED
                and child.status not in _ENDED
                and step.input.get("onParentCancel") != "abandon"
            ):
                violation(
                    f"child run {child_id} is {child.status.value} though its parent "
                    f"{parent.run_id} is {parent.status.value} (orphaned)"
                )
    for run_id in runs:
        if "/" in run_id and run_id not in named:
            violation(f"run {run_id} looks like a child but no parent started it")
    return len(named)
