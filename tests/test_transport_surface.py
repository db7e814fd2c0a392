"""The public surface of the transport (issue 14, item 2): a small facade, the rest in its
parts (``transport.names``, ``transport.health``, ``transport.remote``). A name added to or
removed from the facade fails here, so the surface only changes on purpose (docs/decisions.md,
"The transport's public surface"); T1 is a section of docs/spec.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

import durable_trio as dt
from durable_trio._naming import QueueNames

if TYPE_CHECKING:
    import trio.testing

#: Every public name of an open ``QueueTransport``, sorted.
TRANSPORT_SURFACE = [
    "aclose",
    "backend",
    "consume",
    "consume_jobs",
    "defer_consumers",
    "dispatch",
    "dispatch_many",
    "handle",
    "health",
    "instance_id",
    "names",
    "on_result",
    "options",
    "publish",
    "publish_result",
    "remote",
    "start_consumers",
    "statistics",
]

#: Every public name of ``transport.health``, sorted.
HEALTH_SURFACE = [
    "group_health",
    "list_worker_descriptors",
    "queue_depth",
    "store_loss",
    "worker_health",
    "worker_status",
]


def public(obj: object) -> list[str]:
    return sorted(name for name in dir(obj) if not name.startswith("_"))


async def test_the_transport_surface_is_pinned(autojump_clock: trio.testing.MockClock) -> None:
    async with dt.open_backend("memory://") as backend:
        async with dt.open_queue_transport(backend, namespace="shop") as transport:
            assert public(transport) == TRANSPORT_SURFACE
            assert public(transport.health) == HEALTH_SURFACE
            for name in ("heartbeat", "on_heartbeat", "send_control", "on_control"):
                assert callable(getattr(transport.remote, name)), name


async def test_the_names_carry_the_partition(autojump_clock: trio.testing.MockClock) -> None:
    """T1: the transport's names route with its ``partition``; ``QueueNames`` without one
    routes as before."""
    async with dt.open_backend("memory://") as backend:
        async with dt.open_queue_transport(
            backend, namespace="shop", partition="tenant 7"
        ) as transport:
            names = transport.names
            assert names.partition == "tenant 7"
            token = names.token_of("charge-card")
            assert token.startswith("charge-card@tenant_7+")
            assert names.task_queue("charge-card") == names.tasks(token) == f"shop:tasks:{token}"
    plain = QueueNames("shop")
    assert plain.partition is None
    assert plain.token_of("charge-card") == "charge-card"
    assert plain.task_queue("evil:name").startswith("shop:tasks:evil_name+")
    assert QueueNames(None).task_queue("x") == "durable:tasks:x"
