"""Health: the concurrency limit (T6), worker status, group health (T12), descriptors (T13);
the ids are sections of docs/spec.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
import trio

from ..brokers import SupportsQueueListing, SupportsSize, SupportsStoreIdentity
from ._liveness import GroupHealth, WorkerDescriptor, read_group_health

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._errors import StoreLost
    from .._naming import QueueNames
    from .._wire import WorkerStatus
    from ._adaptive import ConcurrencyController
    from ._options import TransportOptions
    from ._ports import KeyEntry, TransportBackend

__all__ = ["TransportHealth", "read_orphaned_queues", "read_store_loss", "read_worker_health"]


class TransportHealth:
    """The health reads of one transport, as ``transport.health``: its own worker status, and
    the depth, live workers and descriptors of a group, read from its backend's broker and key
    store (T6, T12, T13)."""

    def __init__(
        self,
        backend: TransportBackend,
        names: QueueNames,
        options: TransportOptions,
        controller: ConcurrencyController,
    ) -> None:
        self._backend = backend
        self._names = names
        self._options = options
        self._controller = controller
        self._descriptor_cache: tuple[float, Sequence[KeyEntry]] | None = None

    def worker_status(self) -> WorkerStatus:
        """This instance's liveness snapshot (what its heartbeats carry)."""
        return self._controller.snapshot()

    async def queue_depth(self, group: str) -> int | None:
        """Jobs waiting on ``group``'s task queue, or ``None`` if the broker cannot count."""
        broker = self._backend.broker
        if not isinstance(broker, SupportsSize):
            return None
        return await broker.size_of(self._names.task_queue(group))

    async def group_health(self, group: str) -> GroupHealth | None:
        """T12: the group's depth and its live workers (with their headroom and p95).

        Returns:
            ``None`` without a key store: no worker can advertise liveness then, and "a
            backlog and zero workers" would be a false alarm.
        """
        keys = self._backend.keys
        if keys is None:
            return None
        token = self._names.token_of(group)
        depth = await self.queue_depth(group) or 0
        return await read_group_health(keys, self._names, token, depth)

    async def store_loss(self) -> StoreLost | None:
        """The loss of the store's data that stands, until acknowledged (see
        :func:`read_store_loss`)."""
        return await read_store_loss(self._backend)

    async def worker_health(self) -> list[GroupHealth] | None:
        """Every group that has a live worker (by routing token), with its depth."""
        return await read_worker_health(self._backend, self._names)

    async def list_worker_descriptors(self, group: str) -> list[WorkerDescriptor]:
        """T13: the live descriptors of the workers serving ``group``, read through a short
        cache (``descriptor_cache`` seconds, default 5)."""
        keys = self._backend.keys
        if keys is None:
            return []
        now = trio.current_time()
        cached = self._descriptor_cache
        if cached is None or now - cached[0] >= self._options.descriptor_cache:
            cached = self._descriptor_cache = (
                now,
                await keys.entries(self._names.worker_descriptor("")),
            )
        token = self._names.token_of(group)
        found = []
        for entry in cached[1]:
            try:
                raw = orjson.loads(entry.value)
                if token in raw["tokens"]:
                    found.append(
                        WorkerDescriptor(
                            raw["instance"],
                            tuple(raw["tokens"]),
                            tuple(raw["steps"]),
                            raw["startedAt"],
                        )
                    )
            except (orjson.JSONDecodeError, KeyError, TypeError):
                continue
        return found


async def read_worker_health(
    backend: TransportBackend, names: QueueNames
) -> list[GroupHealth] | None:
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


async def read_orphaned_queues(
    backend: TransportBackend, names: QueueNames, served: list[GroupHealth]
) -> list[GroupHealth]:
    """The task queues of ``names``' namespace that hold waiting jobs but are served by none
    of ``served`` (the groups with a live worker): a misspelt step name, a worker never
    deployed, or every worker of a queue gone. Each as a group with its depth and no live
    worker, by token.

    Returns:
        ``[]`` when the broker cannot list its queues
        (:class:`~durable_trio.brokers.SupportsQueueListing`).

    Raises:
        BrokerError: the broker did not answer.
    """
    broker = backend.broker
    if not isinstance(broker, SupportsQueueListing):
        return []
    prefix = names.tasks("")
    live = {g.group for g in served if g.live_workers}
    orphans = []
    for queue in await broker.waiting_queues(prefix):
        token = queue[len(prefix) :]
        if token in live:
            continue
        depth = await broker.size_of(queue) if isinstance(broker, SupportsSize) else 0
        if depth:
            orphans.append(GroupHealth(token, depth, ()))
    return orphans


async def read_store_loss(backend: TransportBackend) -> StoreLost | None:
    """The loss of the store's data that stands: the store was emptied or replaced under a
    running process (:class:`~durable_trio.StoreLost`), kept until an operator acknowledges it;
    ``None`` when none stands or the broker cannot tell
    (:class:`~durable_trio.brokers.SupportsStoreIdentity`).

    Raises:
        BrokerError: the broker did not answer.
    """
    broker = backend.broker
    if not isinstance(broker, SupportsStoreIdentity):
        return None
    return await broker.read_store_loss()
