"""The engine's errors: a small branch of the package's one tree (:class:`DurableTrioError`).

A run's failure crosses processes as JSON (``{"type", "message", ...}``), so
:class:`RunFailed` carries the failure's *description*, not the original exception object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._errors import ConfigError, DurableTrioError
from ._records import RunDataError

if TYPE_CHECKING:
    from .._wire import StepError

__all__ = [
    "EngineClosed",
    "EngineError",
    "EventTimeout",
    "NonDeterminismError",
    "RunCancelled",
    "RunDataError",
    "RunFailed",
    "RunNotFound",
    "RunNotRetryable",
    "RunNotSignalable",
    "RunTimedOut",
    "SignalDataError",
    "SignalTimeout",
    "StepFailed",
    "StreamError",
    "StreamFull",
    "StreamValueTooLarge",
    "UnknownWorkflow",
    "UpdateError",
    "UpdateFailed",
    "UpdateRejected",
    "UpdateTimeout",
    "run_failure",
]


class EngineError(DurableTrioError):
    """Base class of the engine's own errors."""


class EngineClosed(EngineError):
    """The engine is closed (or closing) and takes no new call."""


class UnknownWorkflow(EngineError, ConfigError):
    """``engine.start`` named a workflow the app does not register."""


class RunNotFound(EngineError, LookupError):
    """No run with this id exists in the run store.

    Attributes:
        run_id: the id asked for.
    """

    def __init__(self, run_id: str) -> None:
        super().__init__(f"no run {run_id!r} in the run store")
        self.run_id = run_id


class RunNotRetryable(EngineError):
    """``retry`` asked for a run that is not failed (only a failed run can be retried).

    Attributes:
        run_id: the id asked for.
        status: the run's status (``"pending"``, ``"completed"``, ...).
    """

    def __init__(self, run_id: str, status: str) -> None:
        super().__init__(f"run {run_id!r} is {status}, not failed: only a failed run is retried")
        self.run_id = run_id
        self.status = status


class StepFailed(EngineError):
    """A step failed for good (attempts exhausted, or a non-retryable error); raised INTO the
    workflow, where user code may catch it (and compensate, fall back, ...).

    Attributes:
        step_name: the step's registered name (``ctx.step``) or label (``ctx.run``).
        step_id: its id inside the run.
        attempts: how many attempts were made.
        error: the last attempt's error (message, code, retryable, details).
    """

    def __init__(self, step_name: str, step_id: str, attempts: int, error: StepError) -> None:
        plural = "s" if attempts != 1 else ""
        super().__init__(
            f"step {step_name!r} (id {step_id}) failed after {attempts} attempt{plural}: "
            f"{error.message}"
        )
        self.step_name = step_name
        self.step_id = step_id
        self.attempts = attempts
        self.error = error


class NonDeterminismError(EngineError):
    """Replay asked for a different step than the run's history holds at that position (or the
    workflow finished while history still held steps it never asked for).

    The run is failed with this error, never silently diverged: a workflow must make the same
    calls in the same order on every replay (see ``docs/engine.md``, "Determinism rules").

    Attributes:
        run_id: the run.
        step_id: the step id where replay and history disagree (``None``: leftover history).
        expected: what history holds there (``"ctx.step('charge')"``; leftover history: the
            calls left), or ``None``.
        found: what the code called there (``None``: it called nothing more).
    """

    def __init__(
        self,
        message: str,
        *,
        run_id: str,
        step_id: str | None,
        expected: str | None = None,
        found: str | None = None,
    ) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.step_id = step_id
        self.expected = expected
        self.found = found


class RunFailed(EngineError):
    """``engine.result`` of a run that failed (or was cancelled, see :class:`RunCancelled`).

    Attributes:
        run_id: the run.
        error: the failure as stored: ``{"type": ..., "message": ..., ...}`` (JSON).
        error_type: the name of the exception that failed the run (``"StepFailed"``,
            ``"NonDeterminismError"``, ``"ValueError"`` ...).
    """

    def __init__(self, run_id: str, error: Any) -> None:
        described = error if isinstance(error, dict) else {"message": str(error)}
        self.run_id = run_id
        self.error: dict[str, Any] = described
        self.error_type: str = str(described.get("type", "Error"))
        message = str(described.get("message", ""))
        super().__init__(f"run {run_id!r} {self._verb}: {self.error_type}: {message}")

    _verb = "failed"


class RunCancelled(RunFailed):
    """``engine.result`` of a run that was cancelled."""

    _verb = "was cancelled"


class RunTimedOut(RunFailed):
    """``engine.result`` of a run that did not end within its ``timeout`` (see
    :meth:`~durable_trio.Engine.start`): the run failed at its deadline, its stored ``error``
    says so (``{"type": "RunTimedOut", "deadline": ..., "timeout": ..., "pending": [...]}``)."""

    _verb = "timed out"


def run_failure(run_id: str, error: Any) -> RunFailed:
    """The exception ``engine.result`` raises for a failed run: :class:`RunTimedOut` when its
    stored error says it timed out, else :class:`RunFailed`."""
    if isinstance(error, dict) and error.get("type") == "RunTimedOut":
        return RunTimedOut(run_id, error)
    return RunFailed(run_id, error)


class SignalTimeout(EngineError, TimeoutError):
    """``ctx.wait_signal(name, timeout=...)`` waited ``timeout`` seconds for no signal (no
    signal consumed). Catch it in the workflow."""

    def __init__(self, message: str, *, name: str = "", timeout: float | None = None) -> None:
        super().__init__(message)
        self.name = name
        self.timeout = timeout


class RunNotSignalable(EngineError):
    """``engine.signal`` to a run that has finished."""


class EventTimeout(EngineError, TimeoutError):
    """``engine.get_event``: the key was not set within the timeout."""


class SignalDataError(EngineError):
    """A signal or event stored in the run store is not valid JSON (damaged data): the run
    waiting on it fails with this error, inspectable with ``runs show``."""


class StreamError(EngineError):
    """An emit could not be appended to its run's stream (docs/engine.md, "Streaming"): the
    run is unknown or has finished, or the emitting code has no run store."""


class StreamFull(StreamError):
    """The run's stream already holds its maximum number of entries: nothing appended."""


class StreamValueTooLarge(StreamError):
    """The emitted value's JSON exceeds the stream's value size bound: nothing appended."""


class UpdateError(EngineError):
    """An update (``engine.update``, docs/engine.md, "Updates") did not return a value."""


class UpdateRejected(UpdateError):
    """The update was refused before it ran: no handler of its name, its validator raised, or
    the run has finished (or finished before it handled it). It left no trace in the
    workflow's history."""


class UpdateFailed(UpdateError):
    """The update's handler raised: the update failed, the workflow goes on.

    Attributes:
        error_type: the class name of what the handler raised.
    """

    def __init__(self, message: str, *, error_type: str = "") -> None:
        super().__init__(message)
        self.error_type = error_type


class UpdateTimeout(UpdateError):
    """The update was not answered within the caller's ``timeout``: it stays in the run's log
    and may still be applied; call again with the same ``update_id`` to get its outcome."""
