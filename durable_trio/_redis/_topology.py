"""The Cluster's slot map, read from ``CLUSTER SHARDS`` (Redis 7) or ``CLUSTER SLOTS``.

Both replies are parsed into one :class:`SlotMap`: which master serves each of the 16384 slots
(its ``host:port``), and the replicas known for it. A reply of the wrong shape (a proxy that
answers something else, a damaged reply) is a :class:`~durable_trio._errors.BrokerError` naming
what was wrong, never an ``IndexError`` in a background task.
"""

from __future__ import annotations

from typing import Any

import attrs

from .._errors import BrokerError
from ._errors import RedisClusterTLSMismatch
from ._keyslot import SLOTS

__all__ = ["Node", "SlotMap", "parse_shards", "parse_slots"]


@attrs.frozen(cache_hash=True)  # a key of the client's pool and map lookups on every command
class Node:
    """One node of the cluster, as the slot map names it.

    Attributes:
        host: its host (the node's announced endpoint, or the host the map was asked of when
            the node does not know its own: an empty or ``?`` endpoint).
        port: its port (the TLS port when the map was read for TLS and the node has one).
    """

    host: str
    port: int

    @property
    def address(self) -> str:
        """``host:port`` (``[v6]:port`` for an IPv6 address)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@attrs.frozen
class SlotMap:
    """Who serves which slot.

    Attributes:
        owners: one entry per slot: the master serving it, or ``None`` (uncovered).
        replicas: ``master -> its replicas``, as listed by the reply.
    """

    owners: tuple[Node | None, ...]
    replicas: dict[Node, tuple[Node, ...]] = attrs.field(factory=dict)

    @property
    def masters(self) -> tuple[Node, ...]:
        """The masters that serve at least one slot, each once, in slot order."""
        return tuple(dict.fromkeys(node for node in self.owners if node is not None))


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, str | int):
        return str(value)
    raise TypeError(f"not a string: {value!r:.40}")


def _range(start: Any, end: Any) -> range:
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end < SLOTS):
        raise ValueError(f"not a slot range: {start!r:.20}-{end!r:.20}")
    return range(start, end + 1)


def _fill(ranges: list[tuple[range, Node, tuple[Node, ...]]]) -> SlotMap:
    owners: list[Node | None] = [None] * SLOTS
    replicas: dict[Node, tuple[Node, ...]] = {}
    for slots, master, followers in ranges:
        for slot in slots:
            owners[slot] = master
        replicas[master] = followers
    return SlotMap(owners=tuple(owners), replicas=replicas)


def _host(endpoint: str, asked: str) -> str:
    return asked if endpoint in ("", "?") else endpoint


def parse_shards(
    reply: Any, *, asked: str, tls: bool = False, asked_port: int | None = None
) -> SlotMap:
    """Parse a ``CLUSTER SHARDS`` reply (RESP2: each shard and node a flat key/value list).

    Args:
        reply: the reply.
        asked: the host the command was sent to (for nodes that announce no endpoint).
        tls: take each node's ``tls-port`` (when it has one) instead of its ``port``.
        asked_port: the port the command was sent to over TLS, to tell a cluster without
            ``tls-cluster yes`` (below); ``None``: not checked.

    Returns:
        the map; a shard whose master is marked failed is left uncovered.

    Raises:
        BrokerError: the reply is not a ``CLUSTER SHARDS`` reply.
        RedisClusterTLSMismatch: read over TLS on ``asked:asked_port``, the reply names no
            ``tls-port`` and lists ``asked``'s host only on other ports: the node answered on
            its TLS port but announces its plain one (``tls-cluster no``). A cluster that
            announces the port it was reached on (TLS on the main port, as hosted services
            run it) or nodes on other hosts (announced addresses) are not refused.
    """
    announced_tls = False
    nodes: set[Node] = set()
    try:
        ranges = []
        for shard in reply:
            fields = dict(zip(shard[::2], shard[1::2], strict=True))
            bounds = fields[b"slots"]
            master: Node | None = None
            followers = []
            for entry in fields[b"nodes"]:
                info = {_text(k): v for k, v in zip(entry[::2], entry[1::2], strict=True)}
                announced_tls = announced_tls or "tls-port" in info
                port = info["tls-port"] if tls and "tls-port" in info else info["port"]
                endpoint = _text(info.get("endpoint", info.get("ip", "")))
                node = Node(host=_host(endpoint, asked), port=int(port))
                nodes.add(node)
                healthy = _text(info.get("health", b"online")) != "fail"
                if _text(info["role"]) == "master" and healthy:
                    master = node
                else:
                    followers.append(node)
            if master is None:
                continue
            for index in range(0, len(bounds), 2):
                ranges.append((_range(bounds[index], bounds[index + 1]), master, tuple(followers)))
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise BrokerError(f"not a CLUSTER SHARDS reply from {asked}: {exc}") from exc
    if tls and asked_port is not None and not announced_tls:
        here = Node(asked, asked_port)
        same_host = sorted(node.port for node in nodes if node.host == asked)
        if here not in nodes and same_host:
            raise RedisClusterTLSMismatch(
                f"the Redis Cluster node at {here.address} answered over TLS, but its slot map "
                f"names no TLS port (only {asked} ports {', '.join(map(str, same_host))}): a "
                "rediss+cluster:// client needs tls-cluster yes on every node, so that they "
                "announce their TLS ports"
            )
    return _fill(ranges)


def parse_slots(reply: Any, *, asked: str) -> SlotMap:
    """Parse a ``CLUSTER SLOTS`` reply (for servers before Redis 7, which lack ``SHARDS``).

    Args:
        reply: the reply: ``[[start, end, [host, port, id, ...], replica..., ...], ...]``.
        asked: the host the command was sent to (for nodes that announce no endpoint).

    Returns:
        the map.

    Raises:
        BrokerError: the reply is not a ``CLUSTER SLOTS`` reply.
    """
    try:
        ranges = []
        for entry in reply:
            nodes = [
                Node(host=_host(_text(node[0]), asked), port=int(node[1])) for node in entry[2:]
            ]
            ranges.append((_range(entry[0], entry[1]), nodes[0], tuple(nodes[1:])))
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise BrokerError(f"not a CLUSTER SLOTS reply from {asked}: {exc}") from exc
    return _fill(ranges)
