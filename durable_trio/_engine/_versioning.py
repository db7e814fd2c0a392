"""Versioning (issue 18, item 5): blocked runs and how they resume.

``ctx.patched`` / ``ctx.deprecate_patch`` live on :class:`~._context.WorkflowContext` and
:class:`~._replay.History` (markers ``patch:<change id>``, outside the step numbering). This
module holds what happens when replay still diverges: the run is parked ``blocked`` instead of
failed for good, with the diff of what history holds against what the code asked for, and the
fingerprint of the workflow code it blocked on. It resumes:

- on its own, local workflows: an engine whose code of that workflow has another fingerprint
  retries it (reopens it; its reconcile replays it) at its start and at every reconcile;
- on its own, remote workflows (the engine does not hold their code): an engine retries a run
  blocked for longer than ``BLOCKED_PROBE`` seconds (one probing turn; a worker still running
  the old code parks it again, with a fresh time);
- on ``runs retry`` (``Engine.retry``, ``Operations.retry_run``), whatever the code.
"""

from __future__ import annotations

import hashlib
import types
from typing import TYPE_CHECKING, Any, Final

from ._errors import NonDeterminismError, RunNotFound, RunNotRetryable
from ._records import RunStatus
from ._reopen import retry_run

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._app import App
    from ._stores import RunStore

__all__ = ["BLOCKED_PROBE", "blocked_error", "code_fingerprint", "is_blocking", "resume_blocked"]

BLOCKED_PROBE: Final = 300.0
"""Seconds a blocked remote run waits before an engine probes it again with a turn."""

_SCAN_LIMIT: Final = 1000


def _code_parts(code: types.CodeType, out: list[str]) -> None:
    out.append(code.co_code.hex())
    out.append(repr(code.co_names))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code_parts(const, out)
        else:
            out.append(repr(const))


def code_fingerprint(fn: Callable[..., Any] | None) -> str | None:
    """A short digest of the workflow function's code (bytecode, names, constants, nested
    functions, and the plain values it closes over): the same code gives the same digest in
    every process of one Python version. ``None``: no code here (a remote workflow)."""
    if fn is None:
        return None
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return None
    parts: list[str] = []
    _code_parts(code, parts)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if value is None or isinstance(value, str | int | float | bool):
            parts.append(repr(value))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def is_blocking(error: Any) -> bool:
    """Whether a run failure (as stored) is non-determinism: the run is parked, not failed."""
    return isinstance(error, dict) and error.get("type") == "NonDeterminismError"


def blocked_error(exc: NonDeterminismError, fingerprint: str | None) -> dict[str, Any]:
    """The error a blocked run stores: the message, the step id, the diff (``expected``: what
    history holds there, ``found``: what the code called) and the code's fingerprint."""
    return {
        "type": "NonDeterminismError",
        "message": str(exc),
        "stepId": exc.step_id,
        "expected": exc.expected,
        "found": exc.found,
        "fingerprint": fingerprint,
    }


async def resume_blocked(store: RunStore, app: App, now: float) -> list[str]:
    """Retry the blocked runs that code here may now replay (see the module docstring).

    Returns:
        The ids of the runs reopened.
    """
    reopened: list[str] = []
    blocked = await store.list_runs(status=RunStatus.BLOCKED, limit=_SCAN_LIMIT)
    for run in blocked:
        definition = app.workflows.get(run.workflow)
        if definition is None:
            continue
        stored = run.error.get("fingerprint") if isinstance(run.error, dict) else None
        if definition.fn is not None:
            if code_fingerprint(definition.fn) == stored:
                continue
        elif now - run.updated_at < BLOCKED_PROBE:
            continue
        try:
            await retry_run(store, run.run_id)
        except (RunNotFound, RunNotRetryable):  # resumed or cancelled meanwhile
            continue
        reopened.append(run.run_id)
    return reopened
