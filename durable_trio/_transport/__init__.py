"""The queue transport: its parts, one concern per module, and the facade over them.

The package's public names are re-exported by :mod:`durable_trio`; inside the project, import
them from here (``from .._transport import QueueTransport``), not from the modules.
"""

from __future__ import annotations

from ._facade import (
    QueueTransport,
    TransportStatistics,
    open_queue_transport,
    stalled_threshold_of,
)

__all__ = ["QueueTransport", "TransportStatistics", "open_queue_transport", "stalled_threshold_of"]
