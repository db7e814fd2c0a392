"""Queue and key names (T1, T2, docs/spec.md): every user string made a safe, stable, bounded
key part."""

from __future__ import annotations

import hashlib
import re

__all__ = ["DEFAULT_NAMESPACE", "QueueNames", "sanitize_token", "tenant_group"]

DEFAULT_NAMESPACE = "durable"

#: Characters a plain token may keep. Anything else (":", "{", "}", spaces, "*", "+", "@" ...) is
#: replaced, and a replaced or over-long name gets a hash suffix after "+", a character no plain
#: token contains — so a crafted name can never collide with a sanitized one.
_PLAIN = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")
_MAX_BASE = 48


def sanitize_token(name: str) -> str:
    """Make ``name`` a safe queue-key part: no separators, bounded length, stable, and
    collision-resistant (two different names never map to the same token).

    >>> sanitize_token("charge-card")
    'charge-card'
    >>> sanitize_token("a:b")[:4]
    'a_b+'
    """
    if _PLAIN.fullmatch(name):
        return name
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    base = _UNSAFE.sub("_", name)[:_MAX_BASE]
    return f"{base}+{digest}"


def tenant_group(token: str, partition: str | None) -> str:
    """The routing token of ``token`` inside ``partition`` (a tenant), if any."""
    if not partition:
        return token
    return f"{token}@{sanitize_token(partition)}"


class QueueNames:
    """Every queue name of one namespace (T2: every key of an instance carries the prefix),
    and the routing tokens of one tenant ``partition`` (T1; ``None``: no partition)."""

    def __init__(self, namespace: str | None, partition: str | None = None) -> None:
        self.prefix = sanitize_token(namespace) if namespace else DEFAULT_NAMESPACE
        self.partition = partition
        p = self.prefix
        self.results = f"{p}:results"
        self.heartbeats = f"{p}:heartbeats"
        self.control = f"{p}:control"
        self.decisions = f"{p}:decisions"
        self.step_events = f"{p}:step-events"
        self.start_run = f"{p}:start-run"
        self.run_request = f"{p}:run-request"
        self.registrations = f"{p}:inbox-registrations"

    def tasks(self, token: str) -> str:
        """T1: ``{prefix}:tasks:{token}``."""
        return f"{self.prefix}:tasks:{token}"

    def token_of(self, group: str) -> str:
        """The routing token of a step name or group, inside :attr:`partition` (T1)."""
        return tenant_group(sanitize_token(group), self.partition)

    def task_queue(self, group: str) -> str:
        """The task queue a step name or group routes to (T1): ``tasks(token_of(group))``."""
        return self.tasks(self.token_of(group))

    def run_replies(self, instance: str) -> str:
        return f"{self.prefix}:run-replies:{sanitize_token(instance)}"

    def tenant_events(self, instance: str) -> str:
        return f"{self.prefix}:tenant-events:{sanitize_token(instance)}"

    def worker_heartbeat(self, token: str, instance: str) -> str:
        """T11: ``{prefix}-worker-heartbeat:{token}:{instance}`` (``instance=""``: the prefix
        of every live worker of ``token``)."""
        suffix = sanitize_token(instance) if instance else ""
        return f"{self.prefix}-worker-heartbeat:{token}:{suffix}"

    def inbox(self, instance: str) -> str:
        """T22: ``{prefix}-inbox:{instance}``, a recorded inbox registration (``""``: all)."""
        suffix = sanitize_token(instance) if instance else ""
        return f"{self.prefix}-inbox:{suffix}"

    def worker_last_status(self, instance: str) -> str:
        """``{prefix}-worker-last-status:{instance}``: a worker's last liveness snapshot, kept a
        day after it stops beating, so a poison job can name what its workers looked like."""
        return f"{self.prefix}-worker-last-status:{sanitize_token(instance)}"

    def worker_descriptor(self, instance: str) -> str:
        """T13: ``{prefix}-worker-descriptor:{instance}`` (``""``: every descriptor)."""
        suffix = sanitize_token(instance) if instance else ""
        return f"{self.prefix}-worker-descriptor:{suffix}"
