"""The invariants a simulation checks after its run: no run lost (and each one's output the
expected one), every settled step settled once with a result a worker produced, every duplicate
execution explained by a fault, every duplicate completed result recorded with its cause, every
damaged claim set aside unread, no job failed as stalled without more than ``max_stalled_count``
stalls while its handler ran, every heartbeat failover explained by a fault, every settled
step's attempt log ending with the attempt that settled it, every step task or result the
broker acknowledged and lost found by the engine's loss audit. (The close bounds
and the liveness keys are checked as each worker closes: see ``_sim_workers``.)"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from .._engine import StepKind, StepRecord, StepState
from .._engine._records import ATTEMPT_LOG_LIMIT
from .._transport._options import DEFAULT_MAX_STALLED_COUNT
from ._sim_children import check_children
from ._sim_generations import check_generations, run_history

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..brokers import FailedJob
    from ..brokers.memory import MemoryBroker
    from ._sim_engines import Engines, RecordingStore
    from ._sim_ledger import Ledger
    from ._sim_runs import Runs

__all__ = ["Invariants"]


class Invariants:
    """The checks of one simulated run, over what the ledger saw and what the store and the
    broker hold at its end.

    Args:
        ledger: what the simulation saw (violations are added to it).
        runs: the runs started and their outcomes.
        store: the shared run store.
        broker: the shared broker.
        expected_output: ``(workflow, input) -> output`` of a completed run, if known.
        transport_options: the transport keywords of the engines and workers.
        engines: the engines (their duplicate records and counters), if checked.
        engine_options: the engines' keywords (their check interval and run lease).
        engine_restart_delay: how long a killed engine stays down.
    """

    def __init__(
        self,
        ledger: Ledger,
        runs: Runs,
        store: RecordingStore,
        broker: MemoryBroker,
        *,
        expected_output: Callable[[str, Any], Any] | None,
        transport_options: dict[str, Any],
        engines: Engines | None = None,
        engine_options: dict[str, Any] | None = None,
        engine_restart_delay: float = 0.0,
    ) -> None:
        self.engines = engines
        self.ledger = ledger
        self.runs = runs
        self.store = store
        self.broker = broker
        self.expected_output = expected_output
        self.transport_options = transport_options
        self.engine_options = engine_options or {}
        self.engine_restart_delay = engine_restart_delay
        self.steps: dict[str, list[StepRecord]] = {}
        """Every run's steps, as the store holds them at the end."""
        self.set_aside: set[tuple[str, str]] = set()
        """(queue, job id) of the claims in a failed set as damaged, at the end."""
        self.stalled_out: list[tuple[str, FailedJob]] = []
        """(queue, job) of every job in a failed set as stalled, at the end."""
        self.children = 0
        """Child runs checked (``check_children``)."""
        self.continued = 0
        """Runs that continued as new (``check_generations``)."""
        self.drained_at: float | None = None
        """When the drain ended (ledger time), and its ``drain_timeout``: set by the
        simulation, to tell a run still in a durable timer from a lost one."""
        self.drain_timeout: float | None = None

    async def collect(self) -> None:
        """Read what the checks need of the store and the broker (once every process is
        closed)."""
        for run_id in self.runs.inputs:  # every generation's (continue-as-new)
            self.steps[run_id] = await run_history(self.store, run_id)
        # Continue-as-new (issue 34, item 5): a continued run's histories chain without gap.
        self.continued = await check_generations(
            self.store, sorted(self.runs.inputs), self.ledger.violation
        )
        # Child workflows (issue 18): no child orphaned, each started once.
        self.children = await check_children(
            self.store, self.ledger.violation, gone=self.store.prunes
        )
        for queue in sorted({details["queue"] for _, _, details in self.ledger.damaged}):
            for failed in await self.broker.failed_jobs(queue, limit=1_000_000):
                if failed.error.startswith("damaged: "):
                    self.set_aside.add((queue, failed.id))
        for queue in self.broker.queue_names():
            for failed in await self.broker.failed_jobs(queue, limit=1_000_000):
                if failed.error.startswith("stalled more than "):
                    self.stalled_out.append((queue, failed))

    def check(self) -> None:
        """Add a violation to the ledger for every invariant broken."""
        self._no_run_lost()
        self._settled_once()
        self._duplicates_explained()
        self._duplicate_results_recorded()
        self._damaged_set_aside()
        self._failovers_explained()
        self._stalled_out_counted()
        self._attempts_logged()
        self._losses_detected()

    def _no_run_lost(self) -> None:
        violation = self.ledger.violation
        outcomes = self.runs.outcomes
        for run_id, (workflow, value) in self.runs.inputs.items():
            outcome = outcomes.get(run_id)
            if outcome is None:
                violation(self._unfinished(run_id, workflow))
            elif run_id in self.ledger.poisoned_runs:
                # A crash loop fails its run once the poison step's attempts are exhausted.
                status, output = outcome
                if status != "failed" or "stalled more than" not in str(output):
                    violation(
                        f"run {run_id} ({workflow}) with a poison step ended {status} with "
                        f"{output!r}, expected failed as stalled"
                    )
            elif outcome[0] == "cancelled" and run_id in self.runs.asked:
                pass  # the workload cancelled it: _sim_cancels checks that end
            elif self.expected_output is not None:
                status, output = outcome
                expected = self.expected_output(workflow, value)
                if status != "completed" or output != expected:
                    violation(
                        f"run {run_id} ({workflow}) ended {status} with {output!r}, "
                        f"expected completed with {expected!r}"
                    )

    def _losses_detected(self) -> None:
        """Every step task or result the broker acknowledged and lost was found by an
        engine's loss audit (reported as ``StepLost`` and dispatched again), unless the attempt
        was answered anyway: another execution of it finished with its result delivered (a
        redelivery the loss did not touch), or the lost write was the retry of a push that
        landed (its reply lost). (That its run completed is ``_no_run_lost``.)"""
        ledger = self.ledger
        lost_results: dict[tuple[str, str, int], int] = {}
        for kind, key, _ in ledger.lost_writes:
            if kind == "result":
                lost_results[key] = lost_results.get(key, 0) + 1
        for kind, key, at in ledger.lost_writes:
            if key in ledger.detected_losses or key[0] in ledger.poisoned_runs:
                continue
            if kind == "result" and key in ledger.landed_results:
                continue  # an earlier push of it landed (its reply lost, then retried)
            finished = [
                e
                for e in ledger.executions.get(key, ())
                if e.outcome not in ("cancelled", "running")
            ]
            if len(finished) > lost_results.get(key, 0):
                continue  # an execution's result got through
            ledger.violation(
                f"step {key[0]}:{key[1]} attempt {key[2]}: its {kind}, lost by the broker at "
                f"{at:.3f}, was never found by the engine's loss audit"
            )

    def _attempts_logged(self) -> None:
        """Every settled remote step's attempt log is bounded, in attempt order, each entry
        ending after it started, and its last entry is the attempt that settled it, with the
        same outcome (written in the same compare-and-set)."""
        violation = self.ledger.violation
        for run_id, steps in self.steps.items():
            for record in steps:
                if record.kind is not StepKind.REMOTE or record.status is StepState.PENDING:
                    continue
                where = f"step {run_id}:{record.step_id}"
                log = record.attempts
                numbers = [e.get("attempt", 0) for e in log if isinstance(e, dict)]
                if len(log) > ATTEMPT_LOG_LIMIT or numbers != sorted(set(numbers)):
                    violation(f"{where}'s attempt log is unbounded or out of order: {numbers}")
                if any(e["endedAt"] < e["startedAt"] for e in log if isinstance(e, dict)):
                    violation(f"{where}'s attempt log has an attempt that ended before it began")
                last = log[-1] if log else None
                completed = record.status is StepState.COMPLETED
                if (
                    not isinstance(last, dict)
                    or last.get("attempt") != record.attempt
                    or (last.get("outcome") == "completed") != completed
                ):
                    violation(
                        f"{where} settled {record.status.value} at attempt {record.attempt}, "
                        f"its attempt log ends with {last!r}"
                    )

    def _unfinished(self, run_id: str, workflow: str) -> str:
        """What a run that never ended is: still in a durable timer due after the drain's end
        (the drain was too short for it), or lost."""
        due = [
            step.wake_at - self.ledger.t0  # the memory store's clock is trio's
            for step in self.steps.get(run_id, ())
            if step.kind is StepKind.TIMER
            and step.status is StepState.PENDING
            and step.wake_at is not None
        ]
        if due and self.drained_at is not None and min(due) > self.drained_at:
            return (
                f"run {run_id} ({workflow}) unfinished at the drain's end "
                f"(t={self.drained_at:.3f}): in a durable timer due at t={min(due):.3f}, not "
                f"lost; give the simulation a drain_timeout that reaches it (it was "
                f"{self.drain_timeout})"
            )
        return f"run {run_id} ({workflow}) never ended (lost)"

    def _settled_once(self) -> None:
        """Every settled step settled once, with a result a worker produced."""
        violation = self.ledger.violation
        executions = self.ledger.executions
        for (run_id, step_id), count in self.store.settled.items():
            if count != 1:
                violation(f"step {run_id}:{step_id} was settled {count} times")
        for run_id, steps in self.steps.items():
            for record in steps:
                if record.kind is not StepKind.REMOTE or record.status is not StepState.COMPLETED:
                    continue
                key = (run_id, record.step_id, record.attempt)
                produced = {e.output for e in executions.get(key, ()) if e.outcome == "ok"}
                if orjson.dumps(record.output) not in produced:
                    violation(
                        f"step {run_id}:{record.step_id} completed with an output no execution "
                        f"of attempt {record.attempt} produced"
                    )

    def _duplicates_explained(self) -> None:
        """Duplicates only where a lease was lost (or a push was repeated): every execution
        after the first needs a cause, and one earlier execution (whose claim a fault took,
        or which was cancelled and handed back) or one repeated push causes one redelivery."""
        ledger = self.ledger
        for key, executions in ledger.executions.items():
            pushes = ledger.duplicate_pushes.get(key, 0)
            # Several engines: two that applied copies of one decision (or of one result) at
            # once may each have sent the attempt, and then again on seeing it undispatched
            # (docs/remote.md). An attempt sent by more than one engine: each send beyond the
            # first explains one redelivery. (Sent by one engine only: no such allowance.)
            senders = ledger.task_pushers.get(key)
            if senders is not None and len(senders) > 1:
                pushes += sum(senders.values()) - 1
            causes = executions[:1]
            for after in executions[1:]:
                cause = next(
                    (
                        e
                        for e in causes
                        if e.outcome == "cancelled"
                        or ledger.faulted(e.worker, e.start, after.start)
                    ),
                    None,
                )
                if cause is not None:
                    causes.remove(cause)
                elif pushes:
                    pushes -= 1
                else:
                    ledger.violation(
                        f"step {key[0]}:{key[1]} attempt {key[2]} ran again on {after.worker} "
                        f"at {after.start:.3f} with no fault to explain it (earlier: "
                        + ", ".join(
                            f"{e.worker} at {e.start:.3f} ({e.outcome})"
                            for e in executions[: executions.index(after)]
                        )
                        + ")"
                    )
                causes.append(after)

    def _duplicate_results_recorded(self) -> None:
        """Every duplicate completed result (a second completed result for one attempt) an
        engine met has a recorded cause: the entry is there, it names a cause, and it carries
        the copy's delivery evidence (every simulated worker sends it), so which lease was
        lost and when can be read off it. None of them was applied (``_settled_once``)."""
        engines = self.engines
        if engines is None or engines.statistics is None:
            return
        violation = self.ledger.violation
        met = engines.statistics.duplicate_completions
        recorded = engines.duplicates
        if met != len(recorded):
            violation(
                f"{met} duplicate completed results met, {len(recorded)} recorded with a cause"
            )
        for entry in recorded:
            where = f"step {entry.run_id}:{entry.step_id} attempt {entry.attempt}"
            if not entry.cause:
                violation(f"duplicate completed result of {where} recorded with no cause")
            if not isinstance(entry.duplicate, dict) or not entry.duplicate.get("lease"):
                violation(f"duplicate completed result of {where} carries no delivery evidence")
    def _stalled_out_counted(self) -> None:
        """No job failed as stalled without more than ``max_stalled_count`` counted stalls
        (stalls while its handler ran); a stall of a claim popped ahead and never started
        never counts, and the job's count is exactly its counted stalls."""
        limit = int(self.transport_options.get("max_stalled_count", DEFAULT_MAX_STALLED_COUNT))
        for queue, failed in self.stalled_out:
            counted = sum(s.counted for s in failed.stalls)
            if counted <= limit or failed.stalled_count != counted:
                self.ledger.violation(
                    f"job {failed.id} on {queue} failed as stalled with {counted} counted "
                    f"stall(s) of {len(failed.stalls)} (stalled_count {failed.stalled_count}, "
                    f"limit {limit})"
                )

    def _damaged_set_aside(self) -> None:
        """A damaged claim is set aside unread: never run, kept in the failed set (unless its
        worker met a fault before it could fail it: then the claim came back by lease expiry,
        undamaged, and ran as any redelivery does)."""
        ledger = self.ledger
        cleanup = float(self.transport_options["cleanup_timeout"])
        for process, at, details in ledger.damaged:
            task = details.get("task")
            executions = ledger.executions.get(tuple(task), ()) if task is not None else ()
            if any(e.worker == process and e.start == at for e in executions):
                ledger.violation(f"a damaged claim ran: {details} on {process} at {at:.3f}")
            if (details["queue"], details["job"]) not in self.set_aside and not ledger.faulted(
                process, at, at + 2 * cleanup
            ):
                ledger.violation(f"a damaged claim was not set aside: {details} on {process}")

    def _failovers_explained(self) -> None:
        """No step failed over by its heartbeat timeout while its worker was beating: each
        attempt failed over had its beats stopped by a cause within the timeout (plus a check
        and the beats' own intervals) before the failover: a fault of the worker running it
        (killed, stalled, closing, a call dropped or late), that execution having ended (its
        result late), or an engine killed or faulted meanwhile (beats not applied)."""
        ledger = self.ledger
        engines = [p for p in ledger.fault_windows if p.startswith("engine")]
        check = float(self.engine_options.get("heartbeat_check_interval", 1.0))
        lease = float(self.engine_options.get("run_lease", 30.0))
        for run_id, step_id, attempt, when in self.store.failovers:
            at = when - ledger.t0
            record = next((s for s in self.steps.get(run_id, ()) if s.step_id == step_id), None)
            timeout = record.heartbeat_timeout if record is not None else None
            if timeout is None:
                ledger.violation(f"step {run_id}:{step_id} was failed over with no timeout")
                continue
            # The last beat that mattered: within the timeout, a check, a push interval and
            # the step's own beat period (1 s in the sample) before the failover.
            since = at - timeout - check - timeout / 3 - 1.0
            executions = ledger.executions.get((run_id, step_id, attempt), ())
            explained = (
                any(
                    (e.end is not None and e.end <= at) or ledger.faulted(e.worker, since, at)
                    for e in executions
                )
                or any(
                    since - lease - self.engine_restart_delay <= k <= at
                    for k in ledger.engine_kills
                )
                or any(ledger.faulted(p, since, at) for p in engines)
            )
            if not explained:
                ledger.violation(
                    f"step {run_id}:{step_id} attempt {attempt} was failed over by its "
                    f"heartbeat timeout at {at:.3f} while its worker was beating"
                )
