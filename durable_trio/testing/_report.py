"""The simulation's vocabulary: what goes wrong (:class:`Faults`), what a run did
(:class:`SimulationReport`) and what a broken invariant raises (:class:`InvariantViolation`)."""

from __future__ import annotations

import hashlib
from typing import Any

import attrs
import orjson

from .._engine import EngineStatistics
from .faults import BrokerFaults

__all__ = ["Faults", "InvariantViolation", "SimulationReport"]

_HOUR = 3600.0


@attrs.frozen(kw_only=True)
class Faults:
    """What goes wrong, and how often (rates per hour of virtual time; durations in seconds,
    drawn uniformly from ``(low, high)``)."""

    kills_per_hour: float = 0.5
    """A random worker is killed abruptly (nothing it does reaches the broker any more; its
    claims come back by lease expiry, its liveness keys expire)."""
    restart_delay: float = 30.0
    """A killed worker's replacement starts this long after the kill."""
    restarts_per_hour: float = 0.5
    """A random worker is closed gracefully and replaced at once (a rolling deploy): the close
    bounds and the liveness-key withdrawal are checked on each."""
    renewal_pauses_per_hour: float = 0.5
    """A random worker's lease renewals fail for a while (its claims are re-delivered)."""
    renewal_pause: tuple[float, float] = (40.0, 180.0)
    stalls_per_hour: float = 0.5
    """A random worker stalls: every broker and key-store call it makes, and the completion of
    every step it runs, waits until the stall ends (what a frozen event loop looks like from
    outside; its step code itself keeps running on the virtual clock)."""
    stall: tuple[float, float] = (5.0, 90.0)
    broker: BrokerFaults = attrs.field(
        factory=lambda: BrokerFaults(
            delay_probability=0.02,
            delay_max=2.0,
            drop_probability=0.002,
            lost_reply_probability=0.002,
            key_write_failure_probability=0.02,
        )
    )
    """Per-call faults of every worker's broker and key store."""
    engine_broker: BrokerFaults | None = None
    """Per-call faults of the engine's broker (``None``: the same as ``broker``)."""
    engine_kills_per_hour: float = 0.0
    """The engine is killed abruptly (nothing it does reaches the broker or the run store any
    more; the runs it drove are taken over by its replacement, which starts
    ``engine_restart_delay`` later under the same ``engine_id``, and the results and
    decisions it had claimed come back by lease expiry). Off by default: the engine is one
    process, so while it is down no run moves."""
    engine_restart_delay: float = 20.0
    poison_probability: float = 0.0
    """Each step of each run is poison with this probability (drawn from the seed): every
    execution of it kills the worker that runs it, at once, as a ``kill`` does (a crash loop;
    its run fails once its attempts are exhausted). Checks that a suspect runs alone."""

    @classmethod
    def none(cls) -> Faults:
        """No faults at all."""
        return cls(
            kills_per_hour=0.0,
            restarts_per_hour=0.0,
            renewal_pauses_per_hour=0.0,
            stalls_per_hour=0.0,
            broker=BrokerFaults(),
        )


class InvariantViolation(AssertionError):
    """A simulated run broke an invariant. The message names the seed and a command that
    replays it; :attr:`report` holds the whole run.

    Attributes:
        report: the run's :class:`SimulationReport` (its ``violations`` say what broke).
    """

    def __init__(self, message: str, report: SimulationReport) -> None:
        super().__init__(message)
        self.report = report


@attrs.frozen
class SimulationReport:
    """What a simulated run did: its figures, its invariant violations and its history.

    The history is a list of JSON events (``{"t": virtual seconds, "ev": kind, ...}``):
    runs started and ended, step executions, worker lifecycles, every fault injected and every
    error reported. :meth:`history_bytes` is its canonical serialization: two runs of one seed
    give the same bytes.
    """

    seed: int
    workers: int
    duration: float
    """Virtual seconds of workload (faults are injected during this time)."""
    virtual_seconds: float
    """Virtual seconds simulated in all (workload, drain and close)."""
    wall_seconds: float
    runs_started: int
    runs_completed: int
    runs_failed: int
    runs_cancelled: int
    runs_unfinished: int
    step_executions: int
    duplicate_executions: int
    """Executions of a (run, step, attempt) after its first (each one explained by a fault)."""
    lost_leases: int
    """Claims workers found re-delivered while they ran them (transport ``duplicates``)."""
    faults: dict[str, int]
    """Faults injected, by kind."""
    errors_reported: dict[str, int]
    """Errors the engine and workers reported through ``on_error``, by type."""
    graceful_closes: int
    longest_close: float
    """Virtual seconds of the slowest graceful worker close."""
    close_bound: float
    engine: EngineStatistics
    """The engine's counters, summed over its generations (each restart after a kill)."""
    violations: tuple[str, ...]
    history: tuple[dict[str, Any], ...] = attrs.field(repr=False)
    replay_command: str
    concurrency_peaks: dict[str, int] = attrs.field(factory=dict)
    """Of each step with ``max_concurrency`` (per key value with ``concurrency_key``:
    ``"step[key]"``): the most attempts seen running at once, never above the limit (an
    invariant; executions a fault may have doubled are not counted)."""
    rate_peaks: dict[str, int] = attrs.field(factory=dict)
    """Of each step with ``rate_limit``: the most starts seen in one window of its ``per``
    seconds, never above its count (an invariant; starts a fault may have delayed are not
    counted)."""

    def history_bytes(self) -> bytes:
        """The history, serialized (orjson): compare these to compare two runs."""
        return orjson.dumps(list(self.history))

    @property
    def digest(self) -> str:
        """SHA-256 of :meth:`history_bytes` (hex)."""
        return hashlib.sha256(self.history_bytes()).hexdigest()

    def _peaks(self) -> str:
        if not self.concurrency_peaks:
            return ""
        peaks = ", ".join(f"{k} {v}" for k, v in sorted(self.concurrency_peaks.items()))
        return f"  most at once (max_concurrency): {peaks}\n"

    def summary(self) -> str:
        """A few lines for humans."""
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none"
        return (
            f"seed {self.seed}: {self.duration / _HOUR:g} h simulated with {self.workers} workers "
            f"in {self.wall_seconds:.1f} s wall ({self.virtual_seconds:.0f} virtual s)\n"
            f"  runs: {self.runs_started} started, {self.runs_completed} completed, "
            f"{self.runs_failed} failed, {self.runs_cancelled} cancelled, "
            f"{self.runs_unfinished} unfinished\n"
            f"  steps: {self.step_executions} executions, {self.duplicate_executions} "
            f"duplicates, {self.lost_leases} lost leases\n"
            f"  faults: {faults}\n"
            f"  graceful closes: {self.graceful_closes} (longest {self.longest_close:.2f} s, "
            f"bound {self.close_bound:.2f} s)\n"
            f"{self._peaks()}"
            f"  history: {len(self.history)} events, sha256 {self.digest[:16]}\n"
            f"  invariants: {'all held' if not self.violations else 'VIOLATED'}"
        )
