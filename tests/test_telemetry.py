"""Traces, metrics and lifecycle logs (docs/observability.md) under a virtual clock, on the
memory backend: the SDK's in-memory span exporter and metric reader, and caplog."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio._codec import decode_envelope, encode_envelope
from durable_trio._wire import ControlMessage, JobKind, TraceContext
from helpers import Errors

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

    from opentelemetry.sdk.trace import ReadableSpan

#: The tracer provider of the current test's ``otel`` fixture.
PROVIDERS: list[TracerProvider] = []
EXACT = dt.Retry(max_attempts=3, initial=2.0, multiplier=2.0, max_delay=60.0, jitter=0.0)


class Flaky(Exception):
    pass


@pytest.fixture
def otel() -> Iterator[tuple[InMemorySpanExporter, InMemoryMetricReader]]:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    dt.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
    PROVIDERS[:] = [tracer_provider]
    try:
        yield exporter, reader
    finally:
        dt.uninstrument()
        meter_provider.shutdown()
        tracer_provider.shutdown()


def shop() -> dt.App:
    app = dt.App("shop")
    failures: dict[str, int] = {}

    @app.step("reserve")
    async def reserve(order: dict[str, Any]) -> str:
        await trio.sleep(1)
        return "reserved"

    @app.step("charge", retry=EXACT)
    async def charge(order: dict[str, Any]) -> int:
        await trio.sleep(2)
        key = dt.step_info().idempotency_key
        failures[key] = failures.get(key, 0) + 1
        if failures[key] <= order["failures"]:
            raise Flaky(f"attempt {failures[key]} failed")
        return int(order["amount"])

    @app.step("ship")
    async def ship(order: dict[str, Any]) -> str:
        await trio.sleep(3)
        return "shipped"

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, order: dict[str, Any]) -> dict[str, Any]:
        return {
            "reserved": await ctx.step("reserve", order),
            "charged": await ctx.step("charge", order),
            "shipped": await ctx.step("ship", order),
        }

    return app


async def run_order(order: dict[str, Any], run_id: str = "r1") -> Any:
    app = shop()
    async with dt.open_backend("memory://") as backend:
        async with dt.open_worker(app, backend, on_error=Errors()):
            async with dt.open_engine(app, backend) as engine:
                started = await engine.start("order", order, run_id=run_id)
                try:
                    return await engine.result(started)
                except dt.RunFailed as exc:
                    return exc


def by_name(spans: tuple[ReadableSpan, ...], prefix: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name.startswith(prefix)]


def points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    found: dict[str, list[Any]] = {}
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


async def test_a_run_traces_one_run_span_and_a_step_span_per_attempt_under_it(
    autojump_clock: trio.testing.MockClock,
    otel: tuple[InMemorySpanExporter, InMemoryMetricReader],
) -> None:
    exporter, _ = otel
    outcome = await run_order({"amount": 5, "failures": 1})
    assert outcome == {"reserved": "reserved", "charged": 5, "shipped": "shipped"}
    spans = exporter.get_finished_spans()
    (run,) = by_name(spans, "run ")
    assert run.name == "run order"
    # started with no span current: the run's trace is its start span's, stored with it
    (start,) = by_name(spans, "start ")
    assert start.name == "start order"
    assert start.parent is None
    assert run.parent is not None
    assert run.parent.span_id == start.context.span_id
    assert run.attributes is not None
    assert dict(run.attributes) == {
        "durable_trio.run_id": "r1",
        "durable_trio.workflow": "order",
        "durable_trio.outcome": "completed",
    }
    steps = by_name(spans, "step ")
    # reserve, charge twice (a retry is its own attempt, so its own span), ship
    assert [(s.name, s.attributes["durable_trio.attempt"]) for s in steps] == [  # type: ignore[index]
        ("step reserve", 1),
        ("step charge", 1),
        ("step charge", 2),
        ("step ship", 1),
    ]
    for step in steps:
        assert step.context.trace_id == run.context.trace_id
        assert step.parent is not None
        assert step.parent.span_id == run.context.span_id
        assert step.attributes["durable_trio.run_id"] == "r1"  # type: ignore[index]
    assert [s.attributes["durable_trio.outcome"] for s in steps] == [  # type: ignore[index]
        "completed",
        "failed",
        "completed",
        "completed",
    ]
    assert not steps[1].status.is_ok
    # every task's hop is under the run's span, every result's under its step's span
    hops = by_name(spans, "hop ")
    tasks = [h for h in hops if h.name == "hop task"]
    results = [h for h in hops if h.name == "hop result"]
    assert len(tasks) == 4
    assert len(results) == 4
    assert {h.parent.span_id for h in tasks} == {run.context.span_id}  # type: ignore[union-attr]
    assert {h.parent.span_id for h in results} == {  # type: ignore[union-attr]
        s.context.span_id for s in steps
    }
    # every hop names the queue it was taken off, the results' hops too
    assert {h.attributes["messaging.destination.name"] for h in results} == {  # type: ignore[index]
        "shop:results"
    }
    assert all(
        str(h.attributes["messaging.destination.name"]).startswith("shop:tasks:")  # type: ignore[index]
        for h in tasks
    )


async def test_metrics_count_outcomes_and_measure_step_durations_in_virtual_time(
    autojump_clock: trio.testing.MockClock,
    otel: tuple[InMemorySpanExporter, InMemoryMetricReader],
) -> None:
    _, reader = otel
    await run_order({"amount": 5, "failures": 1}, run_id="a")
    failed = await run_order({"amount": 5, "failures": 9}, run_id="b")
    assert isinstance(failed, dt.RunFailed)
    found = points(reader)

    def counts(name: str, key: str) -> dict[tuple[str, str], int]:
        return {
            (p.attributes[key], p.attributes["durable_trio.outcome"]): p.value for p in found[name]
        }

    assert counts("durable_trio.step.outcomes", "durable_trio.step") == {
        ("reserve", "completed"): 2,
        ("charge", "retried"): 3,  # one in run a, two in run b
        ("charge", "completed"): 1,
        ("charge", "failed"): 1,  # run b's third attempt: no attempts left
        ("ship", "completed"): 1,
    }
    assert counts("durable_trio.run.outcomes", "durable_trio.workflow") == {
        ("order", "completed"): 1,
        ("order", "failed"): 1,
    }
    durations = {
        (p.attributes["durable_trio.step"], p.attributes["durable_trio.outcome"]): (p.count, p.sum)
        for p in found["durable_trio.step.duration"]
    }
    assert durations == {
        ("reserve", "completed"): (2, 2.0),
        ("charge", "failed"): (4, 8.0),
        ("charge", "completed"): (1, 2.0),
        ("ship", "completed"): (1, 3.0),
    }
    runs = {p.attributes["durable_trio.outcome"]: p.sum for p in found["durable_trio.run.duration"]}
    # run a: 1 + 2 + 2 (backoff) + 2 + 3 = 10 s; run b: 1 + 2 + 2 + 2 + 4 + 2 = 13 s
    assert runs == {"completed": 10.0, "failed": 13.0}


async def test_the_lifecycle_is_logged_with_structured_fields(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=dt.EVENTS_LOGGER)
    await run_order({"amount": 5, "failures": 1})
    records = [r for r in caplog.records if r.name == dt.EVENTS_LOGGER]
    events = [
        (r.event, getattr(r, "step", None), r.attempt if hasattr(r, "attempt") else None)  # type: ignore[attr-defined]
        for r in records
    ]
    assert events == [
        ("run.started", None, None),
        ("step.dispatched", "reserve", 1),
        ("step.started", "reserve", 1),
        ("step.completed", "reserve", 1),
        ("step.dispatched", "charge", 1),
        ("step.started", "charge", 1),
        ("step.failed", "charge", 1),
        ("step.retried", "charge", 2),
        ("step.dispatched", "charge", 2),
        ("step.started", "charge", 2),
        ("step.completed", "charge", 2),
        ("step.dispatched", "ship", 1),
        ("step.started", "ship", 1),
        ("step.completed", "ship", 1),
        ("run.completed", None, None),
    ]
    for record in records:
        assert record.run_id == "r1"  # type: ignore[attr-defined]
        assert hasattr(record, "outcome")
    started = next(r for r in records if r.event == "step.started")  # type: ignore[attr-defined]
    assert started.queue.endswith("reserve")  # type: ignore[attr-defined]
    assert started.worker  # type: ignore[attr-defined]
    failed = next(r for r in records if r.event == "step.failed")  # type: ignore[attr-defined]
    assert (failed.outcome, failed.duration, failed.error) == (  # type: ignore[attr-defined]
        "failed",
        2.0,
        "Flaky: attempt 1 failed",
    )
    retried = next(r for r in records if r.event == "step.retried")  # type: ignore[attr-defined]
    assert (retried.workflow, retried.delay) == ("order", 2.0)  # type: ignore[attr-defined]
    done = records[-1]
    assert (done.workflow, done.outcome, done.duration) == ("order", "completed", 10.0)  # type: ignore[attr-defined]


async def test_a_cancelled_run_is_logged_and_its_span_says_so(
    autojump_clock: trio.testing.MockClock,
    otel: tuple[InMemorySpanExporter, InMemoryMetricReader],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=dt.EVENTS_LOGGER)
    exporter, _ = otel
    app = shop()
    async with dt.open_backend("memory://") as backend:
        async with dt.open_worker(app, backend, on_error=Errors()):
            async with dt.open_engine(app, backend) as engine:
                await engine.start("order", {"amount": 1, "failures": 0}, run_id="c")
                await trio.sleep(0.5)
                assert await engine.cancel("c")
                await trio.sleep(1)
    (run,) = by_name(exporter.get_finished_spans(), "run ")
    assert run.attributes["durable_trio.outcome"] == "cancelled"  # type: ignore[index]
    events = [r.event for r in caplog.records if r.name == dt.EVENTS_LOGGER]  # type: ignore[attr-defined]
    assert events[0] == "run.started"
    assert "run.cancelled" in events


async def test_without_instrument_no_job_carries_a_trace_and_nothing_is_exported(
    autojump_clock: trio.testing.MockClock,
) -> None:
    assert not dt.is_instrumented()
    assert await run_order({"amount": 2, "failures": 0}) == {
        "reserved": "reserved",
        "charged": 2,
        "shipped": "shipped",
    }


async def test_a_run_started_inside_a_callers_span_is_its_child(
    autojump_clock: trio.testing.MockClock,
    otel: tuple[InMemorySpanExporter, InMemoryMetricReader],
) -> None:
    exporter, _ = otel
    tracer = PROVIDERS[0].get_tracer("caller")
    app = shop()
    async with dt.open_backend("memory://") as backend:
        async with dt.open_worker(app, backend, on_error=Errors()):
            async with dt.open_engine(app, backend) as engine:
                with tracer.start_as_current_span("request") as request:
                    run_id = await engine.start("order", {"amount": 1, "failures": 0})
                await engine.result(run_id)
    (run,) = by_name(exporter.get_finished_spans(), "run ")
    assert run.parent is not None
    assert run.parent.span_id == request.get_span_context().span_id


async def test_a_run_taken_over_by_another_engine_stays_in_its_trace(
    autojump_clock: trio.testing.MockClock,
    otel: tuple[InMemorySpanExporter, InMemoryMetricReader],
) -> None:
    """Engine A starts the run and closes before it ends (no worker yet: the run is released
    unsettled); engine B takes it over and completes it. Both run spans are children of the
    run's start span, stored with the run, so the run is one trace."""
    exporter, _ = otel
    app = shop()
    async with dt.open_backend("memory://") as backend:
        async with dt.open_engine(app, backend) as first:
            run_id = await first.start("order", {"amount": 3, "failures": 0}, run_id="r9")
            await trio.sleep(1)
        async with dt.open_worker(app, backend, on_error=Errors()):
            async with dt.open_engine(app, backend) as second:
                await second.reconcile()
                assert (await second.result(run_id))["charged"] == 3
    spans = exporter.get_finished_spans()
    (start,) = by_name(spans, "start ")
    first_run, second_run = by_name(spans, "run ")
    assert start.parent is None
    for span in (first_run, second_run):
        assert span.context.trace_id == start.context.trace_id
        assert span.parent is not None
        assert span.parent.span_id == start.context.span_id
    assert first_run.attributes is not None
    assert second_run.attributes is not None
    assert first_run.attributes["durable_trio.outcome"] == "stopped"
    assert second_run.attributes["durable_trio.outcome"] == "completed"
    steps = by_name(spans, "step ")
    assert [s.name for s in steps] == ["step reserve", "step charge", "step ship"]
    assert {s.context.trace_id for s in steps} == {start.context.trace_id}


async def test_a_run_whose_stored_trace_is_damaged_is_driven_in_a_new_trace(
    autojump_clock: trio.testing.MockClock,
    otel: tuple[InMemorySpanExporter, InMemoryMetricReader],
) -> None:
    """A stored trace context is advisory: one that does not parse (written by hand, a bad
    copy) gives the run a span of its own, and the run completes."""
    exporter, _ = otel
    app = shop()
    async with dt.open_backend("memory://") as backend:
        async with dt.open_engine(app, backend) as first:
            await first.start("order", {"amount": 4, "failures": 0}, run_id="r8", detach=True)
        store = first.store
        stored = store._runs["r8"]  # type: ignore[attr-defined]
        stored.trace = b'{"traceparent": "00-not-a-trace-01"}'
        async with dt.open_worker(app, backend, on_error=Errors()):
            async with dt.open_engine(app, backend) as second:
                await second.reconcile()
                assert (await second.result("r8"))["charged"] == 4
    (run,) = by_name(exporter.get_finished_spans(), "run ")
    assert run.parent is None
    assert run.attributes is not None
    assert run.attributes["durable_trio.outcome"] == "completed"


def test_old_envelopes_decode_and_odd_trace_contexts_are_dropped_not_refused() -> None:
    old = b'{"id":"j","kind":"control","payload":{"action":"cancel"}}'
    assert decode_envelope(old).trace is None
    for odd in (b'"x"', b"[1]", b'{"traceparent": 5}', b"{}"):
        job = b'{"id":"j","kind":"control","payload":{"action":"cancel"},"trace":' + odd + b"}"
        envelope = decode_envelope(job)
        assert envelope.trace is None
        assert envelope.payload == ControlMessage("cancel")
    carried = TraceContext("00-" + "1" * 32 + "-" + "2" * 16 + "-01", "k=v", 12.5)
    data = encode_envelope("j", JobKind.CONTROL, ControlMessage("cancel"), trace=carried)
    assert b'"trace":{"traceparent":"00-111' in data
    assert decode_envelope(data).trace == carried
    junk = (
        b'{"id":"j","kind":"control","payload":{"action":"c"},'
        b'"trace":{"traceparent":"00-a-b-01","tracestate":3,"sentAt":"now"}}'
    )
    assert decode_envelope(junk).trace == TraceContext("00-a-b-01")


def test_instrument_without_opentelemetry_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "durable_trio._otel", None)
    with pytest.raises(dt.ConfigError, match=r'pip install "durable_trio\[otel\]"'):
        dt.instrument()
    assert not dt.is_instrumented()
