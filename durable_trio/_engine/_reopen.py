"""An operator's retry of a failed run (``engine.retry``, ``ops.retry_run``,
``durable-trio runs retry``): what changes in the store, planned here once for every store.

A failed run is reopened (pending, no owner: the reconcile of any live engine takes it over)
and replayed from the top: its completed steps and fired timers replay from the store, never
re-run. What it resumes from:

- the step its failure names (``error.stepId``: the step that failed for good) is set pending
  at its next attempt. A remote step gets a fresh budget of attempts (its stored policy's
  ``maxAttempts`` is raised by the attempts already made; attempt numbers keep growing, so a
  late result of an old attempt stays stale; its backoff starts over with the new budget:
  ``StoredRetry.earlier``); a local step (``ctx.run``, its policy in the
  code) gets one more attempt.
- every step still pending (a run that timed out, or steps running beside the failed one) is
  moved to its next attempt and re-dispatched (its old task's result, if any still comes, is
  stale); a pending timer keeps its wake-up time.
- a run that had a timeout gets it afresh: its deadline becomes now plus its timeout.
- a parent failed by a child (``ChildFailed`` not caught: its error names the CHILD step and
  ``childRunId``): that child, failed or blocked, is retried first (the same way, recursively:
  its own failed child too), then the CHILD step is set pending, so the parent waits on the
  child's new end instead of meeting its old failure again. A child that was cancelled stays
  as it is (its parent fails again on replay, as it did).

Each step's attempt log is kept: a retried step's new attempt starts at the reopening (its
``wake_at``), and the attempt a still-pending step was running is logged as ``abandoned``
(its worker may still finish it; that result is stale).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from ._errors import RunNotFound, RunNotRetryable
from ._records import RunRecord, RunStatus, StepKind, StepRecord, StepState, ended_attempt

if TYPE_CHECKING:
    from ._stores import RunStore

__all__ = ["plan_retry", "retry_run"]

#: The key of a stored retry policy holding its original ``maxAttempts`` once raised.
_BASE = "operatorBase"


def _fresh_budget(step: StepRecord) -> Any:
    policy = step.retry
    if step.kind is not StepKind.REMOTE or not isinstance(policy, dict):
        return policy
    base = policy.get(_BASE, policy.get("maxAttempts", 3))
    if type(base) is not int or base < 1:
        base = 3
    return {**policy, _BASE: base, "maxAttempts": step.attempt + base}


def plan_retry(
    run: RunRecord, steps: list[StepRecord], now: float
) -> tuple[list[StepRecord], float | None]:
    """The checkpoints to rewrite and the run's new ``timeout`` (see the module docstring).

    Raises:
        RunNotRetryable: the run is not failed.
    """
    if run.status not in (RunStatus.FAILED, RunStatus.BLOCKED):
        raise RunNotRetryable(run.run_id, run.status.value)
    error = run.error
    cause = error.get("stepId") if isinstance(error, dict) else None
    changed: list[StepRecord] = []
    for step in steps:
        failed_cause = step.status is StepState.FAILED and step.step_id == cause
        running = step.status is StepState.PENDING and step.kind is not StepKind.TIMER
        if not (failed_cause or running):
            continue
        if running:
            step = attrs.evolve(
                step, attempts=ended_attempt(step, ended_at=now, outcome="abandoned")
            )
        changed.append(
            attrs.evolve(
                step,
                status=StepState.PENDING,
                attempt=step.attempt + 1,
                wake_at=now,  # due at once: also when the new attempt started (its log)
                dispatched=False,
                retry=_fresh_budget(step) if failed_cause else step.retry,
            )
        )
    timeout = None if run.timeout is None else max(0.0, now - run.created_at) + run.timeout
    return changed, timeout


async def retry_run(store: RunStore, run_id: str) -> RunRecord:
    """Reopen the failed run ``run_id`` in ``store`` (see the module docstring).

    Returns:
        The run as reopened (pending, no owner).

    Raises:
        RunNotFound: no such run.
        RunNotRetryable: it is not failed (or stopped being failed meanwhile).
    """
    run = await store.get_run(run_id)
    if run is None:
        raise RunNotFound(run_id)
    steps, timeout = plan_retry(run, await store.get_steps(run_id), store.now())
    child_id = run.error.get("childRunId") if isinstance(run.error, dict) else None
    if isinstance(child_id, str) and any(s.kind is StepKind.CHILD for s in steps):
        child = await store.get_run(child_id)
        if child is not None and child.status in (RunStatus.FAILED, RunStatus.BLOCKED):
            await retry_run(store, child_id)  # first: the parent then waits on its new end
    if not await store.reopen_run(run_id, steps, run_timeout=timeout):
        current = await store.get_run(run_id)
        if current is None:
            raise RunNotFound(run_id)
        raise RunNotRetryable(run_id, current.status.value)
    reopened = await store.get_run(run_id)
    if reopened is None:
        raise RunNotFound(run_id)
    return reopened
