"""What a JSON value may be (issue #13, finding 3): deep nesting, NaN and foreign types are a
PayloadError naming the path, at dispatch, for step outputs (one ``bad_output`` result), and in
the engine (workflow input and output, ``ctx.run`` results) — never a RecursionError, a step run
five times, a run left hanging, or NaN written as null."""

from __future__ import annotations

import datetime
import enum
import math
from collections import Counter
from typing import Any

import hypothesis.strategies as st
import orjson
import pytest
import trio
import trio.testing
from hypothesis import given, settings

import durable_trio as dt
from durable_trio._codec import decode_envelope, encode_envelope
from durable_trio._engine import (
    App,
    Retry,
    RunFailed,
    StepFailed,
    WorkflowContext,
    open_engine,
    open_worker,
    step_info,
)
from durable_trio._engine._records import normalize_json
from durable_trio._json_values import _orjson_write_depth, read_within
from durable_trio.brokers import Job
from durable_trio.brokers.memory import MemoryBroker
from durable_trio.keys.memory import MemoryKeyStore
from helpers import Errors

NAN, INF = math.nan, math.inf


def nested(levels: int, leaf: Any = 1) -> Any:
    """``leaf`` inside ``levels`` arrays: ``[[...[leaf]...]]``."""
    value = leaf
    for _ in range(levels):
        value = [value]
    return value


def task(**fields: Any) -> dt.RemoteTask:
    return dt.RemoteTask(run_id="r", step_id="1", attempt=1, name="job", **fields)


def result(output: Any) -> dt.StepResult:
    return dt.StepResult("r", "1", 1, dt.StepStatus.COMPLETED, output=output)


def deep_path(field: str, levels: int) -> str:
    return field + "[0]" * levels


# --------------------------------------------------------------------------- depth


@pytest.mark.parametrize("levels", [600, 10_000])
async def test_dispatching_a_deeply_nested_input_is_a_payload_error(
    levels: int, autojump_clock: trio.testing.MockClock
) -> None:
    async with (
        dt.open_backend("memory://") as backend,
        dt.open_queue_transport(backend) as transport,
    ):
        with pytest.raises(dt.PayloadError, match="nested deeper than 200 levels") as caught:
            await transport.dispatch(task(input=nested(levels)))
    # The first array past the limit: the input itself is level 1.
    assert caught.value.path == deep_path("$.input", dt.MAX_JSON_DEPTH)


@pytest.mark.parametrize("levels", [600, 10_000])
async def test_starting_a_workflow_with_a_deeply_nested_input_is_a_payload_error(
    levels: int, autojump_clock: trio.testing.MockClock
) -> None:
    app = App("shop")

    @app.workflow("wf")
    async def wf(ctx: WorkflowContext, value: Any) -> Any:
        return value

    async with dt.open_backend("memory://") as backend, open_engine(app, backend) as engine:
        with pytest.raises(dt.PayloadError, match="the input of workflow 'wf'") as caught:
            await engine.start("wf", {"order": nested(levels)})
        assert await engine.list() == []
    assert caught.value.path == deep_path("$.order", dt.MAX_JSON_DEPTH - 1)  # {} is level 1


@pytest.mark.parametrize("levels", [600, 10_000])
async def test_a_step_returning_deeply_nested_output_runs_once_and_fails_its_run(
    levels: int, autojump_clock: trio.testing.MockClock
) -> None:
    app = App("shop")
    runs: Counter[str] = Counter()

    @app.step("deep", retry=Retry(max_attempts=5))
    async def deep(_: Any) -> Any:
        runs[step_info().idempotency_key] += 1
        return {"tree": nested(levels)}

    @app.workflow("wf")
    async def wf(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("deep")

    errors = Errors()
    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend, on_error=errors):
            async with open_engine(app, backend) as engine:
                with pytest.raises(RunFailed) as failed:
                    await engine.result(await engine.start("wf", run_id="d"))
                stats = engine.statistics()
                broker = backend.broker
                assert isinstance(broker, MemoryBroker)
                failed_tasks = await broker.failed_jobs(engine.transport.names.task_queue("deep"))
    assert trio.current_time() == 0.0
    assert runs == {"d:1": 1}  # not re-run: bad_output is not retryable
    step_error = failed.value.error["error"]
    assert (step_error["code"], step_error["retryable"]) == ("bad_output", False)
    assert "than 200 levels of arrays and objects at $.output.tree[0][0]" in step_error["message"]
    assert failed.value.error["attempts"] == 1
    assert (stats.results_applied, stats.duplicate_results, stats.stale_results) == (1, 0, 0)
    assert failed_tasks == []  # the task completed: its outcome is the failed result
    reported = [str(e) for e in errors.seen if isinstance(e, dt.JobError)]
    assert len(reported) == 1
    assert "returned an output that cannot be sent" in reported[0]
    assert not any(isinstance(e, RecursionError) for e in errors.seen)


@pytest.mark.parametrize("levels", [600, 10_000])
async def test_a_local_step_returning_deeply_nested_output_fails_once(
    levels: int, autojump_clock: trio.testing.MockClock
) -> None:
    app = App("shop")
    calls: list[int] = []

    def deep() -> Any:
        calls.append(step_info().attempt)
        return nested(levels)

    @app.workflow("wf")
    async def wf(ctx: WorkflowContext, _: Any) -> Any:
        try:
            return await ctx.run("deep", deep, retry=Retry(max_attempts=5))
        except StepFailed as exc:
            return exc.error.message

    async with dt.open_backend("memory://") as backend, open_engine(app, backend) as engine:
        message = await engine.result(await engine.start("wf"))
    assert calls == [1]  # bad output is not retried
    assert "the result of local step 'deep' is not JSON-serialisable" in message
    assert trio.current_time() == 0.0


def test_the_depth_limit_is_exact_both_ways() -> None:
    fits, too_deep = nested(dt.MAX_JSON_DEPTH), nested(dt.MAX_JSON_DEPTH + 1)
    sent = task(input=fits)
    assert decode_envelope(encode_envelope("j", dt.JobKind.TASK, sent)).payload == sent
    with pytest.raises(dt.PayloadError) as caught:
        encode_envelope("j", dt.JobKind.RESULT, result(too_deep))
    assert caught.value.path == deep_path("$.output", dt.MAX_JSON_DEPTH)
    assert normalize_json(fits) == fits
    with pytest.raises(dt.PayloadError) as caught:
        normalize_json(too_deep)
    assert caught.value.path == deep_path("$", dt.MAX_JSON_DEPTH)


def test_a_value_at_the_limit_still_fits_in_the_records_that_carry_it() -> None:
    """An output of dt.MAX_JSON_DEPTH levels travels on in a workflow turn's history, a decision's
    commands and a pod's run view, a few levels deeper."""
    fits = nested(dt.MAX_JSON_DEPTH)
    entry = {"stepId": "1", "kind": "remote", "name": "s", "status": "completed", "output": fits}
    turn = dt.WorkflowTask("t", "r", "wf", "g", history=(entry,))
    assert decode_envelope(encode_envelope("j", dt.JobKind.WORKFLOW, turn)).payload == turn
    reply = dt.RunReply("q", True, data=[{"runId": "r", "output": fits}])
    assert decode_envelope(encode_envelope("j", dt.JobKind.RUN_REPLY, reply)).payload == reply
    command = {"type": "step", "stepId": "2", "name": "s", "input": fits}
    decision = dt.WorkflowDecision("t", "r", dt.DecisionStatus.CONTINUED, commands=(command,))
    data = encode_envelope("j", dt.JobKind.DECISION, decision)
    assert decode_envelope(data).payload == decision


def raw_job(kind: str, payload: bytes) -> bytes:
    return b'{"id":"j","kind":"' + kind.encode() + b'","payload":' + payload + b"}"


@pytest.mark.parametrize("levels", [dt.MAX_JSON_DEPTH + 1, 600, 1000])
def test_a_job_whose_bytes_nest_too_deep_is_a_payload_error(levels: int) -> None:
    """orjson reads 1,024 levels, more than it writes: a job from another producer that nests
    deeper than the limit is refused on arrival, before anything recurses over it."""
    output = b"[" * levels + b"]" * levels
    data = raw_job(
        "result",
        b'{"runId":"r","stepId":"1","attempt":1,"status":"completed","output":' + output + b"}",
    )
    with pytest.raises(dt.PayloadError, match="nested deeper than 200 levels") as caught:
        decode_envelope(data)
    assert caught.value.path == deep_path("$.output", dt.MAX_JSON_DEPTH)
    # And in a nested message field: a failed result's error details.
    details = raw_job(
        "result",
        b'{"runId":"r","stepId":"1","attempt":1,"status":"failed",'
        b'"error":{"message":"m","details":' + output + b"}}",
    )
    with pytest.raises(dt.PayloadError) as caught:
        decode_envelope(details)
    assert caught.value.path == deep_path("$.error.details", dt.MAX_JSON_DEPTH)


async def test_a_task_on_a_queue_nested_too_deep_fails_its_step_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Another producer's task, 600 levels deep: failed as bad input, and its run told."""
    errors = Errors()
    results: list[dt.StepResult] = []
    ran: list[str] = []
    broker = MemoryBroker()
    backend = dt.Backend(url="test://", broker=broker, keys=MemoryKeyStore())
    async with dt.open_queue_transport(backend, on_error=errors) as transport:

        async def job(t: dt.RemoteTask) -> Any:
            ran.append(t.step_id)

        async def on_result(r: dt.StepResult) -> None:
            results.append(r)

        transport.handle("job", job)
        transport.on_result(on_result)
        data = raw_job(
            "task",
            b'{"runId":"r","stepId":"s","attempt":1,"name":"job","taskId":"t","input":'
            + b"[" * 600
            + b"]" * 600
            + b"}",
        )
        await broker.push_on(transport.names.task_queue("job"), Job("deep-1", data))
        await trio.sleep(1)
        (failed,) = await broker.failed_jobs(transport.names.task_queue("job"))
    assert ran == []
    assert failed.id == "deep-1"
    assert "nested deeper than 200 levels" in failed.error
    (answer,) = results
    assert (answer.run_id, answer.step_id, answer.status) == ("r", "s", dt.StepStatus.FAILED)
    assert answer.error is not None
    assert (answer.error.code, answer.error.retryable) == ("bad_input", False)


def test_a_job_deeper_than_orjson_reads_is_a_payload_error() -> None:
    data = raw_job(
        "task",
        b'{"runId":"r","stepId":"1","attempt":1,"name":"x","taskId":"t",'
        b'"input":' + b"[" * 5000 + b"]" * 5000 + b"}",
    )
    with pytest.raises(dt.PayloadError, match="not JSON"):
        decode_envelope(data)


def test_the_depth_measured_by_orjson_matches_the_walk() -> None:
    assert _orjson_write_depth() == 254  # orjson >= 3.11.6; read_within falls back otherwise
    for levels in (0, 1, dt.MAX_JSON_DEPTH, dt.MAX_JSON_DEPTH + 1, 254, 800):
        value = orjson.loads(b"[" * levels + b"1" + b"]" * levels)
        assert read_within(value, dt.MAX_JSON_DEPTH) is (levels <= dt.MAX_JSON_DEPTH)


# --------------------------------------------------------------------------- NaN and types


@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
async def test_dispatching_nan_or_infinity_is_refused_not_nulled(
    bad: float, autojump_clock: trio.testing.MockClock
) -> None:
    async with (
        dt.open_backend("memory://") as backend,
        dt.open_queue_transport(backend) as transport,
    ):
        with pytest.raises(dt.PayloadError, match="NaN and the infinities") as caught:
            await transport.dispatch(task(input={"a": [1, bad]}))
        broker = backend.broker
        assert isinstance(broker, MemoryBroker)
        assert await broker.size_of(transport.names.task_queue("job")) == 0
    assert caught.value.path == "$.input.a[1]"


@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
async def test_a_step_output_with_nan_gives_one_bad_output_result(
    bad: float, autojump_clock: trio.testing.MockClock
) -> None:
    app = App("shop")
    runs: list[int] = []

    @app.step("measure")
    async def measure(_: Any) -> Any:
        runs.append(step_info().attempt)
        return {"readings": [1.0, bad]}

    @app.workflow("wf")
    async def wf(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("measure")

    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend, on_error=Errors()), open_engine(app, backend) as e:
            with pytest.raises(RunFailed) as failed:
                await e.result(await e.start("wf"))
    assert runs == [1]
    step_error = failed.value.error["error"]
    assert step_error["code"] == "bad_output"
    assert f"{bad!r} (NaN and the infinities" in step_error["message"]
    assert "at $.output.readings[1]" in step_error["message"]


@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
async def test_the_engine_refuses_nan_in_workflow_input_output_and_checkpoints(
    bad: float, autojump_clock: trio.testing.MockClock
) -> None:
    app = App("shop")

    @app.workflow("returns")
    async def returns(ctx: WorkflowContext, _: Any) -> Any:
        return {"total": bad}

    @app.workflow("checkpoints")
    async def checkpoints(ctx: WorkflowContext, _: Any) -> Any:
        try:
            await ctx.run("reading", lambda: [0.5, {"x": bad}], retry=Retry(max_attempts=3))
        except StepFailed as exc:
            return [exc.attempts, exc.error.code, exc.error.retryable, exc.error.message]
        return "recorded"

    @app.workflow("steps")
    async def steps(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("anything", {"limit": bad})

    async with dt.open_backend("memory://") as backend, open_engine(app, backend) as engine:
        with pytest.raises(dt.PayloadError) as caught:
            await engine.start("returns", {"price": [bad]})
        assert caught.value.path == "$.price[0]"

        with pytest.raises(RunFailed) as failed:
            await engine.result(await engine.start("returns"))
        assert failed.value.error_type == "PayloadError"
        assert "the return value of workflow 'returns'" in failed.value.error["message"]
        assert "at $.total" in failed.value.error["message"]

        attempts, code, retryable, message = await engine.result(await engine.start("checkpoints"))
        assert (attempts, code, retryable) == (1, "PayloadError", False)
        assert "the result of local step 'reading'" in message
        assert "at $[1].x" in message

        with pytest.raises(RunFailed) as failed:
            await engine.result(await engine.start("steps"))
        assert "the input of step 'anything'" in failed.value.error["message"]
        assert "at $.limit" in failed.value.error["message"]
    assert trio.current_time() == 0.0


class Colour(enum.IntEnum):
    RED = 1


class Name(str):
    pass


@pytest.mark.parametrize(
    ("value", "path", "problem"),
    [
        ({"a": {1, 2}}, "$.input.a", "a set"),
        ({"a": b"raw"}, "$.input.a", "a bytes"),
        ({"when": datetime.date(2026, 1, 1)}, "$.input.when", "a date"),
        ([Colour.RED], "$.input[0]", "a Colour"),
        ({"n": Name("x")}, "$.input.n", "a Name"),
        ({"err": dt.StepError("x")}, "$.input.err", "a StepError"),
        ({"k": {1: "one"}}, "$.input.k", "a key that is not a string"),
        ({"big": 2**64}, "$.input.big", "outside the 64-bit range"),
        ({"s": ["ok", "\udc80"]}, "$.input.s[1]", "lone surrogate"),
        ({"odd key": [NAN]}, '$.input["odd key"][0]', "NaN"),
    ],
)
def test_non_json_values_are_refused_with_their_path(value: Any, path: str, problem: str) -> None:
    with pytest.raises(dt.PayloadError, match="not JSON-serialisable") as caught:
        encode_envelope("j", dt.JobKind.TASK, task(input=value))
    assert caught.value.path == path
    assert problem in str(caught.value)
    with pytest.raises(dt.PayloadError) as caught:
        normalize_json(value, "the value")
    assert caught.value.path == path.replace("$.input", "$", 1)


def test_tuples_are_written_as_arrays() -> None:
    data = encode_envelope("j", dt.JobKind.RESULT, result({"pair": (1, (2, 3))}))
    assert decode_envelope(data).payload.output == {"pair": [1, [2, 3]]}
    assert normalize_json((1, (2,))) == [1, [2]]


# --------------------------------------------------------------------------- property

_junk = st.sampled_from(
    [NAN, INF, -INF, {1, 2}, b"x", Colour.RED, Name("n"), 2**64, -(2**63) - 1, "\ud800", object()]
)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
_values = st.recursive(
    _scalars | _junk,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.text(max_size=4), children, max_size=3)
        | st.dictionaries(st.integers(0, 3), children, min_size=1, max_size=2)
        | children.map(lambda v: nested(195, v))  # near the depth limit, either side
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(value=_values)
def test_a_value_round_trips_exactly_or_is_a_payload_error(value: Any) -> None:
    refused: dt.PayloadError | None = None
    try:
        data = encode_envelope("j", dt.JobKind.RESULT, result(value))
    except dt.PayloadError as exc:
        refused = exc
    if refused is not None:
        assert str(refused.path).startswith("$.output")
        with pytest.raises(dt.PayloadError):
            normalize_json(value)
        return
    assert decode_envelope(data).payload.output == value
    assert normalize_json(value) == value
