"""Telling a Cluster client apart without importing the Cluster code."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import TypeIs

    from ._cluster import RedisClusterClient

__all__ = ["is_cluster_client"]

_CLUSTER_MODULE = f"{__package__}._cluster"


def is_cluster_client(client: object) -> TypeIs[RedisClusterClient]:
    """Whether ``client`` is a :class:`~durable_trio._redis.RedisClusterClient`. The Cluster
    code is imported only for a Cluster URL: while its module is not loaded, no such client
    exists, so a one-node process never loads it for this check."""
    module = sys.modules.get(_CLUSTER_MODULE)
    return module is not None and isinstance(client, module.RedisClusterClient)
