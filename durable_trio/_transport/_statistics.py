"""The snapshot :meth:`QueueTransport.statistics` returns.

Apart from the facade so that a transport starts without it: it is imported by the first
:meth:`QueueTransport.statistics` (an operator's or a test's call), not by every worker and
engine (attrs building a class is most of what the transport's modules cost at import).
"""

from __future__ import annotations

import attrs

from .._attrs_shared import shared_eq, shared_hash, shared_repr

__all__ = ["TransportStatistics"]


@attrs.frozen(repr=False, eq=False)
class TransportStatistics:
    """A snapshot of one transport's state."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    in_flight: int
    """Job handlers running now (every queue)."""
    open_claims: int
    """Claims this instance holds (running, finalizing or awaiting handback)."""
    task_limit: int
    """The step concurrency limit."""
    duplicates: int
    """Times a job's lease was lost while its handler ran."""
    queues: tuple[str, ...]
    """Every queue this instance consumes."""
    closed: bool
