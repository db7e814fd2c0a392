"""Recording a new run: what :meth:`Engine.start` and :meth:`Operations.start_run` share, so a
run started from the console (pending, no owner) is stored exactly as ``engine.start(...,
detach=True)`` stores it."""

from __future__ import annotations

import uuid
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from .._telemetry import run_trace
from ._debounce import Debounce, scoped_key
from ._errors import EngineError
from ._payloads import to_json
from ._records import RunRecord, RunStatus, normalize_json
from ._stores._wakes import DEBOUNCED, STARTS, ring, wakes_of

if TYPE_CHECKING:
    from types import TracebackType

    import trio

    from ._stores import RunStore

__all__ = ["NewRunWatch", "record_debounced_start", "record_new_run"]


async def record_new_run(
    store: RunStore,
    workflow: str,
    input: Any,
    *,
    run_id: str | None,
    owner: str | None,
    lease: float,
    timeout: float | None,  # noqa: ASYNC109 (the run's, stored; not this call's)
    parent: str | None,
    dedup_key: str | None = None,
    tags: dict[str, str] | None = None,
) -> tuple[RunRecord, bool]:
    """Create the run in ``store`` (idempotent by ``run_id``): running under ``owner`` for
    ``lease`` seconds, or pending with no owner when ``owner`` is ``None``. Arguments are
    checked by the caller, except ``input`` (normalised here). With ``dedup_key`` (and no
    ``run_id``): unless the run last created under that key in ``workflow`` is unfinished,
    then that run is returned, not created (:meth:`RunStore.create_run_deduped`).

    Returns:
        The stored run and whether this call created it.

    Raises:
        PayloadError: ``input`` is not a JSON value.
        EngineError: ``run_id`` exists as a run of another workflow.
    """
    value = normalize_json(to_json(input), f"the input of workflow {workflow!r}")
    depth = 0
    if parent is not None:  # a child: one more ancestor than its parent (issue 36)
        above = await store.get_run(parent)
        depth = 1 if above is None else above.depth + 1
    now = store.now()
    record = RunRecord(
        run_id=run_id or uuid.uuid4().hex,
        workflow=workflow,
        input=value,
        status=RunStatus.PENDING if owner is None else RunStatus.RUNNING,
        created_at=now,
        updated_at=now,
        owner=owner,
        lease_until=None if owner is None else now + lease,
        timeout=timeout,
        trace=run_trace(workflow),
        parent=parent,
        depth=depth,
        tags=dict(tags or {}),  # checked by the caller (_tags.check_tags)
    )
    if dedup_key is None:
        stored, created = await store.create_run(record)
    else:
        stored, created = await store.create_run_deduped(record, scoped_key(workflow, dedup_key))
    if not created and stored.workflow != workflow:
        raise EngineError(
            f"run {stored.run_id!r} exists as a run of {stored.workflow!r}, not {workflow!r}"
        )
    if created and owner is None:
        # Pending, nobody drives it: the reconciling engines take it now, not at their next
        # reconcile (a detached start, the console's; issue 30, item 1).
        await ring(store, STARTS)
    return stored, created


async def record_debounced_start(
    store: RunStore,
    workflow: str,
    input: Any,
    debounce: Debounce,
    *,
    timeout: float | None,  # noqa: ASYNC109 (the run's, stored; not this call's)
    tags: dict[str, str] | None = None,
) -> tuple[str, float | None]:
    """Fold a start of ``workflow`` into the debounced start of ``debounce.key`` (or record
    one): the run is created, pending, when it is due (:func:`._debounced.start_due`).

    Returns:
        The id of the run it is folded into, and when that start is due now (store clock).

    Raises:
        PayloadError: ``input`` is not a JSON value.
    """
    value = normalize_json(to_json(input), f"the input of workflow {workflow!r}")
    now = store.now()
    record = RunRecord(
        run_id=uuid.uuid4().hex,
        workflow=workflow,
        input=value,
        status=RunStatus.PENDING,
        created_at=now,
        updated_at=now,
        timeout=timeout,
        trace=run_trace(workflow),
        tags=dict(tags or {}),  # (the latest start's win, like its input)
    )
    run_id = await store.debounce_run(
        scoped_key(workflow, debounce.key),
        record,
        delay=debounce.delay,
        max_wait=debounce.max_wait,
    )
    # The engines' debounced-starts loops learn when it is due now, not at their next re-read
    # (a burst of starts: each loop reads at most once per ``RUNG_GAP``).
    await ring(store, DEBOUNCED)
    return run_id, await store.debounced_due(run_id)


class NewRunWatch:
    """The wakes of a run about to be created, watched from BEFORE its create (``with``: the
    watch ends with the block unless :meth:`hand_over` gave it to the run's driver).

    A request (``engine.update``) is stored only for a run that exists, and its append rings
    the run's key: a driver handed this watch does not read the run's requests at its start
    (docs/decisions.md, "A run started here does not read its update requests at its start").

    Args:
        run_id: the id asked for; :attr:`run_id` is it, or one drawn now when watching.
        wanted: watch at all (not for a detached start, nor a dedup start, whose id is the
            store's to choose).
    """

    def __init__(self, store: RunStore, run_id: str | None, *, wanted: bool) -> None:
        self.run_id = run_id
        self._watch = ExitStack()
        self._rung: trio.Event | None = None
        wakes = wakes_of(store) if wanted else None
        if wakes is not None:
            self.run_id = run_id or uuid.uuid4().hex
            self._rung = self._watch.enter_context(wakes.watching(self.run_id))

    def __enter__(self) -> NewRunWatch:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._watch.close()

    def hand_over(self, driver: object) -> None:
        """Give the watch to ``driver``'s update servant (a driver without one: it ends)."""
        updates = getattr(driver, "updates", None)
        if self._rung is not None and updates is not None:
            updates.watch_new(self._watch.pop_all(), self._rung)
