"""What the foundation's hooks (:mod:`durable_trio._telemetry`, :mod:`durable_trio._otel`)
read of a run or a step, as protocols: the engine's records have it, and the foundation does
not import the engine (docs/architecture.md, "Layers").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import enum

    from ._wire import JSONValue

__all__ = ["RunFacts", "StepFacts"]


class RunFacts(Protocol):
    """What the hooks read of a run: a :class:`~durable_trio.RunRecord` has it."""

    @property
    def run_id(self) -> str:
        """The run's id."""

    @property
    def workflow(self) -> str:
        """The workflow's name."""

    @property
    def created_at(self) -> float:
        """Store clock: when the run was created."""

    @property
    def updated_at(self) -> float:
        """Store clock: its last change (for a settled run, when it settled)."""

    @property
    def trace(self) -> JSONValue:
        """The trace context stored with the run (``traceparent``, ``tracestate``)."""

    @property
    def error(self) -> JSONValue:
        """A failed run's error (``{"message": ...}``)."""


class StepFacts(Protocol):
    """What the hooks read of a step: a :class:`~durable_trio.StepRecord` has it."""

    @property
    def run_id(self) -> str:
        """The run's id."""

    @property
    def step_id(self) -> str:
        """The step's id within its run."""

    @property
    def name(self) -> str:
        """The step's name."""

    @property
    def attempt(self) -> int:
        """Its current attempt (1 for the first)."""

    @property
    def status(self) -> enum.Enum:
        """Its state (its ``value`` is what the logs say: completed, failed, ...)."""
