"""The names of the engine's counters and gauges, the fields of :class:`EngineStatistics`.

Apart from the class (:mod:`._statistics`) so that the engine counts without importing it: the
snapshot is built only when :meth:`Engine.statistics` is called (an operator's or a test's
call), and a class of 43 fields costs attrs ~8 M instructions to build, a tenth of what an
app's imports add to ``import trio``. ``tests/test_engine.py`` checks that these names are the
class's fields.
"""

from __future__ import annotations

__all__ = ["COUNTERS", "GAUGES"]

#: The fields of :class:`EngineStatistics` that are not counters but gauges (or the id).
GAUGES = frozenset({"engine_id", "active_runs", "waiting_steps"})

#: Every counter of :class:`EngineStatistics`, in field order: what ``Engine._count`` may count.
COUNTERS = (
    "runs_started",
    "runs_resumed",
    "runs_completed",
    "runs_failed",
    "runs_cancelled",
    "steps_dispatched",
    "retries",
    "redispatched",
    "results_applied",
    "duplicate_results",
    "stale_results",
    "orphan_results",
    "local_steps_run",
    "timers_fired",
    "nondeterminism_failures",
    "lost_runs",
    "turns_dispatched",
    "turns_resent",
    "turns_moved_on",
    "decisions_applied",
    "stale_decisions",
    "orphan_decisions",
    "step_events",
    "orphan_step_events",
    "tenant_requests",
    "tenant_events",
    "runs_timed_out",
    "duplicate_completions",
    "steps_timed_out",
    "steps_not_started",
    "steps_unstarted_reported",
    "heartbeats_recorded",
    "stale_heartbeats",
    "heartbeat_timeouts",
    "lost_dispatches",
    "runs_blocked",
    "runs_unblocked",
    "runs_pruned",
    "generations_pruned",
    "stream_values_dropped",
    "reports_folded",
)
