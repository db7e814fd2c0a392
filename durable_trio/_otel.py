"""OpenTelemetry traces and metrics (the ``otel`` extra), loaded only by
:func:`durable_trio.instrument` (docs/observability.md).

Spans (attributes ``durable_trio.run_id``, ``durable_trio.step_id``, ``durable_trio.attempt``
...):

- ``start {workflow}``: made (and ended) where a run is created with no span current, so the
  run has a trace to belong to;
- ``run {workflow}``: a run, while this process drives it, a child of the trace context
  stored with the run (the span current at ``engine.start``, else its ``start`` span): an
  engine that resumes the run after another's crash opens another one in the same trace;
- ``step {name}``: one attempt of a step, on the worker that runs it, a child of its run's span
  across processes (the task's envelope carries the run's trace context);
- ``hop {kind}``: a job's way through the broker, from the push (the envelope's ``sentAt``,
  the sender's clock) to the pop, a child of the sender's span.

Metrics: ``durable_trio.step.duration`` (histogram, seconds, per step and outcome, on the
worker), ``durable_trio.step.outcomes`` (counter, per step and outcome: completed, failed,
retried, on the engine), ``durable_trio.run.outcomes`` (counter) and
``durable_trio.run.duration`` (histogram, seconds, store clock), per workflow and outcome.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from importlib import metadata
from typing import TYPE_CHECKING, Any

from opentelemetry import metrics, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ._wire import TraceContext

if TYPE_CHECKING:
    from collections.abc import Iterator

    from opentelemetry.context import Context
    from opentelemetry.trace import Span

    from ._facts import RunFacts
    from ._wire import Envelope, RemoteTask

__all__ = ["OtelInstruments"]

#: The W3C Trace Context format is what the envelope documents, whatever the process's global
#: propagator is.
_PROPAGATOR = TraceContextTextMapPropagator()

#: The span of the step attempt running in this task (set inside ``step_span``).
_STEP_SPAN: contextvars.ContextVar[tuple[Span, str] | None] = contextvars.ContextVar(
    "durable_trio_step_span", default=None
)


def _version() -> str:
    try:
        return metadata.version("durable_trio")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a bare checkout
        return "0"


def _parent(context: TraceContext) -> Context:
    headers = {"traceparent": context.traceparent}
    if context.tracestate is not None:
        headers["tracestate"] = context.tracestate
    return _PROPAGATOR.extract(headers)


def _trace_headers() -> dict[str, str]:
    """The current span's W3C ``traceparent`` (and ``tracestate``, if any)."""
    headers: dict[str, str] = {}
    _PROPAGATOR.inject(headers)
    return {k: headers[k] for k in ("traceparent", "tracestate") if k in headers}


class _RunSpan:
    __slots__ = ("settled", "span")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.settled = False


class OtelInstruments:
    """Satisfies :class:`durable_trio._telemetry.Instruments` with OpenTelemetry."""

    def __init__(self, *, tracer_provider: Any = None, meter_provider: Any = None) -> None:
        version = _version()
        self._tracer = trace.get_tracer("durable_trio", version, tracer_provider)
        meter = metrics.get_meter("durable_trio", version, meter_provider)
        self._step_duration = meter.create_histogram(
            "durable_trio.step.duration",
            unit="s",
            description="How long step attempts ran on the worker, by step and outcome",
        )
        self._step_outcomes = meter.create_counter(
            "durable_trio.step.outcomes",
            unit="{result}",
            description="Step results applied by the engine, by step and outcome "
            "(completed, failed, retried)",
        )
        self._run_outcomes = meter.create_counter(
            "durable_trio.run.outcomes",
            unit="{run}",
            description="Runs settled, by workflow and outcome (completed, failed, cancelled)",
        )
        self._run_duration = meter.create_histogram(
            "durable_trio.run.duration",
            unit="s",
            description="From a run's creation to its settling (store clock), by workflow "
            "and outcome",
        )
        self._runs: dict[str, _RunSpan] = {}

    # ------------------------------------------------------------------ context

    def carrier(self) -> TraceContext | None:
        if not trace.get_current_span().get_span_context().is_valid:
            return None
        headers = _trace_headers()
        traceparent = headers.get("traceparent")
        if traceparent is None:  # pragma: no cover - a valid context always injects one
            return None
        return TraceContext(traceparent, headers.get("tracestate"), time.time())

    # ------------------------------------------------------------------ runs

    def run_trace(self, workflow: str) -> dict[str, str]:
        if not trace.get_current_span().get_span_context().is_valid:
            with self._tracer.start_as_current_span(
                f"start {workflow}", attributes={"durable_trio.workflow": workflow}
            ):
                return _trace_headers()
        return _trace_headers()

    @contextlib.contextmanager
    def run_span(self, run: RunFacts) -> Iterator[None]:
        stored = run.trace
        parent = None
        if isinstance(stored, dict) and isinstance(stored.get("traceparent"), str):
            state = stored.get("tracestate")
            context = _parent(
                TraceContext(stored["traceparent"], state if isinstance(state, str) else None)
            )
            if trace.get_current_span(context).get_span_context().is_valid:
                parent = context  # else (a damaged traceparent): the current span, as before
        span = self._tracer.start_span(
            f"run {run.workflow}",
            context=parent,
            attributes={
                "durable_trio.run_id": run.run_id,
                "durable_trio.workflow": run.workflow,
            },
        )
        held = self._runs[run.run_id] = _RunSpan(span)
        try:
            with trace.use_span(
                span, end_on_exit=False, record_exception=False, set_status_on_exception=False
            ):
                yield
        finally:
            if self._runs.get(run.run_id) is held:
                del self._runs[run.run_id]
            if not held.settled:  # this process stopped driving it (closed, lease lost)
                span.set_attribute("durable_trio.outcome", "stopped")
            span.end()

    def run_settled(self, kind: str, run: RunFacts) -> None:
        if kind == "started":
            return
        labels = {"durable_trio.workflow": run.workflow, "durable_trio.outcome": kind}
        self._run_outcomes.add(1, labels)
        self._run_duration.record(max(0.0, run.updated_at - run.created_at), labels)
        held = self._runs.get(run.run_id)
        if held is not None and not held.settled:
            held.settled = True
            held.span.set_attribute("durable_trio.outcome", kind)
            if kind == "failed":
                error = run.error if isinstance(run.error, dict) else {}
                held.span.set_status(
                    Status(StatusCode.ERROR, str(error.get("message", "the run failed")))
                )

    def dispatching(self, run_id: str) -> contextlib.AbstractContextManager[Any]:
        held = self._runs.get(run_id)
        if held is None:
            return contextlib.nullcontext()
        return trace.use_span(
            held.span, end_on_exit=False, record_exception=False, set_status_on_exception=False
        )

    # ------------------------------------------------------------------ jobs and steps

    def hop(self, envelope: Envelope, queue: str | None) -> None:
        carried = envelope.trace
        assert carried is not None
        now = time.time_ns()
        start = now if carried.sent_at is None else min(now, int(carried.sent_at * 1e9))
        attributes: dict[str, Any] = {
            "messaging.system": "durable_trio",
            "messaging.message.id": envelope.id,
            "durable_trio.job_kind": envelope.kind.value,
        }
        if queue is not None:
            attributes["messaging.destination.name"] = queue
        payload = envelope.payload
        for name in ("run_id", "step_id", "attempt"):
            value = getattr(payload, name, None)
            if isinstance(value, str | int):
                attributes[f"durable_trio.{name}"] = value
        span = self._tracer.start_span(
            f"hop {envelope.kind.value}",
            context=_parent(carried),
            kind=SpanKind.CONSUMER,
            attributes=attributes,
            start_time=start,
        )
        span.end(end_time=now)

    @contextlib.contextmanager
    def step_span(
        self, task: RemoteTask, carried: TraceContext | None, queue: str, worker: str
    ) -> Iterator[None]:
        span = self._tracer.start_span(
            f"step {task.name}",
            context=None if carried is None else _parent(carried),
            kind=SpanKind.CONSUMER,
            attributes={
                "durable_trio.run_id": task.run_id,
                "durable_trio.step_id": task.step_id,
                "durable_trio.attempt": task.attempt,
                "durable_trio.step": task.name,
                "messaging.destination.name": queue,
                "durable_trio.worker": worker,
            },
        )
        token = _STEP_SPAN.set((span, task.name))
        try:
            with trace.use_span(
                span, end_on_exit=False, record_exception=False, set_status_on_exception=False
            ):
                yield
        finally:
            _STEP_SPAN.reset(token)
            span.end()

    def step_ended(self, outcome: str, seconds: float, error: str | None) -> None:
        current = _STEP_SPAN.get()
        if current is None:  # pragma: no cover - only called inside step_span
            return
        span, name = current
        span.set_attribute("durable_trio.outcome", outcome)
        if outcome == "failed":
            span.set_status(Status(StatusCode.ERROR, error or "the step failed"))
        self._step_duration.record(
            seconds, {"durable_trio.step": name, "durable_trio.outcome": outcome}
        )

    def step_applied(self, name: str, outcome: str) -> None:
        self._step_outcomes.add(1, {"durable_trio.step": name, "durable_trio.outcome": outcome})
