"""Health: the concurrency limit (T6), worker status, group health (T12), descriptors (T13);
the ids are sections of docs/spec.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._liveness import (
    GroupHealth,
    read_group_health,
)
from .adapters import (
    SupportsSize,
)

if TYPE_CHECKING:
    from ._naming import QueueNames
    from .backends._backend import Backend




async def read_worker_health(backend: Backend, names: QueueNames) -> list[GroupHealth] | None:
    """Every group of ``names``' namespace that has a live worker, with its depth: read from
    the backend's key store and broker alone (no transport, no writes), so a health view or an
    exporter can read it as often as it likes.

    Returns:
        ``None`` without a key store (no worker can advertise liveness then).

    Raises:
        BrokerError: the key store or the broker did not answer.
    """
    keys = backend.keys
    if keys is None:
        return None
    marker = names.worker_heartbeat("", "").removesuffix(":")
    tokens = sorted({e.key[len(marker) :].rsplit(":", 1)[0] for e in await keys.entries(marker)})
    broker = backend.broker
    health = []
    for token in tokens:
        queue = names.tasks(token)
        depth = await broker.size_of(queue) if isinstance(broker, SupportsSize) else 0
        health.append(await read_group_health(keys, names, token, depth))
    return health
