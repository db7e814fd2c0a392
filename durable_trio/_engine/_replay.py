"""Deterministic replay: the run's history, consumed in call order, checked at every call.

A workflow is plain code re-executed from the top whenever an engine (re)starts driving its
run. Each ``ctx.step`` / ``ctx.run`` / ``ctx.sleep`` call takes the next step id (``"1"``,
``"2"`` ...) at CALL time. If history holds a checkpoint under that id, it must be the same kind
of call with the same name — the checkpoint's outcome is then returned without running anything.
Anything else is non-determinism: the run fails with :class:`NonDeterminismError`, naming the
step id, what history holds and what the code asked for; it never silently diverges.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._errors import NonDeterminismError
from ._records import StepKind, step_position

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ._records import StepRecord

__all__ = ["History"]

_CALLS = {
    StepKind.REMOTE: "ctx.step",
    StepKind.LOCAL: "ctx.run",
    StepKind.TIMER: "ctx.sleep",
    StepKind.SIGNAL: "ctx.wait_signal",
    StepKind.EVENT: "ctx.set_event",
    StepKind.PATCH: "ctx.patched",
    StepKind.CANCEL: "cancel",
    StepKind.CONTINUE: "ctx.continue_as_new",
}

PATCH_PREFIX = "patch:"
"""Version markers are stored under ``patch:<change id>``, outside the step numbering: an old
history (recorded without them) keeps the ids of every later step."""


def _describe(kind: StepKind, name: str) -> str:
    return f"{_CALLS[kind]}({name!r})" if kind is not StepKind.TIMER else "ctx.sleep(...)"


class History:
    """A run's checkpoints by step id, and which of them replay has reached so far.

    Args:
        run_id: the run.
        records: its checkpoints (any order).
    """

    def __init__(self, run_id: str, records: Iterable[StepRecord] = ()) -> None:
        self.run_id = run_id
        self._by_id: dict[str, StepRecord] = {}
        self._patches: set[str] = set()
        self.cancel_mark: StepRecord | None = None
        """A cancel delivered inside the workflow before (the run is to end cancelled)."""
        self.continued: StepRecord | None = None
        """The mark that opened this generation (``ctx.continue_as_new``), or ``None``: the
        run's first generation (:mod:`._continue`)."""
        for record in records:
            if record.kind is StepKind.CONTINUE:
                self.continued = record
            elif record.kind is StepKind.PATCH:
                self._patches.add(record.name)
            elif record.kind is StepKind.CANCEL:
                self.cancel_mark = record
            else:
                self._by_id[record.step_id] = record
        self._unvisited: set[str] = set(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id) + len(self._patches)

    @property
    def replaying(self) -> bool:
        """Whether history still holds checkpoints the workflow has not reached again."""
        return bool(self._unvisited)

    def has_patch(self, change_id: str) -> bool:
        """Whether history holds the version marker of ``change_id`` (``ctx.patched``)."""
        return change_id in self._patches

    def add_patch(self, change_id: str) -> None:
        """The marker of ``change_id`` is being recorded now: later calls see it."""
        self._patches.add(change_id)

    def take(self, step_id: str, kind: StepKind, name: str) -> StepRecord | None:
        """The checkpoint the call ``kind(name)`` with ``step_id`` replays, or ``None`` (a new
        step).

        Raises:
            NonDeterminismError: history holds a different call under ``step_id``.
        """
        record = self._by_id.get(step_id)
        if record is None:
            return None
        self.check(record, kind, name)
        self._unvisited.discard(step_id)
        return record

    def check(self, record: StepRecord, kind: StepKind, name: str) -> None:
        """Raise :class:`NonDeterminismError` unless ``record`` is a ``kind(name)`` call."""
        if record.kind is kind and record.name == name:
            return
        raise NonDeterminismError(
            f"non-determinism in run {self.run_id!r} at step {record.step_id}: history holds "
            f"{_describe(record.kind, record.name)}, the workflow now asks for "
            f"{_describe(kind, name)}. A workflow must make the same calls in the same order "
            f"on every replay; branch changed code with ctx.patched (docs/engine.md, Versioning).",
            run_id=self.run_id,
            step_id=record.step_id,
            expected=_describe(record.kind, record.name),
            found=_describe(kind, name),
        )

    def check_exhausted(self) -> None:
        """Called when the workflow returned: every checkpoint must have been reached again.

        Raises:
            NonDeterminismError: history holds steps the workflow no longer asks for.
        """
        if not self._unvisited:
            return
        left = sorted(self._unvisited, key=step_position)
        shown = ", ".join(
            f"{step_id}: {_describe(self._by_id[step_id].kind, self._by_id[step_id].name)}"
            for step_id in left[:5]
        )
        more = f" (and {len(left) - 5} more)" if len(left) > 5 else ""
        raise NonDeterminismError(
            f"non-determinism in run {self.run_id!r}: the workflow finished but history holds "
            f"steps it no longer asks for: {shown}{more}",
            run_id=self.run_id,
            step_id=None,
            expected=shown + more,
            found=None,
        )
