"""One duplicate explained (:class:`DuplicateResult`): what :meth:`Engine.duplicates` lists.

Apart from :mod:`._duplicates` (the log every engine keeps) so that an engine starts without
it: it is imported by the first duplicate recorded (a lost lease, then its job's second
completion), or by the package's lazy export.
"""

from __future__ import annotations

from typing import Any

import attrs

from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._wire import JSONValue

__all__ = ["DuplicateResult"]


@attrs.frozen(repr=False, eq=False)
class DuplicateResult:
    """A completed result that arrived for an attempt already completed, and why.

    The first result applied stays (application is idempotent); this one changed nothing."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    run_id: str
    step_id: str
    attempt: int
    at: float
    """Store clock, when this engine met the copy."""
    cause: str
    """Why the step completed twice, in words (see :func:`explain`)."""
    lost: tuple[JSONValue, ...] = ()
    """The leases lost between the two deliveries: ``{"worker", "at"}`` each, oldest first
    (``at``: broker clock, when the sweep reclaimed the job from ``worker``)."""
    applied: JSONValue = None
    """The delivery evidence of the result that was applied (``None``: not known here, e.g.
    another engine applied it, or a worker that sends no evidence)."""
    duplicate: JSONValue = None
    """The delivery evidence of this copy."""

    def to_json(self) -> dict[str, Any]:
        """The entry as JSON (status pages, logs)."""
        return {
            "runId": self.run_id,
            "stepId": self.step_id,
            "attempt": self.attempt,
            "at": self.at,
            "cause": self.cause,
            "lost": list(self.lost),
            "applied": self.applied,
            "duplicate": self.duplicate,
        }
