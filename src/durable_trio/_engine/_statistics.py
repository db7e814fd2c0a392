"""The engine's counters, and the frozen snapshot :meth:`Engine.statistics` returns."""

from __future__ import annotations

import attrs

__all__ = ["Counters", "EngineStatistics"]


@attrs.frozen
class EngineStatistics:
    """A snapshot of one engine's counters."""

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
    decisions_applied: int = 0
    stale_decisions: int = 0
    """Decisions ignored: the run was over, or the decision contradicted the stored history."""
    orphan_decisions: int = 0
    """Decisions for an unknown run or a run of a workflow that is not remote."""
    step_events: int = 0
    """Step events (T16) received and checkpointed (or counted, for ``started``)."""
    orphan_step_events: int = 0
    tenant_requests: int = 0
    """Start-run messages and run requests served as a control plane."""
    tenant_events: int = 0
    """Run events published to tenant pods' inboxes."""


@attrs.define
class Counters:
    runs_started: int = 0
    runs_resumed: int = 0
    runs_completed: int = 0
    runs_failed: int = 0
    runs_cancelled: int = 0
    steps_dispatched: int = 0
    retries: int = 0
    redispatched: int = 0
    results_applied: int = 0
    duplicate_results: int = 0
    stale_results: int = 0
    orphan_results: int = 0
    local_steps_run: int = 0
    timers_fired: int = 0
    nondeterminism_failures: int = 0
    lost_runs: int = 0
    turns_dispatched: int = 0
    turns_resent: int = 0
    decisions_applied: int = 0
    stale_decisions: int = 0
    orphan_decisions: int = 0
    step_events: int = 0
    orphan_step_events: int = 0
    tenant_requests: int = 0
    tenant_events: int = 0
