"""The frozen snapshots :meth:`Engine.statistics` and :meth:`Worker.statistics` return (the
names of the engine's counters and gauges live in :mod:`._counters`, which the engine imports:
this module is imported by the first ``statistics()``, through ``_snapshots``)."""

from __future__ import annotations

import attrs

from .._attrs_shared import shared_eq, shared_hash, shared_repr
from ._counters import COUNTERS, GAUGES

__all__ = ["COUNTERS", "GAUGES", "EngineStatistics", "WorkerStatistics"]


@attrs.frozen(repr=False, eq=False)
class EngineStatistics:
    """A snapshot of one engine's counters."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    engine_id: str
    active_runs: int
    """Runs this engine drives now."""
    waiting_steps: int
    """Remote steps its runs wait on now."""
    runs_started: int
    runs_resumed: int
    """Runs taken over by reconcile (replayed from their history)."""
    runs_completed: int
    runs_failed: int
    runs_cancelled: int
    steps_dispatched: int
    """Tasks sent (first attempts, retries and re-dispatches)."""
    retries: int
    """Failed attempts retried."""
    redispatched: int
    """Attempts re-dispatched on resume because their dispatch was never confirmed."""
    results_applied: int
    duplicate_results: int
    """Results ignored: the checkpoint had already completed or failed."""
    stale_results: int
    """Results ignored: for an attempt that is not the current one."""
    orphan_results: int
    """Results ignored: unknown step, or the run is over."""
    local_steps_run: int
    timers_fired: int
    nondeterminism_failures: int
    lost_runs: int
    """Runs this engine stopped driving because another engine took them over."""
    turns_dispatched: int = 0
    """Remote workflow turns sent to workflow workers."""
    turns_resent: int = 0
    """Turns sent again after ``turn_timeout`` without a decision."""
    turns_moved_on: int = 0
    """Turns given up after ``turn_timeout`` with no decision seen, the run moving on with
    the steps and timers its history holds (a decision another engine applied may have
    changed nothing)."""
    decisions_applied: int = 0
    stale_decisions: int = 0
    """Decisions ignored: the run was over, or the decision contradicted the stored history."""
    orphan_decisions: int = 0
    """Decisions for an unknown run or a run of a workflow that is not remote."""
    step_events: int = 0
    """Step events (T16, docs/spec.md) received and checkpointed (or counted, for ``started``)."""
    orphan_step_events: int = 0
    tenant_requests: int = 0
    """Start-run messages and run requests served as a control plane."""
    tenant_events: int = 0
    """Run events published to tenant pods' inboxes."""
    runs_timed_out: int = 0
    """Runs failed at their deadline (``engine.start(..., timeout=)``); counted in
    ``runs_failed`` too."""
    duplicate_completions: int = 0
    """Completed results for an attempt that had already completed (counted in
    ``duplicate_results`` too): each recorded with its cause (:meth:`Engine.duplicates`)."""
    steps_timed_out: int = 0
    """Step attempts the engine failed as ``StepTimedOut`` itself: past their ``timeout`` plus
    ``step_timeout_grace`` with no live worker holding them (a worker killed mid-step)."""
    steps_not_started: int = 0
    """Step attempts failed by their ``schedule_to_start_timeout`` (no worker took them)."""
    steps_unstarted_reported: int = 0
    """Step attempts reported (``StepNotStarted`` through the error hook) as still waiting
    ``unstarted_report_after`` seconds on a queue that no live worker serves."""
    heartbeats_recorded: int = 0
    """Step beats recorded on their checkpoint."""
    stale_heartbeats: int = 0
    """Step beats ignored: for another attempt, a settled step, or one being applied."""
    heartbeat_timeouts: int = 0
    """Attempts failed over because their beats stopped for longer than ``heartbeat_timeout``."""
    lost_dispatches: int = 0
    """Step attempts found lost by the loss audit (their task or result lost by the broker,
    e.g. in a failover without ``min_replicas``) and dispatched again."""

    runs_blocked: int = 0
    """Runs parked ``blocked`` here: their replay hit non-determinism (counted in
    ``nondeterminism_failures`` too)."""
    runs_unblocked: int = 0
    """Blocked runs this engine reopened on its own (code that may replay them)."""
    runs_pruned: int = 0
    """Finished runs this engine's retention deleted (issue 34; docs/engine.md, "Retention")."""
    generations_pruned: int = 0
    """Previous generations (continue-as-new) this engine's retention deleted, of runs finished
    or not (docs/engine.md, "Continue-as-new")."""
    stream_values_dropped: int = 0
    """Values a remote workflow's ``ctx.emit`` published past its stream's bounds, dropped
    (issue 34; docs/engine.md, "Streaming")."""
    reports_folded: int = 0
    """Failed store or broker calls of the engine's runs (retried) that were not reported one
    by one through ``on_error`` during an outage, but counted into a later report
    (docs/engine.md, "When the store or broker is down")."""


@attrs.frozen(repr=False, eq=False)
class WorkerStatistics:
    """A snapshot of a worker's counters."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    running: int
    """Steps running now."""
    executed: int
    """Step executions started (every attempt and redelivery counts)."""
    succeeded: int
    failed: int
    cancelled: int
    """Executions stopped by a ``cancel`` control message."""
