"""The wire protocol: every message that crosses a queue, as frozen ``attrs`` classes.

Field names are snake_case here and camelCase on the wire; the JSON mapping lives in
:mod:`durable_trio._codec` and nowhere else. Everything is plain JSON so a worker in any language
can serve the same queues, and never pickle: whoever can write to a queue must not be able to run
code in a worker.
"""

from __future__ import annotations

import enum
import itertools
import secrets
from typing import Any, TypeAlias

import attrs

from ._attrs_shared import shared_eq, shared_hash, shared_repr

__all__ = [
    "ControlMessage",
    "DecisionStatus",
    "Envelope",
    "InboxRegistration",
    "JSONValue",
    "JobKind",
    "RemoteTask",
    "RunReply",
    "RunRequest",
    "StartRunMessage",
    "StepError",
    "StepEvent",
    "StepEventKind",
    "StepHeartbeat",
    "StepResult",
    "StepStatus",
    "TenantEvent",
    "TraceContext",
    "WorkerAdvertisement",
    "WorkerStatus",
    "WorkflowDecision",
    "WorkflowTask",
]

#: Any JSON value (object, array, string, number, boolean, null) as ``orjson`` reads it.
JSONValue: TypeAlias = Any


#: Task ids: 64 random bits per process, then a counter — unique across processes without
#: paying for a uuid4 per dispatch on the hot path.
_ID_PREFIX = secrets.token_hex(8)
_ID_COUNTER = itertools.count(1)


def _new_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):x}"


class JobKind(enum.StrEnum):
    """What a job envelope carries; the transport routes on it."""

    TASK = "task"
    WORKFLOW = "workflow"
    RESULT = "result"
    HEARTBEAT = "heartbeat"
    CONTROL = "control"
    DECISION = "decision"
    STEP_EVENT = "stepEvent"
    START_RUN = "startRun"
    RUN_REQUEST = "runRequest"
    RUN_REPLY = "runReply"
    TENANT_EVENT = "tenantEvent"
    INBOX_REGISTRATION = "inboxRegistration"
    ADVERTISEMENT = "advertisement"


class StepStatus(enum.StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"


class DecisionStatus(enum.StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    CONTINUED = "continued"


class StepEventKind(enum.StrEnum):
    STARTED = "started"
    COMPLETED = "completed"
    FAILED = "failed"


@attrs.frozen(repr=False, eq=False)
class StepError:
    """Why a step failed."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    message: str
    """Human-readable reason."""
    code: str | None = None
    """Machine-readable reason (``no_handler``, ``bad_output``, ``stalled``, ...)."""
    retryable: bool = True
    """Whether the engine may retry the step (while attempts remain)."""
    details: JSONValue = None
    """Evidence (a poison job's stall history and its workers' last liveness snapshots, ...)."""


@attrs.frozen(repr=False, eq=False)
class RemoteTask:
    """engine -> step worker: run one attempt of one step."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    run_id: str
    """The workflow run this step belongs to."""
    step_id: str
    """The step's id inside its run (stable across attempts)."""
    attempt: int
    """1 for the first attempt, 2 for the first retry, ..."""
    name: str
    """The registered step name the worker looks its handler up by."""
    input: JSONValue = None
    """The step's input."""
    group: str | None = None
    """Routing group; the step name when absent."""
    priority: int | None = None
    """Lower runs first; absent = the broker's default (FIFO)."""
    deadline: float | None = None
    """Unix time (seconds) after which the result no longer matters."""
    task_id: str = attrs.field(factory=_new_id)
    """Unique per dispatch."""
    timeout: float | None = None
    """Start-to-close timeout: seconds the handler may run; the worker cancels it then and
    answers a retryable ``StepTimedOut`` failure. Absent: no limit."""
    heartbeat_timeout: float | None = None
    """Seconds the engine waits for the next beat once the step beat (``heartbeat_timeout=``
    on its declaration); the worker pushes beats at least three times as often."""
    last_heartbeat: JSONValue = None
    """The details of the previous attempt's last beat, if it beat."""
    max_attempts: int | None = None
    """Attempts the step's retry policy allows in all (the engine's, as the checkpoint stores
    it); absent: unknown. A worker logs a retryable failure of an earlier attempt as one
    WARNING line (the engine retries it) and keeps ERROR, with the traceback, for the last."""

    @property
    def idempotency_key(self) -> str:
        """Stable across attempts and redeliveries: key your side effects on it."""
        return f"{self.run_id}:{self.step_id}"

    @property
    def routing_group(self) -> str:
        """The group this task routes by (its ``group``, else its ``name``)."""
        return self.group if self.group is not None else self.name


@attrs.frozen(repr=False, eq=False)
class StepResult:
    """step worker -> engine: how one attempt of one step ended."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    run_id: str
    step_id: str
    attempt: int
    status: StepStatus
    output: JSONValue = None
    """The handler's return value (status ``completed``)."""
    error: StepError | None = None
    """Why it failed (status ``failed``)."""
    task_id: str | None = None
    """The task this answers, when known."""
    delivery: JSONValue = None
    """Evidence of the claim that produced it, so a duplicate explains itself (docs/concepts.md,
    "At-least-once windows"): ``{"worker", "job", "lease", "stalledCount", "stalls"?,
    "leaseLostAt"?}`` — the instance id that held the claim, the task's job id, its lease
    token, the times the job was reclaimed before this delivery, the stall history when there
    is one (``[{"at", "worker", "counted"}]``: whose leases were lost, when, broker clock, and
    whether that stall counted: ``false`` for a claim that never started), and when this
    worker learnt that its own lease was lost (its clock; only if it did before the result was
    made). A failed result carries it too when a claim produced it (the handler raised, had no
    handler, or returned what cannot be sent): the engine logs which worker ran each attempt
    (``durable-trio runs show``). Absent from a result no claim produced (the poison bridge,
    the engine's own failovers) and from a worker that does not send it (then the worker is
    unknown)."""

    @classmethod
    def failure(
        cls, task: RemoteTask, error: StepError, delivery: JSONValue = None
    ) -> StepResult:
        """The failed result of ``task`` (``delivery``: the claim that produced it)."""
        return cls(
            task.run_id,
            task.step_id,
            task.attempt,
            StepStatus.FAILED,
            error=error,
            task_id=task.task_id,
            delivery=delivery,
        )


@attrs.frozen(repr=False, eq=False)
class StepHeartbeat:
    """step worker -> engine: a long step is still alive."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    run_id: str
    step_id: str
    attempt: int
    at: float
    """Unix time (seconds) of the beat."""
    details: JSONValue = None
    worker: str | None = None
    """The worker instance running the attempt (the engine records it with the beat, so
    ``runs show`` names the worker of a running attempt). Absent: unknown (an older worker)."""


@attrs.frozen(repr=False, eq=False)
class ControlMessage:
    """Best-effort, point-to-point control (NOT a broadcast): one consumer takes each message."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    action: str
    """What to do, e.g. ``cancel``."""
    run_id: str | None = None
    step_id: str | None = None
    data: JSONValue = None


@attrs.frozen(repr=False, eq=False)
class WorkflowTask:
    """engine -> workflow worker: run one turn of a remote workflow over its history."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    task_id: str
    run_id: str
    workflow: str
    group: str
    input: JSONValue = None
    history: tuple[JSONValue, ...] = ()
    priority: int | None = None


@attrs.frozen(repr=False, eq=False)
class WorkflowDecision:
    """workflow worker -> engine: what a turn decided."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    task_id: str
    run_id: str
    status: DecisionStatus
    commands: tuple[JSONValue, ...] = ()
    output: JSONValue = None
    error: StepError | None = None


@attrs.frozen(repr=False, eq=False)
class StepEvent:
    """workflow worker -> engine: a local step's lifecycle."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    run_id: str
    step_id: str
    kind: StepEventKind
    attempt: int
    at: float
    output: JSONValue = None
    error: StepError | None = None
    name: str | None = None
    """The local step's label (``ctx.run(name, ...)``), checked on replay."""


@attrs.frozen(repr=False, eq=False)
class StartRunMessage:
    """tenant pod -> control plane: start a run."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    run_id: str
    workflow: str
    input: JSONValue = None
    tenant: str | None = None
    reply_to: str | None = None
    """The sender's instance id, stamped by the transport."""


@attrs.frozen(repr=False, eq=False)
class RunRequest:
    """tenant pod -> control plane: ask about a run (status, result, cancel, ...)."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    request_id: str
    action: str
    run_id: str | None = None
    tenant: str | None = None
    data: JSONValue = None
    reply_to: str | None = None


@attrs.frozen(repr=False, eq=False)
class RunReply:
    """control plane -> tenant pod: the answer to one :class:`RunRequest`."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    request_id: str
    ok: bool
    data: JSONValue = None
    error: StepError | None = None


@attrs.frozen(repr=False, eq=False)
class TenantEvent:
    """control plane -> every live subscriber of ``tenant``."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    tenant: str
    kind: str
    run_id: str | None = None
    at: float | None = None
    data: JSONValue = None


@attrs.frozen(repr=False, eq=False)
class InboxRegistration:
    """instance -> control plane: "my inbox is alive and I subscribe to these tenants"."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    instance: str
    tenants: tuple[str, ...] = ()
    ttl: float = 60.0
    """Seconds the registration lives unless announced again."""
    withdrawn: bool = False


@attrs.frozen(repr=False, eq=False)
class WorkerAdvertisement:
    """store-less pod -> control plane: a key the pod would have written to its own key store
    (liveness, descriptor), recorded by the control plane in its store instead (T22,
    docs/spec.md)."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    key: str
    value: JSONValue = None
    """The key's value (the JSON the pod's key store would hold)."""
    ttl: float = 35.0
    withdrawn: bool = False
    """True: remove the key now."""


@attrs.frozen(repr=False, eq=False)
class WorkerStatus:
    """The liveness snapshot a worker publishes with every heartbeat."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    mode: str
    """``fixed`` or ``adaptive``."""
    limit: int
    in_flight: int
    rss_bytes: int | None = None
    cpu: float | None = None
    """Process CPU use over the last window, 0..cores."""
    throughput: float | None = None
    """Steps finished per second over the last window."""
    p95_ms: float | None = None
    last_adjustment: float | None = None
    """Unix time of the adaptive controller's last move."""
    duplicates: int = 0
    """Times a job's lease was lost while its handler ran (at-least-once, made measurable)."""


@attrs.frozen(repr=False, eq=False)
class TraceContext:
    """The sender's trace context (W3C Trace Context) an envelope carries.

    The span of whoever takes the job is a child of the sender's (docs/observability.md).
    Optional and ignored by a worker that does not trace; one not of this shape is dropped,
    never a reason to refuse the job."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    traceparent: str
    """The W3C ``traceparent`` (``00-{trace id}-{parent span id}-{flags}``)."""
    tracestate: str | None = None
    """The W3C ``tracestate``, when the sender has one."""
    sent_at: float | None = None
    """Unix time (seconds) the job was made: the start of its hop's span."""


@attrs.frozen(repr=False, eq=False)
class Envelope:
    """What a broker job holds: ``{id, kind, payload, priority?, trace?}``."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    id: str
    kind: JobKind
    payload: JSONValue
    priority: int | None = None
    trace: TraceContext | None = None
    """The sender's trace context (only from a process that traces)."""
