"""Dead-worker reclaim (issue 30, item 9): a worker whose liveness is gone gets its claims taken
back within about ``dead_worker_threshold`` (40 s) instead of the ``stalled_threshold`` (120 s).

A claim's age is the time since its worker last renewed it (T7, docs/spec.md). A worker renews
every ``min(stalled_threshold / 2, dead_worker_threshold / 3)``, so a live worker's claims are
never older than a third of the dead threshold, however long its step runs. The sweep (T9)
then runs a second, shorter pass, every ``dead_worker_threshold / 8``, only while some worker of
the namespace is known dead:

- its liveness is gone: its last status (kept a day) says it beat within the last
  ``stalled_threshold``, but its descriptor key (T13, same time to live as its liveness keys,
  35 s) has expired;
- or its process is known dead: its descriptor names this host and a pid that no longer runs
  (a worker killed with -9 on this machine is noticed at once, before its keys expire).

That pass takes back, on the task queues this instance serves, the claims older than the dead
threshold: only a worker silent that long holds one. A live worker whose descriptor does not
say it renews that often (an older version) turns the pass off for the groups it serves: its
long steps keep the full ``stalled_threshold``. A worker that closed cleanly also leaves no
descriptor and reads as dead for a while: harmless, it holds no claim.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from .._naming import sanitize_token

if TYPE_CHECKING:
    from collections.abc import Iterable

    from .._naming import QueueNames
    from ._ports import KeyStore

__all__ = ["DeadWorkers", "dead_sweep_interval", "process_alive", "renew_period"]

#: A live worker renews its claims at least this many times within the dead threshold.
RENEWALS_PER_THRESHOLD = 3

#: The dead-worker pass runs this many times per dead threshold.
DEAD_CHECKS_PER_THRESHOLD = 8

HOST = socket.gethostname()


def renew_period(stalled_threshold: float, dead_threshold: float | None) -> float:
    """How often a worker renews its claims (see the module docstring)."""
    period = stalled_threshold / 2
    if dead_threshold is not None:
        period = min(period, dead_threshold / RENEWALS_PER_THRESHOLD)
    return period


def dead_sweep_interval(dead_threshold: float) -> float:
    """How often the dead-worker pass runs."""
    return dead_threshold / DEAD_CHECKS_PER_THRESHOLD


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's: it exists
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def descriptor_fields(renew_every: float) -> dict[str, Any]:
    """What a worker's descriptor adds for the dead-worker pass of the others."""
    return {"host": HOST, "pid": os.getpid(), "renewEvery": renew_every}


class DeadWorkers:
    """Reads, from the key store, which workers of the namespace are dead and which groups the
    dead-worker pass may sweep (see the module docstring).

    Args:
        keys: the backend's key store.
        names: the namespace's names.
        instance_id: this instance (never dead to itself).
        dead_threshold: the claims' age the pass takes back.
        window: how recent a last status must be to count (``stalled_threshold``: a worker
            dead longer ago is the plain sweep's).
    """

    def __init__(
        self,
        keys: KeyStore,
        names: QueueNames,
        instance_id: str,
        *,
        dead_threshold: float,
        window: float,
    ) -> None:
        self._keys = keys
        self._names = names
        self._self = sanitize_token(instance_id)
        self.dead_threshold = dead_threshold
        self._window = window
        self._status_prefix = f"{names.prefix}-worker-last-status:"
        self._descriptor_prefix = names.worker_descriptor("")
        self.found: tuple[str, ...] = ()
        """The dead workers the last read found (statistics, tests)."""

    async def sweepable(self, tokens: Iterable[str]) -> set[str]:
        """Those of ``tokens`` whose task queues the dead-worker pass sweeps now (empty when no
        worker is known dead).

        Raises:
            BrokerError: the key store did not answer.
        """
        entries = await self._keys.entries(f"{self._names.prefix}-worker-")
        now = time.time()
        recent: set[str] = set()
        live: dict[str, dict[str, Any]] = {}
        for entry in entries:
            key = entry.key
            try:
                value = orjson.loads(entry.value)
            except orjson.JSONDecodeError:
                continue
            if type(value) is not dict:
                continue
            if key.startswith(self._status_prefix):
                beat = value.get("ts")
                if isinstance(beat, int | float) and beat >= now - self._window:
                    recent.add(key[len(self._status_prefix) :])
            elif key.startswith(self._descriptor_prefix):
                live[key[len(self._descriptor_prefix) :]] = value
        dead = {instance for instance in recent if instance not in live}
        for instance, descriptor in live.items():
            pid = descriptor.get("pid")
            if descriptor.get("host") == HOST and type(pid) is int and not process_alive(pid):
                dead.add(instance)
        dead.discard(self._self)
        self.found = tuple(sorted(dead))
        if not dead:
            return set()
        bound = self.dead_threshold / RENEWALS_PER_THRESHOLD + 1e-9
        out = set()
        for token in tokens:
            slow = [
                d
                for instance, d in live.items()
                if instance not in dead
                and token in (d.get("tokens") or ())
                and not _renews_within(d.get("renewEvery"), bound)
            ]
            if not slow:  # every live worker of the group renews often enough
                out.add(token)
        return out


def _renews_within(renew_every: object, bound: float) -> bool:
    return isinstance(renew_every, int | float) and renew_every <= bound
