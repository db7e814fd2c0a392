"""Continue-as-new's values (issue 34, item 5): the exception, and the mark of a generation.

``ctx.continue_as_new(input)`` raises :class:`ContinueAsNew`; the driver catches it and, in one
atomic store change, moves the run's history to a numbered previous generation, writes the mark
that opens the next one (step id ``continue:run``, outside the step numbering) and sets the
run's input: the run goes on under the same id from the top of its workflow, with a history of
one mark. The mark's input says where the new generation starts:

- ``generation``: its number (the run's first generation is 0 and has no mark);
- ``lastStep``: the last step number the run used before it: the new generation numbers its
  steps on from there, so no step id (no job, no attempt, no late result) of an earlier
  generation is ever one of its own;
- ``signals``: how many signals of each name the run consumed before it: a signal sent and not
  consumed carries over (its next ``ctx.wait_signal`` takes it, in order);
- ``input``: its input (the run's input while it is the current one).

The first generation (0) gets a mark too, written just before its history moves (so its input
is kept with it); a mark of generation 0 in a current history means what no mark means.
"""

from __future__ import annotations

from typing import Any, Final

import attrs
import orjson

from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._wire import JSONValue
from ._records import RunDataError, StepKind, StepRecord, StepState

__all__ = [
    "CONTINUE_STEP_ID",
    "Continuation",
    "ContinueAsNew",
    "continuation_of",
    "current_generation",
    "expected_generation",
]

CONTINUE_STEP_ID: Final = "continue:run"
"""The step id of a generation's mark."""


class ContinueAsNew(BaseException):
    """Raised by ``ctx.continue_as_new(input)``: end this generation, start the next one.

    A ``BaseException``, as ``trio.Cancelled``: a workflow's ``except Exception`` does not
    swallow it. Raise it (call ``continue_as_new``) from the workflow's own flow, not from inside
    a ``ctx.gather`` or a nursery of the workflow.
    """

    def __init__(self, input: JSONValue) -> None:
        super().__init__("continue as new")
        self.input = input


@attrs.frozen(repr=False, eq=False)
class Continuation:
    """Where a generation starts (the input of its mark, see the module docstring)."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    generation: int = 0
    last_step: int = 0
    signals: dict[str, int] = attrs.field(factory=dict)
    input: JSONValue = None
    """The generation's input (kept in its mark, so a previous generation shows it)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "lastStep": self.last_step,
            "signals": self.signals,
            "input": self.input,
        }

    def mark(self, run_id: str) -> StepRecord:
        """The mark that opens this generation of run ``run_id``."""
        return StepRecord(
            run_id=run_id,
            step_id=CONTINUE_STEP_ID,
            kind=StepKind.CONTINUE,
            name="continue",
            status=StepState.COMPLETED,
            input=self.to_json(),
        )


def continuation_of(mark: StepRecord | None) -> Continuation:
    """The start of the generation ``mark`` opened (``None``: the first generation)."""
    if mark is None or not isinstance(mark.input, dict):
        return Continuation()
    data = mark.input
    signals = data.get("signals")
    try:
        return Continuation(
            generation=int(data.get("generation") or 0),
            last_step=int(data.get("lastStep") or 0),
            signals=(
                {str(k): int(v) for k, v in signals.items()} if isinstance(signals, dict) else {}
            ),
            input=data.get("input"),
        )
    except (ValueError, TypeError, OverflowError) as exc:  # JSON, of the wrong shape (damaged)
        raise RunDataError(
            f"run {mark.run_id!r}: its continue-as-new mark cannot be read ({exc})"
        ) from exc


def expected_generation(mark: StepRecord) -> int:
    """The generation a run must be in for ``mark`` to open the next one."""
    return continuation_of(mark).generation - 1


def current_generation(mark_input: Any) -> int:
    """The generation of a run whose history's mark has input ``mark_input`` (JSON text, or
    ``None``: no mark, the first generation)."""
    if mark_input is None:
        return 0
    try:
        data = orjson.loads(mark_input) if isinstance(mark_input, (str, bytes)) else mark_input
    except orjson.JSONDecodeError:
        return -1  # damaged: never continued
    if not isinstance(data, dict):
        return -1
    try:
        return int(data.get("generation") or 0)
    except (ValueError, TypeError, OverflowError):
        return -1  # damaged as well: a number that is none
