"""The ONE module that owns the JSON mapping of the wire protocol (cattrs + orjson).

- camelCase on the wire, snake_case in Python (one hook factory per direction,
``override(rename)``);
- optional fields (default ``None``) are omitted when unset; unknown keys are tolerated, so a newer
  peer may add fields without breaking an older one;
- scalars are strict: ``"5"`` is not an int, ``1.9`` is not an int, ``true`` is not an int (cattrs
  coerces silently by default) — and the error names the field (``$.attempt``).
"""

from __future__ import annotations

import enum
import types
import typing
from typing import Any, TypeVar

import attrs
import cattrs
import orjson
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from ._errors import PayloadError, PayloadTooLarge
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
    WorkerAdvertisement,
    WorkerStatus,
    WorkflowDecision,
    WorkflowTask,
)

if typing.TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "MESSAGE_TYPES",
    "PAYLOAD_TYPES",
    "converter",
    "decode_envelope",
    "dumps",
    "encode_envelope",
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
        overrides: dict[str, Any] = {
            f.name: override(rename=camel(f.name), omit_if_default=f.default is None)
            for f in attrs.fields(cls)
        }
        return make_dict_unstructure_fn(cls, conv, **overrides)

    conv.register_structure_hook_factory(attrs.has, structure_factory)
    conv.register_unstructure_hook_factory(attrs.has, unstructure_factory)
    return conv


#: The converter that owns the mapping; its errors name the field that was wrong.
converter = _build_converter()
#: The same mapping without detailed validation: about twice as fast on the hot path, and only
#: ever used to accept good data — a failure is re-run through ``converter`` for its message.
_fast = _build_converter(detailed=False)


_KINDS = {kind.value: kind for kind in JobKind}
#: The hot path's structure hooks, looked up once per kind rather than once per job.
_FAST_STRUCTURE = {kind: _fast.get_structure_hook(cls) for kind, cls in PAYLOAD_TYPES.items()}
_UNSTRUCTURE = {cls: converter.get_unstructure_hook(cls) for cls in PAYLOAD_TYPES.values()}


def _format_exception(exc: BaseException, _type: Any) -> str:
    if isinstance(exc, KeyError):
        return "required field missing"
    return str(exc)


def _payload_error(exc: Exception, what: str) -> PayloadError:
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
    return converter.unstructure(message)


def from_wire(data: Any, cls: type[T]) -> T:
    """Build a ``cls`` from plain JSON data.

    Raises:
        PayloadError: the data does not fit ``cls``; the message names the field.
    """
    try:
        return _fast.structure(data, cls)
    except Exception:
        pass
    try:
        return converter.structure(data, cls)
    except Exception as exc:
        raise _payload_error(exc, cls.__name__) from exc


def dumps(message: Any) -> bytes:
    """Encode one message (or plain JSON data) to JSON bytes."""
    return orjson.dumps(converter.unstructure(message))


def loads(data: bytes | str, cls: type[T]) -> T:
    """Decode JSON bytes into a ``cls``.

    Raises:
        PayloadError: not JSON, or JSON of the wrong shape.
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
) -> bytes:
    """Encode a job envelope ``{id, kind, payload, priority?}``.

    Raises:
        PayloadTooLarge: the encoded job is over ``max_bytes``.
        PayloadError: the payload is not JSON-serialisable.
    """
    unstructure = _UNSTRUCTURE.get(type(payload))
    wire = unstructure(payload) if unstructure is not None else to_wire(payload)
    body: dict[str, Any] = {"id": job_id, "kind": kind.value, "payload": wire}
    if priority is not None:
        body["priority"] = priority
    try:
        data = orjson.dumps(body)
    except TypeError as exc:
        raise PayloadError(f"{kind.value} payload is not JSON-serialisable: {exc}") from exc
    if len(data) > max_bytes:
        raise PayloadTooLarge(
            f"{kind.value} payload is {len(data)} bytes, over max_payload_bytes={max_bytes}"
        )
    return data


def decode_envelope(data: bytes, *, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> Envelope:
    """Decode a job envelope and its payload into the message class its kind names.

    Raises:
        PayloadTooLarge: over ``max_bytes`` (not parsed at all).
        PayloadError: not JSON, the wrong shape, or an unknown kind.
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
    try:
        payload = _FAST_STRUCTURE[kind](data_payload, PAYLOAD_TYPES[kind])
    except Exception:
        payload = from_wire(data_payload, PAYLOAD_TYPES[kind])  # raises, naming the field
    return Envelope(id=job_id, kind=kind, payload=payload, priority=priority)


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
