"""Retention in the simulation (issue 34): the engines prune finished runs past their retention
(``engine_options={"retention": ...}`` or a workflow's own ``retention=``) while runs start,
finish, and engines and workers are killed. The invariants, over every prune the shared store
recorded (``RecordingStore.prunes``) and what is left at the end:

- nothing unfinished is ever pruned: each pruned run had ended, at least its workflow's
  retention before the prune (a workflow kept for good: never), and its parent, if any, had
  ended too (a child is kept while its parent may still record its end);
- a pruned run is gone with all its records, for good: no run, checkpoints (attempt logs in
  them), signals, events, tag index entries, and no job of it waiting or claimed on the broker
  (the broker deletes a job as it completes; a failed one it sets aside stays, bounded by its
  own ``failed_retention``: docs/decisions.md, "Retention of finished runs"); never pruned twice
  (never created again);
- every run that finished longer than its retention before the end (plus a prune interval) has
  been pruned (the simulation lingers after its drain for that long, faults healed);
- every run the workload started and that is gone from the store was pruned (none vanished);
- previous generations (continue-as-new): none pruned before its run's workflow's retention
  after its end (the next generation's mark), every one that ended longer than that (plus a
  prune interval) before the end is gone, and those kept chain without gap up to the current
  generation (``check_generations``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .._engine._retention import RetentionPolicy

if TYPE_CHECKING:
    from collections.abc import Iterable

    from .._engine import App
    from ..brokers.memory import MemoryBroker
    from ._sim_engines import RecordingStore
    from ._sim_ledger import Ledger

__all__ = ["RetentionCheck"]

#: The engine's default ``retention_interval`` (``EngineOptions``).
_DEFAULT_INTERVAL = 60.0


class RetentionCheck:
    """The retention of one simulation: how long it lingers after its drain, and its checks.

    Args:
        app: the app the engines drive (its workflows' own retentions).
        engine_options: the engines' keywords (``retention``, ``retention_interval``).
        restart_delay: how long a killed engine stays down.
    """

    def __init__(self, app: App, engine_options: dict[str, object], restart_delay: float) -> None:
        retention = engine_options.get("retention")
        assert retention is None or isinstance(retention, (int, float))
        self.policy = RetentionPolicy.of(app, retention)
        interval = engine_options.get("retention_interval", _DEFAULT_INTERVAL)
        assert isinstance(interval, (int, float))
        #: The longest a due run waits for a prune: a jittered interval, and a tick.
        self.slack = 1.25 * float(interval) + 1.0
        self.restart_delay = restart_delay

    @property
    def prunes(self) -> bool:
        return self.policy.prunes

    @property
    def linger(self) -> float:
        """How long the engines stay up after the drain: the longest finite retention, a
        prune's wait, and an engine's restart (so every run then due is pruned)."""
        kept = [self.policy.default, *self.policy.overrides.values()]
        finite = [k for k in kept if k is not None and k != math.inf]
        return max(finite, default=0.0) + self.slack + self.restart_delay

    def check(
        self,
        store: RecordingStore,
        broker: MemoryBroker,
        started: Iterable[str],
        ledger: Ledger,
    ) -> None:
        """Add a violation to ``ledger`` for every retention invariant broken (at the end,
        every process closed; ``started``: the run ids the workload started)."""
        violation = ledger.violation
        for run_id in store.pruned_twice:
            violation(f"run {run_id} was pruned twice (created again after its prune)")
        for run_id, pruned in sorted(store.prunes.items()):
            run, kept = pruned.run, self.policy.of_workflow(pruned.run.workflow)
            if not run.status.terminal:
                violation(f"run {run_id} was pruned {run.status.value} (unfinished)")
            elif kept is None:
                violation(f"run {run_id} ({run.workflow}, kept for good) was pruned")
            elif run.updated_at + kept > pruned.at + 1e-9:
                violation(
                    f"run {run_id} ({run.workflow}) was pruned {pruned.at - run.updated_at:.3f} "
                    f"s after its end, before its retention of {kept} s"
                )
            if pruned.parent_status is not None and not pruned.parent_status.terminal:
                violation(
                    f"child run {run_id} was pruned while its parent {run.parent} was "
                    f"{pruned.parent_status.value}"
                )
            self._gone(store, broker, run_id, ledger)
        now = store.now()
        for run_id, record in sorted(store._runs.items()):
            kept = self.policy.of_workflow(record.workflow)
            due = kept is not None and record.updated_at + kept + self.slack <= now
            if record.status.terminal and due:
                violation(
                    f"run {run_id} ({record.workflow}) ended {now - record.updated_at:.3f} s "
                    f"before the end and was never pruned (retention {kept} s)"
                )
        for run_id in started:
            if run_id not in store._runs and run_id not in store.prunes:
                violation(f"run {run_id} is gone from the store but was never pruned")
        self._generations(store, ledger)

    def _generations(self, store: RecordingStore, ledger: Ledger) -> None:
        """The invariants of previous generations (continue-as-new) in the module docstring."""
        for gone in store.generation_prunes:
            kept = self.policy.of_workflow(gone.workflow)
            if kept is None:
                ledger.violation(
                    f"generation {gone.generation} of run {gone.run_id} ({gone.workflow}, "
                    "kept for good) was pruned"
                )
            elif gone.ended_at + kept > gone.at + 1e-9:
                ledger.violation(
                    f"generation {gone.generation} of run {gone.run_id} was pruned "
                    f"{gone.at - gone.ended_at:.3f} s after its end, before its retention of "
                    f"{kept} s"
                )
        now = store.now()
        for run_id, record in sorted(store._runs.items()):
            kept = self.policy.of_workflow(record.workflow)
            for g, ended in sorted(record.generation_ends.items()):
                if kept is not None and ended + kept + self.slack <= now:
                    ledger.violation(
                        f"generation {g} of run {run_id} ended {now - ended:.3f} s before the "
                        f"end and was never pruned (retention {kept} s)"
                    )

    @staticmethod
    def _gone(store: RecordingStore, broker: MemoryBroker, run_id: str, ledger: Ledger) -> None:
        """Nothing of pruned ``run_id`` is left in the store or waiting on the broker."""
        if run_id in store._runs:
            ledger.violation(f"pruned run {run_id} is in the store again")
        for tag, ids in store._tagged.items():
            if run_id in ids:
                ledger.violation(f"pruned run {run_id} is still in the tag index under {tag}")
        quoted = f'"{run_id}"'.encode()
        for name, queue in sorted(broker._queues.items()):
            records = [
                *queue.waiting_records(),
                *(rec for _, _, rec in queue.delayed),
                *queue.active.values(),
            ]
            for rec in records:
                if quoted in rec.data:
                    ledger.violation(f"pruned run {run_id} still has job {rec.id} on {name}")
