"""The engine's reports of a store or broker that fails, folded while it stays down: the
foundation's :class:`~durable_trio._outages.OutageReports` (the workers' finalizes fold theirs
with it too)."""

from __future__ import annotations

from .._outages import PER_WINDOW, WINDOW, OutageReports

__all__ = ["PER_WINDOW", "WINDOW", "OutageReports"]
