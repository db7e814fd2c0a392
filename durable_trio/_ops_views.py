"""The operations' views (:mod:`._ops`): what ``ops.show_run``, ``ops.queues``, ``ops.workers``,
``ops.failed_jobs`` and ``ops.prune_runs`` answer, as plain frozen values with their JSON form
(``--json``, the console)."""

from __future__ import annotations

from typing import Any

import attrs
import orjson

from ._engine._records import RunRecord, StepKind, StepRecord, StepState
from ._ops_attempts import AttemptView, attempt_views
from ._wire import JSONValue, WorkerStatus
from .brokers import FailedJob

#: The attempt states that are not over (an attempt's run still open).
_UNSETTLED = frozenset({"running", "waiting"})

__all__ = [
    "FailedJobView",
    "PruneReport",
    "QueueView",
    "RunDetails",
    "StepView",
    "TimerView",
    "WorkerView",
    "details_of",
    "run_to_json",
    "workers_of",
]


@attrs.frozen
class StepView:
    """One step (remote ``ctx.step`` or local ``ctx.run``) of a run's history."""

    step_id: str
    kind: StepKind
    name: str
    status: StepState
    attempts: tuple[AttemptView, ...]
    """Every attempt, oldest first (see :class:`AttemptView` for what is known of each)."""
    notes: tuple[str, ...] = ()
    """What its attempts cannot show: a damaged attempt log, attempts older than the log
    keeps."""
    input: JSONValue = None
    output: JSONValue = None
    error: JSONValue = None
    created_at: float = 0.0
    updated_at: float = 0.0
    last_heartbeat: JSONValue = None
    interrupted: bool = False
    """The run ended (cancelled, failed, completed) while this step was pending: it will
    never settle (a result that still comes is dropped). Derived from the run's status; the
    store keeps the step as it was (``status`` pending)."""

    @property
    def duration(self) -> float | None:
        """From the step's creation to its end (``None`` while it is pending)."""
        if self.status is StepState.PENDING:
            return None
        return max(0.0, self.updated_at - self.created_at)

    @property
    def shown_status(self) -> str:
        """The status to show: ``interrupted`` for a step its run's end left pending, else
        the stored one (``pending``, ``completed``, ``failed``)."""
        return "interrupted" if self.interrupted else self.status.value

    @property
    def cancel_mark(self) -> bool:
        """Whether this is the mark a cancel left in the history (``cancel:run``), not a step:
        :attr:`output` holds its ``reason`` and the steps it ``interrupted``."""
        return self.kind is StepKind.CANCEL

    def to_json(self) -> dict[str, Any]:
        """As ``durable-trio runs show --json`` prints it."""
        return {
            "stepId": self.step_id,
            "kind": self.kind.value,
            "name": self.name,
            "status": self.status.value,
            "createdAt": self.created_at,
            "updatedAt": self.updated_at,
            "duration": self.duration,
            "input": self.input,
            "output": self.output,
            "error": self.error,
            "lastHeartbeat": self.last_heartbeat,
            "attempts": [a.to_json() for a in self.attempts],
            "notes": list(self.notes),
            "interrupted": self.interrupted,
        }


@attrs.frozen
class TimerView:
    """One durable timer (``ctx.sleep``) of a run."""

    step_id: str
    wake_at: float | None
    """Store clock time it fires (fired: it did)."""
    fired: bool
    created_at: float = 0.0
    interrupted: bool = False
    """The run ended before it fired: it never will (derived, as
    :attr:`StepView.interrupted`)."""

    @property
    def state(self) -> str:
        """``fired``, ``waiting`` or ``interrupted``."""
        return "fired" if self.fired else "interrupted" if self.interrupted else "waiting"

    def to_json(self) -> dict[str, Any]:
        """As ``durable-trio runs show --json`` prints it."""
        return {
            "stepId": self.step_id,
            "wakeAt": self.wake_at,
            "fired": self.fired,
            "createdAt": self.created_at,
            "interrupted": self.interrupted,
        }


@attrs.frozen
class RunDetails:
    """A run and its history timeline (:meth:`Operations.show_run`)."""

    run: RunRecord
    steps: tuple[StepView, ...]
    """Remote and local steps, in step id order."""
    timers: tuple[TimerView, ...]
    generation: int = 0
    """Which generation of the run these are (continue-as-new: ``_ops_generations.py``)."""
    previous: tuple[int, ...] = ()
    """The numbers of its previous generations still kept (retention deletes those that ended
    longer than its retention ago, and all of them with the run)."""

    @property
    def children(self) -> tuple[str, ...]:
        """The run ids of the child workflows it started (its CHILD steps, in step order)."""
        return tuple(
            str(step.input["runId"])
            for step in self.steps
            # (a CHILD step's input names its child: one that does not is damaged, unlisted)
            if step.kind is StepKind.CHILD
            and isinstance(step.input, dict)
            and "runId" in step.input
        )

    def to_json(self) -> dict[str, Any]:
        """As ``durable-trio runs show --json`` prints it (``children`` only when it started
        some)."""
        children = {"children": list(self.children)} if self.children else {}
        continued = (
            {"generation": self.generation, "previousGenerations": list(self.previous)}
            if self.generation or self.previous
            else {}
        )
        return {**run_to_json(self.run), **{
            "steps": [s.to_json() for s in self.steps],
            "timers": [t.to_json() for t in self.timers],
        }, **children, **continued}  # fmt: skip


@attrs.frozen
class FailedJobView:
    """A job its queue set aside (failed for good), with its evidence."""

    queue: str
    job: FailedJob
    """What the broker keeps: id, bytes, error, when, attempts, stalls."""
    run_status: str | None = None
    """The status of the run its step task belongs to, as the run store has it now
    (``None``: not a step task, or no such run). A job set aside after its run ended
    (``completed`` when another claim of it answered first: its worker stopped renewing,
    and the broker took it back until it gave up) is the evidence of a finished run, not
    a live failure."""

    @property
    def run_id(self) -> str | None:
        """The run its step task belongs to, if it is one that says."""
        envelope = self.envelope
        if not isinstance(envelope, dict) or envelope.get("kind", "task") != "task":
            return None
        payload = envelope.get("payload")
        run_id = payload.get("runId") if isinstance(payload, dict) else None
        return run_id if isinstance(run_id, str) else None

    @property
    def envelope(self) -> Any:
        """The job's bytes decoded as JSON (the transport's envelope), ``None`` if not JSON."""
        try:
            return orjson.loads(self.job.data)
        except orjson.JSONDecodeError:
            return None

    def to_json(self) -> dict[str, Any]:
        """As ``durable-trio jobs failed --json`` prints it."""
        job = self.job
        envelope = self.envelope
        return {
            "queue": self.queue,
            "id": job.id,
            "error": job.error,
            "failedAt": job.failed_at,
            "attempts": job.attempts,
            "stalledCount": job.stalled_count,
            "stalls": [{"at": s.at, "worker": s.worker, "counted": s.counted} for s in job.stalls],
            "kind": envelope.get("kind") if isinstance(envelope, dict) else None,
            "runId": self.run_id,
            "runStatus": self.run_status,
            "data": envelope if envelope is not None else job.data.decode(errors="replace"),
        }


@attrs.frozen
class QueueView:
    """How one queue of the namespace is doing (:meth:`Operations.queues`)."""

    queue: str
    """The full name (``{namespace}:tasks:{group}``, ``{namespace}:results``, ...)."""
    ready: int
    """Jobs waiting, ready to be claimed (its depth)."""
    delayed: int | None
    """Jobs held back (a delay or a retry backoff); ``None``: the broker cannot tell apart."""
    claimed: int | None
    """Jobs a worker holds under a lease; ``None``: the broker cannot count them."""
    failed: int | None
    """Jobs set aside (failed for good, kept for inspection)."""
    live_workers: int
    """Workers with a live liveness key serving it (task queues only; 0 otherwise)."""
    oldest_ready_age: float | None = None
    """Seconds since the oldest ready job was pushed (broker clock; see
    :attr:`~durable_trio.brokers.QueueStats.oldest_ready_age`); ``None``: none is ready, or a
    ready job's push time is unknown."""
    limit: int | None = None
    """Its fleet-wide concurrency limit (``@app.step(max_concurrency=...)``), ``None``: none.
    Then ``claimed`` is the slots in use and ``ready`` the jobs waiting for one."""
    per_key: bool = False
    """The limit holds per concurrency key (``concurrency_key=``)."""
    rate: int | None = None
    """Its rate limit (``@app.step(rate_limit=dt.Rate(rate, per=rate_per))``), ``None``: none."""
    rate_per: float | None = None
    """The rate's window, seconds."""
    window: int = 0
    """Starts in the rate's current window (the last ``rate_per`` seconds); for a per-key rate,
    the busiest key's starts in its window."""
    rate_per_key: bool = False
    """The rate holds per key (``dt.Rate(..., key=...)``)."""
    window_keys: int = 0
    """For a per-key rate: the keys with a start in their current window."""

    @property
    def group(self) -> str | None:
        """The routing group (token) of a task queue, ``None`` for another queue."""
        _, sep, token = self.queue.partition(":tasks:")
        return token if sep else None

    def to_json(self) -> dict[str, Any]:
        """As ``durable-trio queues --json`` prints it."""
        return {
            "queue": self.queue,
            "group": self.group,
            "ready": self.ready,
            "delayed": self.delayed,
            "claimed": self.claimed,
            "failed": self.failed,
            "liveWorkers": self.live_workers,
            "oldestReadyAge": self.oldest_ready_age,
            "limit": self.limit,
            "perKey": self.per_key,
            "rate": self.rate,
            "ratePer": self.rate_per,
            "rateWindow": self.window,
            "ratePerKey": self.rate_per_key,
            "rateWindowKeys": self.window_keys,
        }

    @property
    def rate_text(self) -> str:
        """The rate and its current window as the tables show it (``3/2 per 1s``: 3 starts in
        the current window of a rate of 2 per second; ``—``: no rate). A per-key rate shows
        its busiest key and how many keys have an open window: ``2/2 per 1s per key, 3 keys``
        (the busiest key has 2 starts in its window; 3 keys have at least one)."""
        if self.rate is None or self.rate_per is None:
            return "—"
        text = f"{self.window}/{self.rate} per {self.rate_per:g}s"
        if not self.rate_per_key:
            return text
        return f"{text} per key, {self.window_keys} key{'' if self.window_keys == 1 else 's'}"


@attrs.frozen
class WorkerView:
    """One live worker instance (once, whatever the number of groups it serves)."""

    instance: str
    groups: tuple[str, ...]
    """The groups (routing tokens) it serves."""
    last_beat_at: float
    """Unix time of its newest beat."""
    status: WorkerStatus | None
    """Its liveness snapshot (limit, in-flight, RSS, CPU, ...), ``None`` if it sent none."""

    @property
    def limit(self) -> int | None:
        """Its concurrency limit (for all its groups together)."""
        return None if self.status is None else self.status.limit

    @property
    def in_flight(self) -> int | None:
        """Steps running on it now (all its groups together)."""
        return None if self.status is None else self.status.in_flight

    @property
    def headroom(self) -> int | None:
        """Free slots (limit - in-flight)."""
        if self.status is None:
            return None
        return max(0, self.status.limit - self.status.in_flight)

    def to_json(self) -> dict[str, Any]:
        """As ``durable-trio health --json`` prints it."""
        status = self.status
        return {
            "instance": self.instance,
            "groups": list(self.groups),
            "lastBeatAt": self.last_beat_at,
            "mode": status.mode if status else None,
            "limit": self.limit,
            "inFlight": self.in_flight,
            "headroom": self.headroom,
            "rssBytes": status.rss_bytes if status else None,
            "cpu": status.cpu if status else None,
            "p95Ms": status.p95_ms if status else None,
            "throughput": status.throughput if status else None,
        }


def run_to_json(run: RunRecord) -> dict[str, Any]:
    """A run record as the CLI prints it (``--json``)."""
    return {
        "runId": run.run_id,
        "workflow": run.workflow,
        "status": run.status.value,
        "createdAt": run.created_at,
        "updatedAt": run.updated_at,
        "owner": run.owner,
        "leaseUntil": run.lease_until,
        "timeout": run.timeout,
        "input": run.input,
        "output": run.output,
        "error": run.error,
        # A child workflow's parent (issue 18): only on children, older output unchanged.
        **({"parent": run.parent} if run.parent is not None else {}),
        # Its tags (issue 34): only on a tagged run, older output unchanged.
        **({"tags": dict(run.tags)} if run.tags else {}),
    }


def details_of(run: RunRecord, steps: list[StepRecord], now: float | None = None) -> RunDetails:
    """A run and its checkpoints as a :class:`RunDetails` (``now``: the store's clock).

    A step (or timer) still pending in the store when the run has ended is shown
    ``interrupted``, its current attempt too: nothing will settle it (the store is not
    changed; what it holds is what the run left)."""
    views = []
    timers = []
    ended = run.status.terminal
    for step in steps:
        interrupted = ended and step.status is StepState.PENDING
        if step.kind is StepKind.TIMER:
            timers.append(
                TimerView(
                    step.step_id,
                    step.wake_at,
                    step.status is StepState.COMPLETED,
                    created_at=step.created_at,
                    interrupted=interrupted,
                )
            )
            continue
        attempts, notes = attempt_views(step, now)
        if interrupted:
            attempts = tuple(
                attrs.evolve(a, status="interrupted") if a.status in _UNSETTLED else a
                for a in attempts
            )
        views.append(
            StepView(
                step_id=step.step_id,
                kind=step.kind,
                name=step.name,
                status=step.status,
                attempts=attempts,
                notes=notes,
                input=step.input,
                output=step.output,
                error=step.error,
                created_at=step.created_at,
                updated_at=step.updated_at,
                last_heartbeat=step.heartbeat,
                interrupted=interrupted,
            )
        )
    return RunDetails(run, tuple(views), tuple(timers))


#: What an attempt of a pending step shows (:class:`AttemptView`): once its run has ended,
#: neither is true any more.


@attrs.frozen
class PruneReport:
    """What :meth:`Operations.prune_runs` did (or, with ``dry_run``, would do)."""

    ended_before: float
    """The cut-off: runs that ended before it (store clock)."""
    count: int
    """Runs deleted (with ``dry_run``: that would be, at most)."""
    dry_run: bool = False
    generations: int = 0
    """Previous generations (continue-as-new) deleted, of runs finished or not, that ended
    before the cut-off, not counting those deleted with their run (with ``dry_run``: that
    would be, at most: the runs' own counted too)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "endedBefore": self.ended_before,
            "count": self.count,
            "generations": self.generations,
            "dryRun": self.dry_run,
        }


def workers_of(groups: Any) -> list[WorkerView]:
    """The live workers of ``groups`` (:class:`~durable_trio.GroupHealth` list), each once:
    a worker serving several groups beats once per group, with the same status."""
    by_instance: dict[str, tuple[list[str], float, WorkerStatus | None]] = {}
    for group in groups:
        for worker in group.live_workers:
            served, beat, status = by_instance.get(worker.instance, ([], 0.0, None))
            served.append(group.group)
            if worker.last_beat_at >= beat:
                beat, status = worker.last_beat_at, worker.status or status
            by_instance[worker.instance] = (served, beat, status)
    return [
        WorkerView(instance, tuple(served), beat, status)
        for instance, (served, beat, status) in sorted(by_instance.items())
    ]
