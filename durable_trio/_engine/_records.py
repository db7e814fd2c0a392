"""The run store's value types: runs, steps (checkpoints), and the outcome of applying a change.

Everything a store holds is JSON (inputs, outputs, errors, retry policies), so a run written by
one engine process can be read, replayed and finished by another.
"""

from __future__ import annotations

import enum
from typing import Any, Final, Literal

import attrs
import orjson

from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._errors import BrokerError, PayloadError
from .._json_values import check_json, json_error
from .._wire import JSONValue, StepError

__all__ = [
    "ATTEMPT_LOG_LIMIT",
    "CANCEL_STEP_ID",
    "Applied",
    "DamagedRun",
    "RunDataError",
    "RunPage",
    "RunRecord",
    "RunState",
    "RunStatus",
    "StepKind",
    "StepRecord",
    "StepState",
    "attempt_started",
    "ended_attempt",
    "error_from_json",
    "error_to_json",
    "first_or_later",
    "normalize_json",
    "patch_marker",
    "previous_details",
    "read_attempt_log",
    "read_trace",
    "step_from_json",
    "step_position",
    "step_to_json",
]


class RunDataError(BrokerError):
    """A run's or a checkpoint's row in the run store cannot be read (damaged data: a column
    that is not JSON, an unknown status). A :class:`~durable_trio.BrokerError`, so the loop
    that met it reports it and carries on; an engine that claims such a run sets it aside:
    fails it with this error (``runs show`` names the column), never drives it."""


CANCEL_STEP_ID: Final = "cancel:run"
"""The step id of a run's cancel mark (:mod:`._cancel`): stores drop it when the run ends
otherwise (docs/engine.md, "A cancel racing the run's end")."""


class RunStatus(enum.StrEnum):
    """Where a run stands."""

    PENDING = "pending"
    """Created, driven by no engine yet (``start(..., detach=True)``, or released on close)."""
    RUNNING = "running"
    """Driven by an engine (its ``owner``), under a lease."""
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    BLOCKED = "blocked"
    """Parked: its replay hit non-determinism (the code changed shape). Not over: it resumes
    when code that replays it is deployed, or on ``runs retry`` (docs/engine.md, Versioning)."""

    @property
    def terminal(self) -> bool:
        """Whether the run is over (completed, failed or cancelled)."""
        return self in _TERMINAL


_TERMINAL = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED})


OnParentCancel = Literal["cancel", "abandon"]
"""What a parent's cancellation does to a child workflow (``ctx.child(...,
on_parent_cancel=)``): cancel it (and its own children), or let it go on."""


class StepKind(enum.StrEnum):
    """What a checkpoint records."""

    REMOTE = "remote"
    """``ctx.step``: a step run by a worker through the transport."""
    LOCAL = "local"
    """``ctx.run``: a function run inside the engine, its result checkpointed."""
    TIMER = "timer"
    """``ctx.sleep``: a durable timer."""
    SIGNAL = "signal"
    """``ctx.wait_signal``: a signal consumed (its payload is the output)."""
    EVENT = "event"
    """``ctx.set_event``: an event written (its value is the input)."""

    CANCEL = "cancel"
    """The mark of a cancel delivered inside the workflow (``cancel:run``, outside the step
    numbering): an engine resuming a run that holds it settles it cancelled."""
    PATCH = "patch"
    """``ctx.patched``: a version marker, stored as ``patch:<change id>`` outside the step
    numbering (issue 18, versioning)."""

    CHILD = "child"
    """``ctx.child`` / ``ctx.start_child``: a child workflow run started (input: its run id,
    its input, ``onParentCancel``), settled with the child's output or error."""

    CONTINUE = "continue"
    """The mark that opens a generation after ``ctx.continue_as_new`` (``continue:run``,
    outside the step numbering; issue 34, item 5): its input holds the generation number, the
    last step number of the generations before it and the signals they consumed
    (:mod:`._continue`)."""


class StepState(enum.StrEnum):
    """Where a checkpoint stands."""

    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"


class Applied(enum.StrEnum):
    """What a compare-and-set on a checkpoint did (:meth:`RunStore.update_step`)."""

    APPLIED = "applied"
    """The change was written."""
    DUPLICATE = "duplicate"
    """The checkpoint had already completed or failed: nothing written."""
    STALE = "stale"
    """The checkpoint is at another attempt than the one the change was for: nothing written."""
    MISSING = "missing"
    """No such checkpoint: nothing written."""
    RUN_FINISHED = "run_finished"
    """The run is over (completed, failed, cancelled): nothing written."""


@attrs.frozen(repr=False, eq=False)
class RunRecord:
    """One workflow run, as the run store holds it."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    run_id: str
    """Unique within the store's namespace; ``engine.start(..., run_id=...)`` is idempotent."""
    workflow: str
    """The registered workflow name."""
    input: JSONValue
    """The workflow's input."""
    status: RunStatus
    created_at: float
    """Store clock (see :meth:`RunStore.now`)."""
    updated_at: float
    output: JSONValue = None
    """The workflow's return value (status ``completed``)."""
    error: JSONValue = None
    """Why it failed or was cancelled: ``{"type": ..., "message": ..., ...}``."""
    owner: str | None = None
    """The engine driving it (``engine_id``), or ``None``."""
    lease_until: float | None = None
    """Store clock time until which ``owner`` holds it; past it, any engine may take it over."""
    timeout: float | None = None
    """Seconds the run may take from its creation (``engine.start(..., timeout=)``): see
    :attr:`deadline`. ``None``: no timeout."""
    trace: JSONValue = None
    """The trace the run belongs to, ``{"traceparent", "tracestate"?}`` (W3C Trace Context),
    stored when it was started by a traced process: every engine that drives it (the first,
    and any that takes it over after a crash) opens its run span as a child of this context,
    so one run is one trace (docs/observability.md). ``None``: untraced (a damaged stored value
    reads as ``None`` too: it is advisory, see :func:`read_trace`)."""
    parent: str | None = None
    """The run that started this one as a child workflow (``ctx.child``, issue 18), or
    ``None``."""
    depth: int = 0
    """How many ancestors it has: 0 for a run started by ``engine.start``, its parent's plus
    one for a child (issue 36: a child past the engine's ``max_child_depth`` is refused)."""
    tags: dict[str, str] = attrs.field(factory=dict)
    """Its tags (``engine.start(..., tags=)``, issue 34): at most 16 ``key -> value``, indexed
    by every store (``ops.list_runs(tags=...)``); ``{}``: none. Not inherited by children."""

    @property
    def deadline(self) -> float | None:
        """Store clock time by which the run must end (``created_at + timeout``); the engine
        driving it then fails it with ``RunTimedOut``. ``None``: no timeout."""
        return None if self.timeout is None else self.created_at + self.timeout


@attrs.frozen(repr=False, eq=False)
class DamagedRun:
    """A run whose stored row cannot be read (:class:`RunDataError`), as a listing shows it:
    one damaged row is named beside the others instead of failing the whole listing."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    run_id: str
    reason: str
    """The :class:`RunDataError`'s message (which column, what is wrong with it)."""


@attrs.frozen(repr=False, eq=False)
class RunPage:
    """One page of runs (:meth:`RunStore.page_runs`), newest first."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    runs: list[RunRecord]
    next_cursor: str | None = None
    """Pass it as ``cursor`` for the next (older) page; ``None``: this is the last page. Opaque
    (see :mod:`durable_trio._engine._stores._paging`): a run created meanwhile never shifts
    the pages that follow."""
    damaged: list[DamagedRun] = attrs.field(factory=list)
    """The rows of this page's window that cannot be read (damaged data), newest first: they
    count toward the page's ``limit`` as the runs do, so paging goes on past them."""


@attrs.frozen(repr=False, eq=False)
class StepRecord:
    """One checkpoint of a run's history: a remote step, a local step or a durable timer."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    run_id: str
    step_id: str
    """Assigned at call time, in call order: ``"1"``, ``"2"``, ... (a decimal string)."""
    kind: StepKind
    name: str
    """The step's name (remote), label (local), or ``"sleep"`` (timer)."""
    status: StepState
    attempt: int = 1
    """The current attempt (1-based); a result for any other attempt is stale."""
    input: JSONValue = None
    output: JSONValue = None
    error: JSONValue = None
    """The last attempt's error, as :func:`error_to_json` writes it."""
    retry: JSONValue = None
    """The retry policy (:meth:`Retry.to_json`), so any engine can apply a result."""
    wake_at: float | None = None
    """Timer: when it fires. Pending step: when its current attempt may start (backoff)."""
    dispatched: bool = False
    """Remote step: the current attempt's task is on the broker (reconcile re-dispatches only
    attempts whose dispatch was never confirmed)."""
    priority: int | None = None
    """Remote step: the task priority (kept for re-dispatch)."""
    created_at: float = 0.0
    updated_at: float = 0.0
    duplicates: tuple[JSONValue, ...] = ()
    """Remote step: the duplicate completed results the engine met for it, each with its cause
    (:meth:`DuplicateResult.to_json <durable_trio.DuplicateResult.to_json>`), filled in by
    :meth:`Engine.history` from that engine's record (kept in its memory, not in the store)."""
    heartbeat_timeout: float | None = None
    """Remote step: seconds its attempt may go without a beat once it beat (``None``: no
    failover on beats)."""
    heartbeat: JSONValue = None
    """Remote step: its last beat, ``{"attempt", "at", "sentAt", "details"?}`` (``at`` on the
    store clock when the engine received it, ``sentAt`` the worker's Unix time), kept across
    retries (``None``: it never beat). ``"worker"``: the worker instance that sent it, when
    the worker says (see :class:`~durable_trio._wire.StepHeartbeat`)."""
    attempts: tuple[JSONValue, ...] = ()
    """The log of its ENDED attempts, oldest first, written in the same compare-and-set as the
    change that ended each one: ``{"attempt", "outcome", "startedAt", "endedAt", "worker"?,
    "error"?, "heartbeat"?}`` (see :func:`ended_attempt`). Bounded: the newest
    :data:`ATTEMPT_LOG_LIMIT` entries are kept (a step with ``max_attempts=10_000`` never
    grows a row without bound). A store that finds its stored log damaged returns one entry
    ``{"damaged": why}`` in its place (:func:`read_attempt_log`): the run still loads."""

    @property
    def idempotency_key(self) -> str:
        """``"{run_id}:{step_id}"``: stable across attempts and redeliveries."""
        return f"{self.run_id}:{self.step_id}"


#: The most ended attempts a checkpoint's log keeps (:attr:`StepRecord.attempts`).
ATTEMPT_LOG_LIMIT = 100

#: The longest error message an attempt log entry keeps (characters; the checkpoint's own
#: ``error`` keeps the last one whole).
_LOGGED_MESSAGE = 1000

#: Error codes whose attempt ended for want of time, and for want of a live claim.
_TIMED_OUT = frozenset({"StepTimedOut", "ScheduleToStartTimeout", "heartbeat_timeout"})
_STALLED = frozenset({"stalled"})


def attempt_started(record: StepRecord) -> float:
    """Store-clock time ``record``'s current attempt started, or is due to: a retry's
    ``wake_at`` (when its backoff ends, or an operator reopened it), else the checkpoint's
    creation (the first attempt is dispatched as it is created)."""
    if record.attempt > 1 and record.wake_at is not None:
        return record.wake_at
    return record.created_at


def _outcome(error: JSONValue) -> str:
    code = error.get("code") if isinstance(error, dict) else None
    if code in _TIMED_OUT:
        return "timed_out"
    if code in _STALLED:
        return "stalled"
    return "failed"


def ended_attempt(
    record: StepRecord,
    *,
    ended_at: float,
    error: JSONValue = None,
    worker: str | None = None,
    outcome: str | None = None,
    delivery: JSONValue = None,
) -> tuple[JSONValue, ...]:
    """``record.attempts`` with its current attempt appended as ended at ``ended_at``.

    Args:
        record: the checkpoint as it stood while the attempt ran.
        ended_at: store clock.
        error: the attempt's error (:func:`error_to_json`), ``None`` if it completed. The
            entry keeps its message (cut to 1,000 characters), code and retryable flag, not its
            details: the checkpoint's own ``error`` keeps the last one whole.
        worker: the worker instance that ran it (``None``: the one its last beat names, if
            any).
        outcome: ``completed``, ``failed``, ``timed_out``, ``stalled`` or ``abandoned``
            (``None``: ``completed`` without an error, else read from the error's code).
        delivery: the evidence of the claim whose result ended it (``StepResult.delivery``).
            When the broker took the task back from earlier claims (their leases lost: a
            worker blocked or stopped), the entry keeps ``"deliveries"`` (how many claims ran
            it, this one included) and ``"stalls"`` (``{"at", "worker"}`` of the newest 10),
            and ``"leaseLostAt"`` when this claim's own lease was lost while it ran: the
            attempt's re-runs are in the store, not only in the workers' logs.

    Returns:
        The new log, its newest :data:`ATTEMPT_LOG_LIMIT` entries.
    """
    beat = record.heartbeat
    beat = beat if isinstance(beat, dict) and beat.get("attempt") == record.attempt else None
    if worker is None and beat is not None and isinstance(beat.get("worker"), str):
        worker = beat["worker"]
    entry: dict[str, Any] = {
        "attempt": record.attempt,
        "outcome": outcome or ("completed" if error is None else _outcome(error)),
        "startedAt": attempt_started(record),
        "endedAt": ended_at,
    }
    if worker is not None:
        entry["worker"] = worker
    if isinstance(error, dict):
        kept = {k: error[k] for k in ("code", "retryable") if k in error}
        entry["error"] = {"message": str(error.get("message", ""))[:_LOGGED_MESSAGE], **kept}
    elif error is not None:
        entry["error"] = {"message": str(error)[:_LOGGED_MESSAGE]}
    if beat is not None:
        entry["heartbeat"] = {k: beat[k] for k in ("at", "sentAt") if k in beat}
    if isinstance(delivery, dict):
        entry.update(_redeliveries(delivery))
    return (*record.attempts, entry)[-ATTEMPT_LOG_LIMIT:]


#: The stalls an attempt log entry keeps (the newest).
_LOGGED_STALLS = 10


def _redeliveries(delivery: dict[str, Any]) -> dict[str, Any]:
    """What an attempt log entry keeps of a result's delivery evidence (see
    :func:`ended_attempt`); nothing for the usual single, unbroken claim."""
    kept: dict[str, Any] = {}
    count = delivery.get("stalledCount")
    if type(count) is int and count > 0:
        kept["deliveries"] = count + 1
        stalls = delivery.get("stalls")
        if isinstance(stalls, list):
            kept["stalls"] = [
                {k: stall[k] for k in ("at", "worker") if k in stall}
                for stall in stalls[-_LOGGED_STALLS:]
                if isinstance(stall, dict)
            ]
    lost = delivery.get("leaseLostAt")
    if isinstance(lost, int | float) and not isinstance(lost, bool):
        kept["leaseLostAt"] = lost
    return kept


def first_or_later(attempt: int) -> int:
    """A stored checkpoint's attempt, which counts from 1; one below 1 is damaged
    (``ValueError``: the row mappers make it a :class:`RunDataError`). Read as it was, every
    result came back for another attempt, stale, and the run waited for ever."""
    if attempt < 1:
        raise ValueError(f"its attempt {attempt} is below 1 (attempts count from 1)")
    return attempt


def read_attempt_log(raw: str | bytes | None) -> tuple[JSONValue, ...]:
    """A stored attempt log (JSON text; ``None`` or empty: a checkpoint written before the
    log existed). Damaged (not JSON, not a list): one ``{"damaged": why}`` entry, so the run
    still loads and runs, and ``runs show`` says what was lost."""
    if not raw:
        return ()
    try:
        log = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return ({"damaged": f"the stored attempt log is not JSON ({exc})"},)
    if not isinstance(log, list):
        return ({"damaged": f"the stored attempt log is a {type(log).__name__}, not a list"},)
    return tuple(log)


def read_trace(raw: str | bytes | None) -> JSONValue:
    """A stored run trace context (JSON text, see :attr:`RunRecord.trace`). ``None`` when
    absent (a run stored before traces, or untraced) or damaged (not JSON, not of the shape
    ``{"traceparent": str, "tracestate"?: str}``): a trace is advisory, and a run whose trace
    cannot be read is driven as usual, in a new trace."""
    if not raw:
        return None
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("traceparent"), str):
        return None
    state = value.get("tracestate")
    out: dict[str, Any] = {"traceparent": value["traceparent"]}
    if isinstance(state, str):
        out["tracestate"] = state
    return out


def previous_details(record: StepRecord) -> JSONValue:
    """The details of an earlier attempt's last beat (``record.heartbeat``), for the task of
    the current attempt (``None``: the current attempt's own beat, or none)."""
    beat = record.heartbeat
    attempt = beat.get("attempt") if isinstance(beat, dict) else None
    if isinstance(attempt, int) and attempt < record.attempt:
        return beat.get("details")
    return None


def patch_marker(run_id: str, change_id: str) -> StepRecord:
    """The checkpoint ``ctx.patched(change_id)`` records: ``patch:<change id>``, completed,
    outside the step numbering."""
    return StepRecord(
        run_id=run_id,
        step_id=f"patch:{change_id}",
        kind=StepKind.PATCH,
        name=change_id,
        status=StepState.COMPLETED,
    )


def step_position(step_id: str) -> int:
    """The order of ``step_id`` in a history: its number (0 for an id that is not a number)."""
    return int(step_id) if step_id.isdigit() else 0


def normalize_json(value: Any, what: str = "value") -> JSONValue:
    """``value`` as it reads back from a store (tuples become lists), so a live run and its
    replay see exactly the same values.

    Raises:
        PayloadError: ``value`` is not a JSON value (NaN, a set, a datetime, nested deeper than
            ``MAX_JSON_DEPTH``, ...); ``path`` names where (``$.a[3]``).
    """
    check_json(value, what)
    try:
        return orjson.loads(orjson.dumps(value))
    except TypeError as exc:  # what the walk leaves to orjson: a string with a lone surrogate
        error = json_error(value, what) or PayloadError(f"{what} is not JSON-serialisable: {exc}")
        raise error from None


def error_to_json(error: StepError) -> dict[str, Any]:
    """A :class:`StepError` as a checkpoint stores it."""
    out: dict[str, Any] = {"message": error.message, "retryable": error.retryable}
    if error.code is not None:
        out["code"] = error.code
    if error.details is not None:
        out["details"] = error.details
    return out


def error_from_json(data: Any) -> StepError:
    """The inverse of :func:`error_to_json` (tolerant of missing fields)."""
    if not isinstance(data, dict):
        return StepError(message=str(data) if data is not None else "failed", retryable=True)
    code = data.get("code")
    return StepError(
        message=str(data.get("message", "failed")),
        code=code if isinstance(code, str) else None,
        retryable=data.get("retryable", True) is not False,
        details=data.get("details"),
    )


def step_to_json(record: StepRecord) -> dict[str, Any]:
    """A checkpoint as a remote workflow turn receives it in ``WorkflowTask.history``:
    ``{stepId, kind, name, status, attempt}`` plus ``output`` / ``error`` / ``wakeAt`` when set.
    """
    out: dict[str, Any] = {
        "stepId": record.step_id,
        "kind": record.kind.value,
        "name": record.name,
        "status": record.status.value,
        "attempt": record.attempt,
    }
    if record.output is not None:
        out["output"] = record.output
    if record.error is not None:
        out["error"] = record.error
    if record.wake_at is not None:
        out["wakeAt"] = record.wake_at
    return out


def step_from_json(run_id: str, data: Any) -> StepRecord:
    """The inverse of :func:`step_to_json`.

    Raises:
        PayloadError: ``data`` is not a checkpoint.
    """
    try:
        wake_at = data.get("wakeAt")
        return StepRecord(
            run_id=run_id,
            step_id=str(data["stepId"]),
            kind=StepKind(data["kind"]),
            name=str(data["name"]),
            status=StepState(data["status"]),
            attempt=int(data.get("attempt", 1)),
            output=data.get("output"),
            error=data.get("error"),
            wake_at=float(wake_at) if wake_at is not None else None,
        )
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise PayloadError(f"a history entry is not a checkpoint ({exc!r}): {data!r}") from None


@attrs.frozen(repr=False, eq=False)
class RunState:
    """A run's status with its latest events: ``engine.status(run_id, events=True)``."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    run_id: str
    status: RunStatus
    events: dict[str, Any] = attrs.field(factory=dict)
    """Every latest ``ctx.set_event`` value, by key (decoded)."""
