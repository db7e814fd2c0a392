"""What a run and its steps tell the outside: structured lifecycle logs, always, on the logger
``durable_trio.events``; OpenTelemetry traces and metrics once :func:`instrument` is called
(docs/observability.md).

This module imports nothing of OpenTelemetry: with the ``otel`` extra missing, or with it
installed but :func:`instrument` never called, every hook here costs a global read (and a
logger level check). :func:`instrument` loads :mod:`durable_trio._otel`, which does.

The hooks, where the package calls them:

- the engine: :func:`run_trace` when it creates a run (the trace stored with it),
  :func:`run_span` around driving a run, :func:`run_event` when a run starts or
  settles, :func:`dispatching` around a step's dispatch (its retries included, which are sent
  from result application, outside the run's task), :func:`step_applied` for each result applied;
- the transport: :func:`carrier` in every job it makes (the envelope's ``trace``),
  :func:`hop` for each traced job taken off a queue, a :class:`StepAttempt` around each step
  handler.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Protocol

import trio

from ._logs import get_logger

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import TracebackType

    from ._facts import RunFacts, StepFacts
    from ._wire import Envelope, RemoteTask, StepResult, TraceContext

__all__ = [
    "EVENTS_LOGGER",
    "Instruments",
    "StepAttempt",
    "carrier",
    "dispatching",
    "hop",
    "instrument",
    "is_instrumented",
    "run_event",
    "run_span",
    "run_trace",
    "step_applied",
    "step_dispatched",
    "uninstrument",
]

#: The logger of the run and step lifecycle records (docs/observability.md, "Logs").
EVENTS_LOGGER = "durable_trio.events"

_log = get_logger(EVENTS_LOGGER)


class Instruments(Protocol):
    """What an instrumentation does at each hook (:class:`durable_trio._otel.OtelInstruments`
    for OpenTelemetry)."""

    def carrier(self) -> TraceContext | None:
        """The current trace context, for a job being made (``None``: no span is current)."""

    def run_trace(self, workflow: str) -> dict[str, str]:
        """The trace context a run being created is stored with: the current span's, else
        that of a ``start {workflow}`` span made (and ended) for it."""

    def run_span(self, run: RunFacts) -> contextlib.AbstractContextManager[None]:
        """A run's span while this process drives it, current inside: a child of the run's
        stored trace context (:attr:`RunFacts.trace`), else of the current span."""

    def run_settled(self, kind: str, run: RunFacts) -> None:
        """A run started or settled (``kind``: started, completed, failed, cancelled)."""

    def dispatching(self, run_id: str) -> contextlib.AbstractContextManager[None]:
        """The run's span current (when this process drives the run) for a dispatch."""

    def hop(self, envelope: Envelope, queue: str | None) -> None:
        """A job was taken off ``queue``: the span of its hop, from push to pop."""

    def step_span(
        self, task: RemoteTask, trace: TraceContext | None, queue: str, worker: str
    ) -> contextlib.AbstractContextManager[None]:
        """A step attempt's span, a child of the task's trace context, current inside."""

    def step_ended(self, outcome: str, seconds: float, error: str | None) -> None:
        """The current step attempt ended: outcome on its span, its duration measured."""

    def step_applied(self, name: str, outcome: str) -> None:
        """The engine applied a step's result (``outcome``: completed, failed, retried)."""


_active: Instruments | None = None


def instrument(*, tracer_provider: Any = None, meter_provider: Any = None) -> None:
    """Turn on OpenTelemetry traces and metrics for this process (engine and workers alike).

    Needs the ``otel`` extra (``pip install "durable_trio[otel]"``). Calling it again replaces
    the providers; :func:`uninstrument` turns it off. Spans and metrics go to the providers
    given, else to OpenTelemetry's global ones (``trace.set_tracer_provider`` ...).

    Args:
        tracer_provider: an ``opentelemetry.trace.TracerProvider`` (default: the global one).
        meter_provider: an ``opentelemetry.metrics.MeterProvider`` (default: the global one).

    Raises:
        ConfigError: OpenTelemetry is not installed.
    """
    global _active
    from ._errors import ConfigError

    try:
        from ._otel import OtelInstruments
    except ImportError as exc:
        raise ConfigError(
            'dt.instrument() needs OpenTelemetry: pip install "durable_trio[otel]"'
        ) from exc
    _active = OtelInstruments(tracer_provider=tracer_provider, meter_provider=meter_provider)


def uninstrument() -> None:
    """Turn traces and metrics off again (the structured logs stay; they are stdlib logging)."""
    global _active
    _active = None


def is_instrumented() -> bool:
    """Whether :func:`instrument` is in force."""
    return _active is not None


# ---------------------------------------------------------------------- transport hooks


def carrier() -> TraceContext | None:
    """The trace context a job made now carries (``None`` when not instrumented)."""
    active = _active
    return None if active is None else active.carrier()


def hop(envelope: Envelope, queue: str | None) -> None:
    """A job was taken off ``queue`` (``None``: not named) — a span only for a traced job in
    a traced process."""
    active = _active
    if active is not None and envelope.trace is not None:
        active.hop(envelope, queue)


class StepAttempt:
    """One attempt of a step on a worker, from its handler's start to its end: the log
    records ``step started`` and ``step completed``/``step failed``, and, when instrumented,
    its span and duration. Its own context manager (a class, not a generator: it is entered
    once per job)."""

    __slots__ = ("_span", "ended", "queue", "started", "task", "trace", "worker")

    def __init__(
        self,
        task: RemoteTask,
        queue: str,
        worker: str,
        trace: TraceContext | None = None,
        started: float | None = None,
    ) -> None:
        self.task = task
        self.queue = queue
        self.worker = worker
        self.trace = trace
        self.started = trio.current_time() if started is None else started
        self.ended = False
        self._span: contextlib.AbstractContextManager[None] | None = None

    def __enter__(self) -> StepAttempt:
        task, queue, worker = self.task, self.queue, self.worker
        if _log.isEnabledFor(logging.INFO):
            _log.info(
                "step %s started attempt %d of run %s",
                task.name,
                task.attempt,
                task.run_id,
                extra={"event": "step.started", **_step_fields(task, queue, worker, None)},
            )
        active = _active
        if active is not None:
            span = active.step_span(task, self.trace, queue, worker)
            span.__enter__()
            self._span = span
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        span = self._span
        if span is None:
            if not self.ended:
                self.end("cancelled")
            return None
        self._span = None
        try:
            self.end("cancelled")
        except BaseException as error:
            span.__exit__(type(error), error, error.__traceback__)
            raise
        return span.__exit__(exc_type, exc, tb)

    def end(self, outcome: str, error: str | None = None, now: float | None = None) -> None:
        """The attempt ended (``completed`` or ``failed``; ``now``: the trio clock, when the
        caller has just read it); only the first call counts."""
        if self.ended:
            return
        self.ended = True
        seconds = (trio.current_time() if now is None else now) - self.started
        task = self.task
        if _log.isEnabledFor(logging.INFO):
            fields = _step_fields(task, self.queue, self.worker, outcome)
            fields["duration"] = seconds
            if error is not None:
                fields["error"] = error
            _log.info(
                "step %s %s attempt %d of run %s",
                task.name,
                outcome,
                task.attempt,
                task.run_id,
                extra={"event": f"step.{outcome}", **fields},
            )
        active = _active
        if active is not None:
            active.step_ended(outcome, seconds, error)


def _step_fields(
    task: RemoteTask, queue: str | None, worker: str | None, outcome: str | None
) -> dict[str, Any]:
    return {
        "run_id": task.run_id,
        "step_id": task.step_id,
        "attempt": task.attempt,
        "step": task.name,
        "workflow": None,
        "queue": queue,
        "worker": worker,
        "outcome": outcome,
    }


# ---------------------------------------------------------------------- engine hooks


def run_trace(workflow: str) -> dict[str, str] | None:
    """The trace context to store with a run of ``workflow`` created now (``None`` when not
    instrumented): every engine that drives the run opens its run span as a child of it, the
    first and any that takes the run over after a crash, so a run is one trace."""
    active = _active
    return None if active is None else active.run_trace(workflow)


@contextlib.contextmanager
def run_span(run: RunFacts) -> Iterator[None]:
    """Around driving ``run`` in this process (its span, when instrumented)."""
    active = _active
    if active is None:
        yield
        return
    with active.run_span(run):
        yield


def run_event(kind: str, run: RunFacts) -> None:
    """``run`` started or settled here (``kind``: started, completed, failed, cancelled)."""
    if _log.isEnabledFor(logging.INFO):
        fields: dict[str, Any] = {
            "event": f"run.{kind}",
            "run_id": run.run_id,
            "workflow": run.workflow,
            "outcome": None if kind == "started" else kind,
        }
        if kind != "started":
            fields["duration"] = run.updated_at - run.created_at
        _log.info("run %s of %s %s", run.run_id, run.workflow, kind, extra=fields)
    active = _active
    if active is not None:
        active.run_settled(kind, run)


@contextlib.contextmanager
def dispatching(run_id: str) -> Iterator[None]:
    """Around a step's dispatch: the job carries the run's trace context."""
    active = _active
    if active is None:
        yield
        return
    with active.dispatching(run_id):
        yield


def step_dispatched(record: StepFacts, workflow: str | None, job_id: str) -> None:
    """The engine sent ``record``'s current attempt (as job ``job_id``)."""
    if _log.isEnabledFor(logging.INFO):
        _log.info(
            "step %s dispatched attempt %d of run %s",
            record.name,
            record.attempt,
            record.run_id,
            extra={
                "event": "step.dispatched",
                "run_id": record.run_id,
                "step_id": record.step_id,
                "attempt": record.attempt,
                "step": record.name,
                "workflow": workflow,
                "job_id": job_id,
                "outcome": None,
            },
        )


def step_applied(
    current: StepFacts,
    following: StepFacts,
    result: StepResult,
    workflow: str | None,
    delay: float,
) -> None:
    """The engine applied ``result`` to ``current``, which became ``following``: the step
    completed, failed for good, or is retried after ``delay`` seconds (logged as ``step
    retried``)."""
    outcome = "retried" if following.attempt != current.attempt else following.status.value
    if outcome == "retried" and _log.isEnabledFor(logging.INFO):
        error = result.error
        _log.info(
            "step %s retried: attempt %d of run %s",
            current.name,
            following.attempt,
            current.run_id,
            extra={
                "event": "step.retried",
                "run_id": current.run_id,
                "step_id": current.step_id,
                "attempt": following.attempt,
                "step": current.name,
                "workflow": workflow,
                "outcome": outcome,
                "error": None if error is None else error.message,
                "delay": delay,
            },
        )
    active = _active
    if active is not None:
        active.step_applied(current.name, outcome)
