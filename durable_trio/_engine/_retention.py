"""Retention (issue 34): the engine's loop that deletes finished runs past their retention.

A finished run (completed, failed or cancelled) is kept ``retention`` seconds after its end
(its ``updated_at``), then deleted with its history, its signals and its events
(:meth:`~._stores.RunStore.prune_finished`: per run atomic, never an unfinished run, never a
child whose parent is unfinished). A workflow's own ``@app.workflow(retention=)`` wins over the
engine's ``retention``; ``None`` on the engine and no workflow of its own: nothing is pruned
(the default: docs/decisions.md, "Retention").

Every ``retention_interval`` (jittered, 75 % to 125 %, so a fleet's engines do not prune in
step) an engine prunes, batch after batch of ``retention_batch`` runs while they come back
full. Any engine may: a run two engines both pick is deleted once (the stores' deletes are
idempotent). A prune cancelled (the engine closing, or killed) between batches leaves the
batches done done and the rest for the next prune; inside a batch, each run is whole or gone.

The same retention applies to a run's previous generations (continue-as-new), finished or not:
a previous generation ended when the next one's mark was made (``continue_run``'s time); it is
kept ``retention`` seconds after that, then deleted on its own (:func:`prune_generations_once`,
batch after batch; each generation whole or gone). The run's current generation and the run
itself are never touched by it, and the generations kept are always the newest ones: ends are
in generation order, so what is left chains without gap to the current generation.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING

import trio

from .._errors import BrokerError
from .._logs import get_logger

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ._app import App
    from ._services import EngineServices
    from ._stores import RunStore
    from ._stores._generations import Generations

__all__ = ["RetentionPolicy", "prune_forever", "prune_generations_once", "prune_once"]

logger = get_logger("durable_trio")


class RetentionPolicy:
    """How long the finished runs of each workflow are kept.

    Args:
        default: the engine's ``retention`` (``None`` or ``math.inf``: for good).
        overrides: a workflow's own retention, by name (``math.inf``: for good).
    """

    def __init__(self, default: float | None, overrides: Mapping[str, float] | None = None) -> None:
        self.default = None if default is None or default == math.inf else float(default)
        self.overrides = dict(overrides or {})

    @classmethod
    def of(cls, app: App, default: float | None) -> RetentionPolicy:
        """The policy of ``app``'s workflows under an engine ``retention`` of ``default``."""
        return cls(
            default,
            {n: w.retention for n, w in app.workflows.items() if w.retention is not None},
        )

    @property
    def prunes(self) -> bool:
        """Whether any finished run is ever deleted."""
        return self.default is not None or any(r != math.inf for r in self.overrides.values())

    def of_workflow(self, workflow: str) -> float | None:
        """Seconds ``workflow``'s finished runs are kept (``None``: for good)."""
        kept = self.overrides.get(workflow, self.default)
        return None if kept is None or kept == math.inf else kept


async def _prune_all(
    store: RunStore, ended_before: float, workflow: str | None, batch: int
) -> list[str]:
    """Batch after batch while they come back full."""
    pruned: list[str] = []
    while True:
        ids = await store.prune_finished(ended_before, workflow=workflow, limit=batch)
        pruned += ids
        if len(ids) < batch:
            return pruned
        await trio.lowlevel.checkpoint()


async def prune_once(store: RunStore, policy: RetentionPolicy, batch: int = 100) -> list[str]:
    """Delete every finished run past its workflow's retention, now (store clock).

    Returns:
        The ids deleted.
    """
    now = store.now()
    if not policy.overrides:  # one retention for all: one walk of the end index
        if policy.default is None:
            await trio.lowlevel.checkpoint()
            return []
        return await _prune_all(store, now - policy.default, None, batch)
    pruned: list[str] = []
    for workflow in await store.finished_workflows():
        kept = policy.of_workflow(workflow)
        if kept is not None:
            pruned += await _prune_all(store, now - kept, workflow, batch)
    return pruned


async def prune_generations_once(
    store: RunStore, policy: RetentionPolicy, batch: int = 100
) -> int:
    """Delete every previous generation past its run's workflow's retention, now (store clock;
    a store that keeps no generations: none).

    Returns:
        How many were deleted.
    """
    from ._stores._generations import generations_of

    try:
        keeper = generations_of(store)
    except TypeError:
        await trio.lowlevel.checkpoint()
        return 0
    now = store.now()
    if not policy.overrides:
        if policy.default is None:
            await trio.lowlevel.checkpoint()
            return 0
        return await _prune_generations(keeper, now - policy.default, None, batch)
    pruned = 0
    for workflow in await keeper.generation_workflows():
        kept = policy.of_workflow(workflow)
        if kept is not None:
            pruned += await _prune_generations(keeper, now - kept, workflow, batch)
    return pruned


async def _prune_generations(
    keeper: Generations, ended_before: float, workflow: str | None, batch: int
) -> int:
    """Batch after batch while they come back full."""
    pruned = 0
    while True:
        n = await keeper.prune_generations(ended_before, workflow=workflow, limit=batch)
        pruned += n
        if n < batch:
            return pruned
        await trio.lowlevel.checkpoint()


async def prune_forever(services: EngineServices) -> None:
    """The engine's retention loop (in its loops nursery; see the module docstring)."""
    options = services.options
    policy = RetentionPolicy.of(services.app, options.retention)
    if not policy.prunes:
        return
    jitter = random.Random(options.engine_id)  # (seeded: a simulation replays the same times)
    while True:
        await trio.sleep(options.retention_interval * jitter.uniform(0.75, 1.25))
        try:
            pruned = await prune_once(services.store, policy, options.retention_batch)
        except BrokerError as exc:
            services.report(exc)
            continue
        if pruned:
            services.count("runs_pruned", len(pruned))
            logger.debug("retention: %d finished runs deleted", len(pruned))
        try:
            gone = await prune_generations_once(services.store, policy, options.retention_batch)
        except BrokerError as exc:
            services.report(exc)
            continue
        if gone:
            services.count("generations_pruned", gone)
            logger.debug("retention: %d previous generations deleted", gone)
