"""The ONE module that owns the JSON mapping of the wire protocol (cattrs + orjson).

- camelCase on the wire, snake_case in Python (one hook factory per direction,
``override(rename)``);
- optional fields (default ``None``) are omitted when unset; unknown keys are tolerated, so a newer
  peer may add fields without breaking an older one;
- scalars are strict: ``"5"`` is not an int, ``1.9`` is not an int, ``true`` is not an int (cattrs
  coerces silently by default) — and the error names the field (``$.attempt``);
- the JSON values a message carries (inputs, outputs, history, details, ...) are checked, not
  converted: cattrs hands them through untouched, and one iterative walk
  (:mod:`durable_trio._json_values`) refuses NaN, non-JSON types and anything nested deeper than
  :data:`MAX_JSON_DEPTH`, naming the path (``$.output.a[3]``), before ``orjson`` writes them.
"""

from __future__ import annotations

import enum
import functools
import math
import types
import typing
from typing import Any, TypeVar

import attrs
import orjson

from ._errors import PayloadError, PayloadTooLarge
from ._json_values import MAX_JSON_DEPTH, is_json, json_error, read_within
from ._wire import (
    ControlMessage,
    DecisionStatus,
    Envelope,
    InboxRegistration,
    JobKind,
    RemoteTask,
    RunReply,
    RunRequest,
    StartRunMessage,
    StepError,
    StepEvent,
    StepEventKind,
    StepHeartbeat,
    StepResult,
    StepStatus,
    TenantEvent,
    TraceContext,
    WorkerAdvertisement,
    WorkerStatus,
    WorkflowDecision,
    WorkflowTask,
)
from ._wire import _new_id as _new_task_id

if typing.TYPE_CHECKING:
    from collections.abc import Callable

    import cattrs

__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "MAX_JSON_DEPTH",
    "MESSAGE_TYPES",
    "PAYLOAD_TYPES",
    "converter",
    "decode_envelope",
    "dumps",
    "encode_envelope",
    "encode_result",
    "from_wire",
    "json_schema",
    "loads",
    "to_wire",
]

T = TypeVar("T")

#: Payloads above this are refused at dispatch and failed (not parsed) when found on a queue.
DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024

#: Which message class each job kind carries.
PAYLOAD_TYPES: dict[JobKind, type[Any]] = {
    JobKind.TASK: RemoteTask,
    JobKind.WORKFLOW: WorkflowTask,
    JobKind.RESULT: StepResult,
    JobKind.HEARTBEAT: StepHeartbeat,
    JobKind.CONTROL: ControlMessage,
    JobKind.DECISION: WorkflowDecision,
    JobKind.STEP_EVENT: StepEvent,
    JobKind.START_RUN: StartRunMessage,
    JobKind.RUN_REQUEST: RunRequest,
    JobKind.RUN_REPLY: RunReply,
    JobKind.TENANT_EVENT: TenantEvent,
    JobKind.INBOX_REGISTRATION: InboxRegistration,
    JobKind.ADVERTISEMENT: WorkerAdvertisement,
}

#: Every wire message type (for schemas and round-trip tests).
MESSAGE_TYPES: tuple[type[Any], ...] = (
    RemoteTask,
    StepResult,
    StepError,
    StepHeartbeat,
    ControlMessage,
    WorkflowTask,
    WorkflowDecision,
    StepEvent,
    StartRunMessage,
    RunRequest,
    RunReply,
    TenantEvent,
    InboxRegistration,
    WorkerAdvertisement,
    WorkerStatus,
    Envelope,
)


def camel(name: str) -> str:
    """``run_id`` -> ``runId``; ``p95_ms`` -> ``p95Ms``."""
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _strict_int(value: Any, _: type) -> int:
    if type(value) is not int:
        raise TypeError(f"expected an integer, got {type(value).__name__} {value!r:.40}")
    return value


def _strict_float(value: Any, _: type) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    raise TypeError(f"expected a number, got {type(value).__name__} {value!r:.40}")


def _strict_str(value: Any, _: type) -> str:
    if type(value) is not str:
        raise TypeError(f"expected a string, got {type(value).__name__} {value!r:.40}")
    return value


def _strict_bool(value: Any, _: type) -> bool:
    if type(value) is not bool:
        raise TypeError(f"expected a boolean, got {type(value).__name__} {value!r:.40}")
    return value


def _any(value: Any, _: type) -> Any:
    return value


def _as_is(value: Any) -> Any:
    return value


def _carries_json(tp: Any) -> bool:
    """A field typed ``JSONValue`` or ``tuple[JSONValue, ...]``."""
    return tp is Any or (typing.get_origin(tp) is tuple and typing.get_args(tp)[0] is Any)


def _is_json_tuple(cls: Any) -> bool:
    return typing.get_origin(cls) is tuple


def _make_tuple_hook(cls: Any, conv: cattrs.Converter) -> Callable[[Any, type], tuple[Any, ...]]:
    (item_type, _ellipsis) = typing.get_args(cls)

    def structure(value: Any, _: type) -> tuple[Any, ...]:
        if type(value) is not list:
            raise TypeError(f"expected an array, got {type(value).__name__}")
        if item_type is Any:
            return tuple(value)
        return tuple(conv.structure(item, item_type) for item in value)

    return structure


def _enum_hook(value: Any, cls: type[enum.Enum]) -> enum.Enum:
    if type(value) is not str:
        raise TypeError(f"expected one of {[m.value for m in cls]}, got {value!r:.40}")
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"expected one of {[m.value for m in cls]}, got {value!r:.40}") from None


def _build_converter(*, detailed: bool = True) -> cattrs.Converter:
    import cattrs
    from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

    conv = cattrs.Converter(detailed_validation=detailed)
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(Any, _any)
    # Each enum by name: a StrEnum is a str subclass, so singledispatch would hand it the str hook.
    for enum_type in (JobKind, StepStatus, DecisionStatus, StepEventKind):
        conv.register_structure_hook(enum_type, _enum_hook)
    conv.register_structure_hook_factory(_is_json_tuple, lambda cls: _make_tuple_hook(cls, conv))

    def structure_factory(cls: type[Any]) -> Callable[[Any, type], Any]:
        overrides: dict[str, Any] = {
            f.name: override(rename=camel(f.name)) for f in attrs.fields(cls)
        }
        inner = make_dict_structure_fn(cls, conv, _cattrs_forbid_extra_keys=False, **overrides)

        def structure(value: Any, target: type) -> Any:
            if type(value) is not dict:
                raise TypeError(f"expected an object, got {type(value).__name__}")
            return inner(value, target)

        return structure

    def unstructure_factory(cls: type[Any]) -> Callable[[Any], Any]:
        hints = typing.get_type_hints(cls)
        overrides: dict[str, Any] = {
            f.name: override(
                rename=camel(f.name),
                omit_if_default=f.default is None,
                # A JSON value is handed through as it is: cattrs would copy it recursively
                # (and hit the recursion limit on a deep one); the field walk checks it instead.
                unstruct_hook=_as_is if _carries_json(hints[f.name]) else None,
            )
            for f in attrs.fields(cls)
        }
        return make_dict_unstructure_fn(cls, conv, **overrides)

    conv.register_structure_hook_factory(attrs.has, structure_factory)
    conv.register_unstructure_hook_factory(attrs.has, unstructure_factory)
    return conv


@functools.cache
def _converter() -> cattrs.Converter:
    """The converter that owns the mapping; its errors name the field that was wrong.

    Built on first use, as is :func:`_fast` (cattrs, and the converters' set-up, are about a
    tenth of a worker's imports: a process pays them with its first message, not at ``import``).
    """
    return _build_converter()


@functools.cache
def _fast() -> cattrs.Converter:
    """The same mapping without detailed validation, for the hot path: it skips the bookkeeping
    that names a failing field, so it is only ever used to accept good data — a failure is re-run
    through :func:`_converter` for its message."""
    return _build_converter(detailed=False)


if typing.TYPE_CHECKING:
    #: The converter that owns the mapping (built on first use, see :func:`_converter`).
    converter: cattrs.Converter
else:

    def __getattr__(name: str) -> Any:
        if name == "converter":
            return _converter()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The fields that carry a value of a user's own (an input, an output, an error's details): they
#: obey :data:`MAX_JSON_DEPTH` exactly, as the engine's checkpoints do.
_VALUE_FIELDS = frozenset({"input", "output", "details"})
#: The protocol's other JSON fields (``history``, ``commands``, ``data``, ``value``) wrap such
#: values in records of their own (a history entry, a reply's run view, a list of those): a few
#: levels more, so a value that was accepted once still fits wherever it is carried later.
_WRAPPING_DEPTH = 8

#: Per message type, its JSON fields: (wire name, deepest nesting allowed, the fields of a
#: nested message field such as ``error``, else ``None``).
_JsonFields = tuple[tuple[str, int, "_JsonFields | None"], ...]


def _json_fields(cls: type[Any]) -> _JsonFields:
    hints = typing.get_type_hints(cls)
    out: list[tuple[str, int, _JsonFields | None]] = []
    for field in attrs.fields(cls):
        tp = hints[field.name]
        if _carries_json(tp):
            depth = MAX_JSON_DEPTH
            if field.name not in _VALUE_FIELDS:
                depth += _WRAPPING_DEPTH
            out.append((camel(field.name), depth, None))
            continue
        nested = [a for a in typing.get_args(tp) if attrs.has(a)]
        if attrs.has(tp):
            nested = [tp]
        if nested and (inner := _json_fields(nested[0])):
            out.append((camel(field.name), 0, inner))
    return tuple(out)


#: The JSON fields of each message type, worked out on first use (an import builds nothing: a
#: process pays for the types it sends and receives).
_JSON_FIELDS: dict[type[Any], _JsonFields] = {}
_MESSAGE_CLASSES = frozenset(MESSAGE_TYPES)


def _message_fields(cls: type[Any]) -> _JsonFields | None:
    """The JSON fields of a wire message type (``None`` for any other class)."""
    fields = _JSON_FIELDS.get(cls)
    if fields is None and cls in _MESSAGE_CLASSES:
        fields = _JSON_FIELDS[cls] = _json_fields(cls)
    return fields


#: The deepest a wire message's JSON may nest below its payload: what the fields allow, plus the
#: message objects around them (the payload, an ``error``).
_MESSAGE_DEPTH = MAX_JSON_DEPTH + _WRAPPING_DEPTH + 2


def _offender(
    wire: Any,
    fields: _JsonFields,
    fits: Callable[[Any, int], bool] = is_json,
    prefix: str = "$",
) -> tuple[Any, str, int] | None:
    """The first JSON field of ``wire`` (a message as plain data) whose value ``fits`` refuses
    at its depth limit: (the value, its path, the limit); ``None`` when all fit."""
    for name, max_depth, nested in fields:
        value = wire.get(name)
        if value is None:
            continue
        if nested is not None:
            if type(value) is dict:
                found = _offender(value, nested, fits, f"{prefix}.{name}")
                if found is not None:
                    return found
        elif not fits(value, max_depth):
            return value, f"{prefix}.{name}", max_depth
    return None


def _refusal(what: str, offender: tuple[Any, str, int]) -> PayloadError:
    value, where, max_depth = offender
    return json_error(value, what, where, max_depth) or PayloadError(
        f"{what} is not JSON-serialisable at {where}", path=where
    )


def _explained(what: str, wire: Any, fields: _JsonFields | None) -> PayloadError | None:
    """Which JSON field holds what orjson refused although the walk passed it (a string with a
    lone surrogate): the slow walk, field by field; ``None`` when it is none of them."""
    if fields is None:
        return json_error(wire, what, "$", _MESSAGE_DEPTH)
    found = _offender(wire, fields, lambda value, depth: json_error(value, "", "$", depth) is None)
    return _refusal(what, found) if found is not None else None


#: Past this size a job almost always holds more brackets than MAX_JSON_DEPTH, so counting them
#: would only add a pass: its depth is measured straight away.
_COUNT_BELOW = 16 * 1024

_KINDS = {kind.value: kind for kind in JobKind}
#: The hot path's structure hooks, looked up once per kind rather than once per job; each
#: generated on first use (cattrs compiles a function per class: a worker that only takes tasks
#: and sends results makes those two, not all thirteen, before its first job).
_FAST_STRUCTURE: dict[JobKind, Callable[[Any, type], Any]] = {}
_UNSTRUCTURE: dict[type[Any], Callable[[Any], Any]] = {}
_PAYLOAD_CLASSES = frozenset(PAYLOAD_TYPES.values())


def _fast_structure(kind: JobKind) -> Callable[[Any, type], Any]:
    hook = _FAST_STRUCTURE[kind] = _fast().get_structure_hook(PAYLOAD_TYPES[kind])
    return hook


#: How an encoding error names what it refused (built once: the hot path formats no string).
_WHAT = {kind: f"{kind.value} payload" for kind in JobKind}


def _format_exception(exc: BaseException, _type: Any) -> str:
    if isinstance(exc, KeyError):
        return "required field missing"
    return str(exc)


def _payload_error(exc: Exception, what: str) -> PayloadError:
    import cattrs  # (loaded by then: the converter that raised imported it)

    if isinstance(exc, cattrs.BaseValidationError):
        messages = cattrs.transform_error(exc, path="$", format_exception=_format_exception)
        first = messages[0] if messages else str(exc)
        # cattrs names Python attributes in its paths; the wire names are camelCase.
        messages = [
            f"{text} @ {'.'.join(camel(part) for part in where.split('.'))}" if where else text
            for text, _, where in (m.partition(" @ ") for m in messages)
        ]
        first = messages[0] if messages else str(exc)
        path = first.rsplit(" @ ", 1)[1] if " @ " in first else None
        return PayloadError(f"bad {what}: " + "; ".join(messages), path=path)
    return PayloadError(f"bad {what}: {exc}")


def to_wire(message: Any) -> Any:
    """A message as plain JSON-ready data (camelCase keys)."""
    return _converter().unstructure(message)


def from_wire(data: Any, cls: type[T]) -> T:
    """Build a ``cls`` from plain JSON data.

    Raises:
        PayloadError: the data does not fit ``cls``, or one of its JSON fields nests too deep;
            the message names the field.
    """
    fields = _message_fields(cls)
    if fields and type(data) is dict:
        offender = _offender(data, fields)
        if offender is not None:
            raise _refusal(f"bad {cls.__name__}", offender)
    try:
        return _fast().structure(data, cls)
    except Exception:
        pass
    try:
        return _converter().structure(data, cls)
    except Exception as exc:
        raise _payload_error(exc, cls.__name__) from exc


def _fields_of(cls: type[Any]) -> _JsonFields | None:
    """The JSON fields of a message class (``None``: not a message but plain data)."""
    fields = _message_fields(cls)
    if fields is None and attrs.has(cls):
        fields = _json_fields(cls)
    return fields


def _wire_of(message: Any, what: str) -> Any:
    """``message`` as plain data, its JSON fields checked (see :func:`encode_envelope`)."""
    fields = _fields_of(type(message))
    if fields is None:  # plain data: handed through as it is, never unstructured (recursion)
        if not is_json(message, _MESSAGE_DEPTH):
            raise _refusal(what, (message, "$", _MESSAGE_DEPTH))
        return message
    cls = type(message)
    unstructure = _UNSTRUCTURE.get(cls)
    if unstructure is None and cls in _PAYLOAD_CLASSES:
        unstructure = _UNSTRUCTURE[cls] = _converter().get_unstructure_hook(cls)
    try:
        wire = unstructure(message) if unstructure is not None else to_wire(message)
    except Exception as exc:
        # A value whose own code raises when it is looked at (cattrs compares each optional
        # field with its default): refused like any other value that is not JSON.
        raise PayloadError(f"{what} is not JSON-serialisable: {exc!r}") from exc
    if fields:
        offender = _offender(wire, fields)
        if offender is not None:
            raise _refusal(what, offender)
    return wire


def _dumps(body: Any, wire: Any, message: Any, what: str) -> bytes:
    try:
        return orjson.dumps(body)
    except TypeError as exc:
        error = _explained(what, wire, _fields_of(type(message)))
        raise error or PayloadError(f"{what} is not JSON-serialisable: {exc}") from exc


def dumps(message: Any) -> bytes:
    """Encode one message (or plain JSON data) to JSON bytes.

    Raises:
        PayloadError: it holds something that is not a JSON value (see :func:`encode_envelope`).
    """
    wire = _wire_of(message, "the message")
    return _dumps(wire, wire, message, "the message")


def loads(data: bytes | str, cls: type[T]) -> T:
    """Decode JSON bytes into a ``cls``.

    Raises:
        PayloadError: not JSON, JSON of the wrong shape, or nested too deep.
    """
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise PayloadError(f"not JSON: {exc}") from exc
    return from_wire(raw, cls)


def encode_envelope(
    job_id: str,
    kind: JobKind,
    payload: Any,
    priority: int | None = None,
    max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    trace: TraceContext | None = None,
) -> bytes:
    """Encode a job envelope ``{id, kind, payload, priority?, trace?}`` (``trace``: the
    sender's trace context, written only when given).

    The payload's JSON fields are checked first, in one iterative walk: an ``input``, an
    ``output`` or an error's ``details`` nests at most :data:`MAX_JSON_DEPTH` levels, the
    protocol's wrapping fields (``history``, ``commands``, ``data``, ``value``) a few more; NaN,
    the infinities, non-string keys and values of other types are refused, never written as
    ``null`` or converted.

    Raises:
        PayloadTooLarge: the encoded job is over ``max_bytes``.
        PayloadError: the payload is not JSON-serialisable; ``path`` names where
            (``$.output.a[3]``).
    """
    what = _WHAT[kind]
    wire = _wire_of(payload, what)
    body: dict[str, Any] = {"id": job_id, "kind": kind.value, "payload": wire}
    if priority is not None:
        body["priority"] = priority
    if trace is not None:
        body["trace"] = _trace_to_wire(trace)
    data = _dumps(body, wire, payload, what)
    if len(data) > max_bytes:
        raise PayloadTooLarge(
            f"{kind.value} payload is {len(data)} bytes, over max_payload_bytes={max_bytes}"
        )
    return data


def decode_envelope(data: bytes, *, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> Envelope:
    """Decode a job envelope and its payload into the message class its kind names.

    Raises:
        PayloadTooLarge: over ``max_bytes`` (not parsed at all).
        PayloadError: not JSON, the wrong shape, an unknown kind, or a JSON field nested deeper
            than :func:`encode_envelope` writes.
    """
    if len(data) > max_bytes:
        raise PayloadTooLarge(f"job is {len(data)} bytes, over max_payload_bytes={max_bytes}")
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise PayloadError(f"job is not JSON: {exc}") from exc
    if type(raw) is not dict:
        raise PayloadError(f"job is not an object but {type(raw).__name__}", path="$")
    kind_value = raw.get("kind")
    kind = _KINDS.get(kind_value) if type(kind_value) is str else None
    if kind is None:
        raise PayloadError(f"unknown job kind {kind_value!r:.60}", path="$.kind")
    job_id = raw.get("id")
    if type(job_id) is not str:
        raise PayloadError("job id is missing or not a string", path="$.id")
    priority = raw.get("priority")
    if priority is not None and type(priority) is not int:
        raise PayloadError("job priority is not an integer", path="$.priority")
    data_payload = raw.get("payload")
    # JSON text holds no NaN, no foreign type and no non-string key, so only depth can be wrong
    # (orjson reads 1,024 levels). A value cannot nest deeper than the job has brackets, open and
    # closed: most jobs are too short to need even the count, and a long one is measured at once.
    size = len(data)
    if (
        size > 2 * MAX_JSON_DEPTH
        and type(data_payload) is dict
        and (size > _COUNT_BELOW or data.count(b"[") + data.count(b"{") > MAX_JSON_DEPTH)
    ):
        offender = _offender(data_payload, _message_fields(PAYLOAD_TYPES[kind]) or (), read_within)
        if offender is not None:
            raise _refusal(f"{kind.value} job", offender)
    payload = _task_of(data_payload) if kind is _TASK and type(data_payload) is dict else None
    if payload is None:
        try:
            structure = _FAST_STRUCTURE.get(kind) or _fast_structure(kind)
            payload = structure(data_payload, PAYLOAD_TYPES[kind])
        except Exception:
            payload = from_wire(data_payload, PAYLOAD_TYPES[kind])  # raises, naming the field
    trace = raw.get("trace")
    return Envelope(
        job_id, kind, payload, priority, None if trace is None else _trace_from_wire(trace)
    )


_TASK = JobKind.TASK
_NONE = type(None)
#: The types each optional field of a task takes as it is (or ``None``): what the converter
#: accepts without converting it.
_OPTIONAL_INT = (int, _NONE)
_OPTIONAL_STR = (str, _NONE)


def _seconds(value: Any) -> Any:
    """A ``float | None`` field as the converter makes it (an int becomes a float); ``...``
    when the converter would refuse it."""
    kind = type(value)
    if kind is float or value is None:
        return value
    if kind is int:
        return float(value)
    return ...


def _task_of(wire: dict[str, Any]) -> RemoteTask | None:
    """A task's payload as :class:`RemoteTask`, read by hand: the hot path of every step a
    worker takes, and exactly what the converter makes of it (a test holds them equal).
    ``None``: a field of a type the converter would convert or refuse; it decides then."""
    run_id = wire.get("runId")
    step_id = wire.get("stepId")
    attempt = wire.get("attempt")
    name = wire.get("name")
    task_id = wire.get("taskId")
    if (
        type(run_id) is not str
        or type(step_id) is not str
        or type(attempt) is not int
        or type(name) is not str
    ):
        return None
    if type(task_id) is str:
        if len(wire) == 5:  # those five fields and no other: every optional one at its default
            return RemoteTask(
                run_id, step_id, attempt, name, None, None, None, None, task_id, None, None,
                None, None,
            )  # fmt: skip
    elif "taskId" in wire:
        return None
    group = wire.get("group")
    priority = wire.get("priority")
    max_attempts = wire.get("maxAttempts")
    if (
        type(group) not in _OPTIONAL_STR
        or type(priority) not in _OPTIONAL_INT
        or type(max_attempts) not in _OPTIONAL_INT
    ):
        return None
    deadline = _seconds(wire.get("deadline"))
    timeout = _seconds(wire.get("timeout"))
    heartbeat_timeout = _seconds(wire.get("heartbeatTimeout"))
    if deadline is ... or timeout is ... or heartbeat_timeout is ...:
        return None
    if task_id is None:
        task_id = _new_task_id()  # the field's own default
    return RemoteTask(
        run_id, step_id, attempt, name, wire.get("input"), group, priority, deadline, task_id,
        timeout, heartbeat_timeout, wire.get("lastHeartbeat"), max_attempts,
    )  # fmt: skip


def encode_result(
    job_id: str,
    task: RemoteTask,
    output: Any,
    delivery: dict[str, Any],
    max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    trace: TraceContext | None = None,
) -> bytes | None:
    """The envelope of a completed step's result, written without building the
    :class:`StepResult`: the same bytes as :func:`encode_envelope` writes for
    ``StepResult(task.run_id, task.step_id, task.attempt, COMPLETED, output=output,
    task_id=task.task_id, delivery=delivery)`` (a test holds them equal). ``None`` when that
    call would refuse it, or might: the caller makes it then, for its error."""
    if output is not None and not is_json(output, MAX_JSON_DEPTH):
        return None
    # The evidence the job runner writes: four plain fields (checked in full when there are
    # more, a stall history or a lost lease's time).
    stalled = delivery.get("stalledCount")
    if (
        len(delivery) != 4
        or type(delivery.get("worker")) is not str
        or type(delivery.get("job")) is not str
        or type(delivery.get("lease")) is not str
        or type(stalled) is not int
        or not 0 <= stalled < 2**63
    ) and not is_json(delivery, MAX_JSON_DEPTH + _WRAPPING_DEPTH):
        return None
    wire: dict[str, Any] = {
        "runId": task.run_id,
        "stepId": task.step_id,
        "attempt": task.attempt,
        "status": "completed",
    }
    if output is not None:
        wire["output"] = output
    if task.task_id is not None:
        wire["taskId"] = task.task_id
    wire["delivery"] = delivery
    body: dict[str, Any] = {"id": job_id, "kind": "result", "payload": wire}
    if trace is not None:
        body["trace"] = _trace_to_wire(trace)
    try:
        data = orjson.dumps(body)
    except TypeError:
        return None
    return data if len(data) <= max_bytes else None


def _trace_to_wire(trace: TraceContext) -> dict[str, Any]:
    wire: dict[str, Any] = {"traceparent": trace.traceparent}
    if trace.tracestate is not None:
        wire["tracestate"] = trace.tracestate
    if trace.sent_at is not None:
        wire["sentAt"] = trace.sent_at
    return wire


def _trace_from_wire(raw: Any) -> TraceContext | None:
    """An envelope's ``trace``, or ``None`` when it is not of the documented shape: tracing is
    best-effort, so a foreign producer's odd trace context is dropped, never a reason to refuse
    the job."""
    if type(raw) is not dict:
        return None
    traceparent = raw.get("traceparent")
    if type(traceparent) is not str or len(traceparent) > 256:
        return None
    tracestate = raw.get("tracestate")
    if type(tracestate) is not str or len(tracestate) > 1024:
        tracestate = None
    sent: Any = raw.get("sentAt")
    sent_at = float(sent) if type(sent) in (int, float) and math.isfinite(sent) else None
    return TraceContext(traceparent, tracestate, sent_at)


# --- JSON Schema ------------------------------------------------------------------------------


def _schema_of(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    if tp is Any:
        return {}
    if tp is str:
        return {"type": "string"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = _schema_of(options[0], defs) if len(options) == 1 else {}
        return {"anyOf": [inner, {"type": "null"}]}
    if origin is tuple:
        return {"type": "array", "items": _schema_of(typing.get_args(tp)[0], defs)}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"type": "string", "enum": [m.value for m in tp]}
    if attrs.has(tp):
        if tp.__name__ not in defs:
            defs[tp.__name__] = {}
            defs[tp.__name__] = _object_schema(tp, defs)
        return {"$ref": f"#/$defs/{tp.__name__}"}
    raise TypeError(f"no JSON Schema for {tp!r}")


def _object_schema(cls: type[Any], defs: dict[str, Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for field in attrs.fields(cls):
        prop = _schema_of(hints[field.name], defs)
        if field.default is attrs.NOTHING:
            required.append(camel(field.name))
        properties[camel(field.name)] = prop
    schema: dict[str, Any] = {
        "type": "object",
        "title": cls.__name__,
        "properties": properties,
        "additionalProperties": True,
    }
    if cls.__doc__:
        schema["description"] = cls.__doc__.strip().splitlines()[0]
    if required:
        schema["required"] = required
    return schema


def json_schema(cls: type[Any]) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of one wire message type."""
    defs: dict[str, Any] = {}
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"durable_trio/{cls.__name__}.json",
        **_object_schema(cls, defs),
    }
    defs.pop(cls.__name__, None)
    if defs:
        schema["$defs"] = defs
    return schema
