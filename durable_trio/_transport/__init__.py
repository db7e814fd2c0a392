"""The queue transport: its parts, one concern per module, and the facade over them.

The package's public names are re-exported by :mod:`durable_trio`; inside the project, import
them from here (``from .._transport import QueueTransport``), not from the modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._facade import QueueTransport, open_queue_transport, stalled_threshold_of

if TYPE_CHECKING:
    from ._statistics import TransportStatistics
else:

    def __getattr__(name: str) -> Any:
        # ``TransportStatistics``, imported on first use (PEP 562): only
        # ``QueueTransport.statistics`` builds one.
        if name != "TransportStatistics":
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        from ._statistics import TransportStatistics

        globals()[name] = TransportStatistics
        return TransportStatistics


__all__ = ["QueueTransport", "TransportStatistics", "open_queue_transport", "stalled_threshold_of"]
