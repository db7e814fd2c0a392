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
from durable_trio.testing.strategies import json_values, message_of

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


# --- the hand-written hot paths: a task read, a completed result written --------------------


def _task_fields(task: dt.RemoteTask) -> dict[str, Any]:
    return {f.name: getattr(task, f.name) for f in attrs.fields(dt.RemoteTask)}


@given(
    task=message_of(dt.RemoteTask),
    extra=st.dictionaries(st.sampled_from(["x", "new"]), st.integers()),
)
def test_a_task_read_by_hand_is_what_the_converter_makes(
    task: dt.RemoteTask, extra: dict[str, Any]
) -> None:
    from durable_trio._codec import _task_of

    wire = {**to_wire(task), **extra}
    by_hand = _task_of(wire)
    assert by_hand is not None
    converted = from_wire(wire, dt.RemoteTask)
    assert _task_fields(by_hand) == _task_fields(converted)
    assert {k: type(v) for k, v in _task_fields(by_hand).items()} == {
        k: type(v) for k, v in _task_fields(converted).items()
    }


@pytest.mark.parametrize(
    "changes",
    [
        {"deadline": 5, "timeout": 2, "heartbeatTimeout": 1},  # ints made floats
        {"deadline": 5.5, "timeout": None, "group": None, "priority": None, "input": None},
        {"input": {"a": [1, 2.5, None]}, "lastHeartbeat": "x", "maxAttempts": 3, "group": "g"},
        {"priority": 2, "x-newer-field": [1]},
    ],
)
def test_odd_but_valid_tasks_read_by_hand_as_converted(changes: dict[str, Any]) -> None:
    from durable_trio._codec import _task_of

    wire = {"runId": "r", "stepId": "s", "attempt": 2, "name": "n", "taskId": "t", **changes}
    by_hand = _task_of(wire)
    assert by_hand is not None
    converted = from_wire(wire, dt.RemoteTask)
    assert _task_fields(by_hand) == _task_fields(converted)
    assert type(by_hand.deadline) is type(converted.deadline)
    assert type(by_hand.timeout) is type(converted.timeout)


@pytest.mark.parametrize(
    "changes",
    [
        {"attempt": True},
        {"attempt": 1.0},
        {"runId": 5},
        {"name": None},
        {"taskId": None},
        {"taskId": 7},
        {"deadline": "5"},
        {"timeout": True},
        {"priority": 1.5},
        {"group": 3},
        {"maxAttempts": "3"},
    ],
)
def test_tasks_the_converter_refuses_are_left_to_it(changes: dict[str, Any]) -> None:
    from durable_trio._codec import _task_of

    wire = {"runId": "r", "stepId": "s", "attempt": 2, "name": "n", "taskId": "t", **changes}
    assert _task_of(wire) is None
    data = orjson.dumps({"id": "j", "kind": "task", "payload": wire})
    with pytest.raises(dt.PayloadError):
        decode_envelope(data)


def test_a_task_without_an_id_gets_a_fresh_one_read_by_hand() -> None:
    from durable_trio._codec import _task_of

    wire = {"runId": "r", "stepId": "s", "attempt": 1, "name": "n", "group": "g"}
    first, second = _task_of(wire), _task_of(wire)
    assert first is not None
    assert second is not None
    assert first.task_id
    assert first.task_id != second.task_id
    assert decode_envelope(
        orjson.dumps({"id": "j", "kind": "task", "payload": wire})
    ).payload.task_id not in (first.task_id, second.task_id)


def _completed(task: dt.RemoteTask, output: Any, delivery: Any) -> dt.StepResult:
    return dt.StepResult(
        task.run_id, task.step_id, task.attempt, dt.StepStatus.COMPLETED, output=output,
        task_id=task.task_id, delivery=delivery,
    )  # fmt: skip


@given(
    task=message_of(dt.RemoteTask),
    output=json_values,
    stalled=st.integers(min_value=-(2**63), max_value=2**64 - 1),
    more=st.dictionaries(st.sampled_from(["stalls", "leaseLostAt"]), json_values),
    traced=st.booleans(),
)
def test_a_completed_result_written_by_hand_is_what_the_encoder_writes(
    task: dt.RemoteTask, output: Any, stalled: int, more: dict[str, Any], traced: bool
) -> None:
    from durable_trio._codec import encode_result

    delivery = {"worker": "w", "job": "j", "lease": "l", "stalledCount": stalled, **more}
    trace = dt.TraceContext("00-ab-cd-01", "k=v", 5.0) if traced else None
    by_hand = encode_result("id-1", task, output, delivery, trace=trace)
    expected = encode_envelope(
        "id-1", dt.JobKind.RESULT, _completed(task, output, delivery), trace=trace
    )
    assert by_hand == expected


@pytest.mark.parametrize(
    ("output", "delivery"),
    [
        (float("nan"), None),
        ({1: "non-string key"}, None),
        ({"a": {1, 2}}, None),
        ("\ud800", None),  # a lone surrogate: orjson refuses it
        ("x" * 2048, None),  # over max_bytes
        (None, {"worker": "w", "job": "j", "lease": "l", "stalledCount": 0, "at": float("inf")}),
        (None, {"worker": "w", "job": "j", "lease": "l", "stalledCount": 2**64}),
        (None, {"worker": b"w", "job": "j", "lease": "l", "stalledCount": 0}),
    ],
)
def test_a_result_the_encoder_refuses_is_left_to_it(output: Any, delivery: Any) -> None:
    from durable_trio._codec import encode_result

    task = dt.RemoteTask("r", "s", 1, "n")
    delivery = delivery or {"worker": "w", "job": "j", "lease": "l", "stalledCount": 0}
    assert encode_result("id-1", task, output, delivery, max_bytes=1024) is None
    with pytest.raises(dt.PayloadError):
        encode_envelope(
            "id-1", dt.JobKind.RESULT, _completed(task, output, delivery), max_bytes=1024
        )
