"""The run store contract: where runs and their checkpoints live, every change atomic.

A store holds one namespace's runs. Its clock (:meth:`RunStore.now`) is the time base of
every timestamp it keeps (leases, durable timers, retry backoffs): trio's clock for the memory
store (so tests run under a virtual clock), the wall clock for stores shared by processes.

Every method that changes more than one thing does it atomically (one SQLite transaction, one
Redis script, no checkpoint in between in memory): a crash never leaves half a change behind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from .._records import Applied, RunPage, RunRecord, RunStatus, StepRecord

__all__ = ["RunStore"]


@runtime_checkable
class RunStore(Protocol):
    """Runs and their checkpoints (see :mod:`durable_trio._engine._stores`).

    Errors: a store raises :class:`~durable_trio.BrokerError` (or
    :class:`~durable_trio.BrokerUnavailable`) when its backend fails; the engine retries.

    A store whose :meth:`now` IS ``trio.current_time()`` (the memory store) may say so with a
    class attribute ``trio_clock = True``: the engine then sleeps until a timer's exact
    ``wake_at`` instead of for ``wake_at - now()`` seconds.
    """

    def now(self) -> float:
        """The store's clock, in seconds."""
        ...

    async def create_run(self, run: RunRecord) -> tuple[RunRecord, bool]:
        """Insert ``run`` unless a run with its id exists.

        Returns:
            ``(stored, created)``: the run now stored (the existing one when ``created`` is
            ``False``) and whether this call created it.
        """
        ...

    async def get_run(self, run_id: str) -> RunRecord | None:
        """The run, or ``None``."""
        ...

    async def list_runs(
        self,
        *,
        status: RunStatus | None = None,
        workflow: str | None = None,
        limit: int = 100,
    ) -> list[RunRecord]:
        """Runs, newest first, optionally only of one status and/or workflow."""
        ...

    async def page_runs(
        self,
        *,
        status: RunStatus | None = None,
        workflow: str | None = None,
        tenant: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int = 50,
        cursor: str | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> RunPage:
        """One page of runs, newest first (creation order), filtered.

        Args:
            status: only runs of this status.
            workflow: only runs of this workflow.
            tenant: only the runs a tenant pod started (stored id ``"{tenant}/..."``).
            since: only runs created at or after this store-clock time.
            until: only runs created before this store-clock time.
            limit: at most this many runs (1 to 1,000).
            cursor: a page's ``next_cursor``: the runs older than that page's last
                (``None``: the newest).
            tags: only runs carrying every one of these tags (issue 34): read from the
                store's tag index (one tag's entries, newest first, the others checked),
                never by reading every run.

        Returns:
            The page. A store may return fewer than ``limit`` runs with a ``next_cursor``
            (it bounds the work one call does behind selective filters): follow
            ``next_cursor`` until it is ``None``.

        Raises:
            ConfigError: a bad ``limit``, time, tenant, tag or cursor.
        """
        ...

    async def count_runs(self) -> dict[RunStatus, int]:
        """How many runs of each status the store holds (a status with none: absent)."""
        ...

    async def reopen_run(
        self, run_id: str, steps: Sequence[StepRecord], *, run_timeout: float | None
    ) -> bool:
        """Reopen a failed or blocked run for a retry, atomically: if it is still so, set
        it pending with no owner (any engine's reconcile takes it over), clear its output and
        error, set its timeout to ``run_timeout``, and overwrite the status, attempt, error,
        retry, wake_at, dispatched and attempt log (``attempts``) of each checkpoint in
        ``steps`` (which must be the run's).

        Returns:
            Whether it was reopened (``False``: no such run, or it is neither failed nor
            blocked).
        """
        ...

    async def claim_runs(
        self, owner: str, lease: float, *, include_own: bool = False, limit: int = 100
    ) -> list[RunRecord]:
        """Take over unfinished runs nobody drives: pending or running runs with no owner or
        an expired lease (and, with ``include_own``, those still owned by ``owner`` itself: an
        engine restarted under the same id). Atomically sets their owner to ``owner``, their
        lease to ``now() + lease`` and their status to running.

        Returns:
            The claimed runs, at most ``limit``.
        """
        ...

    async def renew_runs(self, owner: str, run_ids: Sequence[str], lease: float) -> set[str]:
        """Extend ``owner``'s lease on ``run_ids`` to ``now() + lease``.

        Returns:
            The ids still owned by ``owner`` and unfinished (the others were taken over,
            finished or cancelled meanwhile: their driver must stop).
        """
        ...

    async def release_runs(self, owner: str, run_ids: Sequence[str]) -> None:
        """Give up ``owner``'s unfinished ``run_ids`` (owner and lease cleared, status pending)
        so another engine takes them over at once."""
        ...

    async def finish_run(
        self,
        run_id: str,
        status: RunStatus,
        *,
        output: object = None,
        error: object = None,
    ) -> bool:
        """Settle the run with a terminal ``status`` unless it is already settled; or park it
        ``blocked`` (a replay hit non-determinism): no owner, no lease, claimed by no engine
        until :meth:`reopen_run`. A blocked run can still be settled (cancelled).

        Returns:
            Whether this call settled it.
        """
        ...

    async def get_steps(self, run_id: str) -> list[StepRecord]:
        """The run's history: every checkpoint, in step id order."""
        ...

    async def get_step(self, run_id: str, step_id: str) -> StepRecord | None:
        """One checkpoint, or ``None``."""
        ...

    async def get_steps_many(self, keys: Sequence[tuple[str, str]]) -> list[StepRecord | None]:
        """Several checkpoints at once (``(run_id, step_id)`` each), ``None`` for a missing
        one, in the order asked."""
        ...

    async def begin_step(self, step: StepRecord) -> StepRecord:
        """Insert the checkpoint ``step`` unless one with its ``(run_id, step_id)`` exists.

        Returns:
            The checkpoint now stored (the existing one, if any: replay reads it).
        """
        ...

    async def begin_step_unless_finished(self, step: StepRecord) -> StepRecord | None:
        """:meth:`begin_step`, in one atomic check, only while ``step``'s run exists and is not
        finished (completed, failed or cancelled): a write that must not land in a finished
        run's history (the cancel mark, which a check and then a write would let in as the run
        ends).

        Returns:
            The checkpoint now stored (the existing one, if any), or ``None``: the run is
            unknown or finished, and nothing was written.
        """
        ...

    async def update_step(self, step: StepRecord, *, expect_attempt: int) -> Applied:
        """Compare-and-set: replace the mutable fields (status, attempt, output, error,
        wake_at, dispatched, the attempt log ``attempts``, and ``heartbeat`` unless ``step``'s
        is ``None``) of the stored checkpoint with ``step``'s, only if it is still pending, at
        attempt ``expect_attempt``, and its run is unfinished: an attempt's log entry is
        written with the change that ended it, or not at all.

        Returns:
            :attr:`Applied.APPLIED`, or why nothing was written.
        """
        ...

    async def mark_dispatched(self, run_id: str, step_id: str, attempt: int) -> bool:
        """Record that ``attempt``'s task is on the broker (if the checkpoint is still pending
        at that attempt). Returns whether it was recorded."""
        ...

    async def put_schedule(self, name: str, spec: str, *, replace: bool) -> bool:
        """Store schedule ``name``'s definition (``spec``: JSON text) unless it exists and
        ``replace`` is false. Its last tick is kept.

        Returns:
            Whether it was written.
        """
        ...

    async def get_schedules(self) -> list[tuple[str, str, float | None]]:
        """Every schedule: ``(name, spec, last_tick)`` (``None``: no tick handled yet)."""
        ...

    async def delete_schedule(self, name: str) -> bool:
        """Delete schedule ``name``, its last tick and its overlap state. Returns whether it
        existed."""
        ...

    async def mark_schedule_tick(self, name: str, tick: float) -> None:
        """Record that ``tick`` of schedule ``name`` was handled: its last tick becomes
        ``max(last tick, tick)`` (atomically; nothing if the schedule does not exist)."""
        ...

    async def get_schedule_states(self) -> dict[str, str]:
        """The overlap state of every schedule that has one (JSON text the scheduler writes
        with :meth:`put_schedule_state`), by name."""
        ...

    async def put_schedule_state(self, name: str, state: str) -> None:
        """Store schedule ``name``'s overlap state (JSON text; nothing if the schedule does
        not exist). :meth:`put_schedule` keeps it; :meth:`delete_schedule` deletes it."""
        ...

    async def append_signal(self, run_id: str, name: str, payload: str) -> int | None:
        """Append signal ``name`` (JSON text ``payload``) to the run's log of that name,
        atomically with the check that the run exists and is unfinished.

        Returns:
            Its sequence number (1, 2, ... per run and name), or ``None`` (no such run, or
            it has finished: nothing stored).
        """
        ...

    async def read_signal(self, run_id: str, name: str, seq: int) -> str | None:
        """The JSON text of the run's ``seq``-th signal ``name``, or ``None`` (not yet)."""
        ...

    async def put_event(self, run_id: str, key: str, value: str) -> None:
        """Set the run's event ``key`` to JSON text ``value`` (latest wins)."""
        ...

    async def get_events(self, run_id: str) -> dict[str, str]:
        """The run's events: key -> JSON text."""
        ...

    # -- dedup and debounce keys (issue 33, item 4: docs/concurrency.md) --------------------

    async def create_run_deduped(self, run: RunRecord, key: str) -> tuple[RunRecord, bool]:
        """:meth:`create_run`, unless the run last created under dedup ``key`` is unfinished
        (any status but completed, failed, cancelled): then that run, nothing created. One
        atomic operation (two stores racing the same key create one run).

        ``run.run_id`` is a fresh id: a store may create the run under another fresh id (a
        sharded store places the run beside its key).

        Returns:
            ``(stored, created)``: the run created (``True``) or the unfinished run of ``key``
            (``False``).
        """
        ...

    async def debounce_run(
        self, key: str, run: RunRecord, *, delay: float, max_wait: float | None
    ) -> str:
        """Fold a start into the debounced start of ``key`` not yet started, atomically: its
        input, timeout and trace become ``run``'s and it becomes due at ``min(now() + delay,
        deadline)``; with none pending, record one for ``run`` (due at ``now() + delay``, its
        deadline ``now() + max_wait``, ``None``: none). The run is created when
        :meth:`start_debounced` finds it due.

        ``run.run_id`` is a fresh id (see :meth:`create_run_deduped`).

        Returns:
            The id of the run the start is folded into.
        """
        ...

    async def start_debounced(self, limit: int = 100) -> tuple[list[RunRecord], float | None]:
        """Create the run of each debounced start due (due at or before ``now()``), at most
        ``limit``: pending, no owner, created now; the start and its run's creation one atomic
        change each (two stores racing start it once; a start folded in meanwhile either landed
        before it, or opens a new window).

        Returns:
            The runs created, and the store-clock time the next start still pending is due
            (``None``: none pending).
        """
        ...

    async def debounced_due(self, run_id: str) -> float | None:
        """When the debounced start that will create run ``run_id`` is due, or ``None`` (no
        such start pending: the run was created, or the id is unknown)."""
        ...

    async def aclose(self) -> None:
        """Release what the store holds (idempotent)."""
        ...

    # -- retention (issue 34) ----------------------------------------------------------------

    async def prune_finished(
        self, ended_before: float, *, workflow: str | None = None, limit: int = 100
    ) -> list[str]:
        """Delete up to ``limit`` finished runs (completed, failed or cancelled) that ended
        before ``ended_before`` (store clock: a finished run's ``updated_at``), oldest end first,
        optionally only of one ``workflow``: each run with its whole history (its checkpoints
        and their attempt logs, its signals, its events) and its place in every index, atomically
        per run (a crash leaves a run whole or gone). Never an unfinished run (pending, running,
        blocked), nor a child run whose parent exists unfinished (the parent may not have
        recorded the child's end yet). Idempotent: engines may prune the same runs concurrently.

        The work is bounded by ``limit``: an index on the end time is walked, never every run.

        Returns:
            The ids of the runs this call deleted.
        """
        ...

    async def count_finished(self, ended_before: float, *, workflow: str | None = None) -> int:
        """How many finished runs (of ``workflow``) ended before ``ended_before``: what
        :meth:`prune_finished` would delete (a store may count a held child run too: at most)."""
        ...

    async def finished_workflows(self) -> list[str]:
        """The workflows that have a finished run in the store, sorted (bounded by the number
        of workflows, not of runs)."""
        ...
