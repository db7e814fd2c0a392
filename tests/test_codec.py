"""The wire protocol's JSON mapping (docs/protocol.md): round trips, camelCase, strictness,
schemas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import hypothesis.strategies as st
import orjson
import pytest
from hypothesis import given

import durable_trio as dt
from durable_trio._codec import (
    MESSAGE_TYPES,
    camel,
    decode_envelope,
    dumps,
    encode_envelope,
    from_wire,
    json_schema,
    loads,
    to_wire,
)
from durable_trio.testing.strategies import message_of

SCHEMAS = Path(__file__).parent.parent / "docs" / "schemas"


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
@given(data=st.data())
def test_every_message_round_trips(cls: type[Any], data: st.DataObject) -> None:
    message = data.draw(message_of(cls))
    assert loads(dumps(message), cls) == message


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
@given(data=st.data())
def test_wire_keys_are_camel_case_and_unset_optionals_omitted(
    cls: type[Any], data: st.DataObject
) -> None:
    message = data.draw(message_of(cls))
    wire = to_wire(message)
    expected = {
        camel(f.name)
        for f in attrs.fields(cls)
        if not (f.default is None and getattr(message, f.name) is None)
    }
    assert set(wire) == expected


def test_unknown_keys_are_tolerated() -> None:
    raw = {"runId": "r", "stepId": "s", "attempt": 1, "name": "x", "taskId": "t", "newField": 3}
    assert from_wire(raw, dt.RemoteTask).task_id == "t"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("attempt", "5", "expected an integer, got str"),
        ("attempt", 1.9, "expected an integer, got float"),
        ("attempt", True, "expected an integer, got bool"),
        ("runId", 5, "expected a string, got int"),
        ("deadline", "soon", "expected a number, got str"),
        ("deadline", False, "expected a number, got bool"),
    ],
)
def test_scalars_are_strict_and_the_error_names_the_field(
    field: str, value: Any, message: str
) -> None:
    raw: dict[str, Any] = {"runId": "r", "stepId": "s", "attempt": 1, "name": "x", "taskId": "t"}
    raw[field] = value
    with pytest.raises(dt.PayloadError, match=message) as caught:
        from_wire(raw, dt.RemoteTask)
    assert caught.value.path == f"$.{field}"


def test_a_missing_field_is_named() -> None:
    with pytest.raises(dt.PayloadError, match="required field missing") as caught:
        from_wire({"stepId": "s", "attempt": 1, "name": "x"}, dt.RemoteTask)
    assert caught.value.path == "$.runId"


def test_enum_values_are_checked() -> None:
    raw = {"runId": "r", "stepId": "s", "attempt": 1, "status": "maybe"}
    with pytest.raises(dt.PayloadError, match="expected one of") as caught:
        from_wire(raw, dt.StepResult)
    assert caught.value.path == "$.status"


def test_nested_errors_name_the_nested_field() -> None:
    raw = {"runId": "r", "stepId": "s", "attempt": 1, "status": "failed", "error": {"message": 3}}
    with pytest.raises(dt.PayloadError) as caught:
        from_wire(raw, dt.StepResult)
    assert caught.value.path == "$.error.message"


def test_arrays_are_not_strings() -> None:
    raw = {"taskId": "t", "runId": "r", "workflow": "w", "group": "g", "history": "abc"}
    with pytest.raises(dt.PayloadError, match="expected an array"):
        from_wire(raw, dt.WorkflowTask)


def test_envelope_round_trip_and_bad_envelopes() -> None:
    task = dt.RemoteTask(run_id="r", step_id="s", attempt=1, name="x", input={"a": [1, 2]})
    data = encode_envelope("j1", dt.JobKind.TASK, task, priority=2)
    envelope = decode_envelope(data)
    assert (envelope.id, envelope.kind, envelope.payload, envelope.priority) == (
        "j1",
        dt.JobKind.TASK,
        task,
        2,
    )
    with pytest.raises(dt.PayloadError, match="not JSON"):
        decode_envelope(b"\x00not json")
    with pytest.raises(dt.PayloadError, match="unknown job kind"):
        decode_envelope(b'{"id":"j","kind":"launchMissiles","payload":{}}')
    with pytest.raises(dt.PayloadError, match="not an object"):
        decode_envelope(b"[1,2]")
    with pytest.raises(dt.PayloadError, match="job id"):
        decode_envelope(b'{"kind":"task","payload":{}}')


def test_payload_size_is_bounded_both_ways() -> None:
    task = dt.RemoteTask(run_id="r", step_id="s", attempt=1, name="x", input="x" * 2000)
    with pytest.raises(dt.PayloadTooLarge, match="over max_payload_bytes=1000"):
        encode_envelope("j", dt.JobKind.TASK, task, max_bytes=1000)
    data = encode_envelope("j", dt.JobKind.TASK, task)
    with pytest.raises(dt.PayloadTooLarge):
        decode_envelope(data, max_bytes=1000)


def test_unserialisable_output_is_a_payload_error() -> None:
    result = dt.StepResult("r", "s", 1, dt.StepStatus.COMPLETED, output={1, 2})
    with pytest.raises(dt.PayloadError, match="not JSON-serialisable"):
        encode_envelope("j", dt.JobKind.RESULT, result)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_published_schemas_are_current(cls: type[Any]) -> None:
    """docs/schemas/ is generated by `make docs`; this fails when it is stale."""
    published = json.loads((SCHEMAS / f"{cls.__name__}.json").read_text())
    assert published == json_schema(cls)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
@given(data=st.data())
def test_schemas_name_every_key_a_message_writes(cls: type[Any], data: st.DataObject) -> None:
    schema = json_schema(cls)
    wire = orjson.loads(dumps(data.draw(message_of(cls))))
    assert set(wire) <= set(schema["properties"])
    assert set(schema.get("required", [])) <= set(wire)
