"""What an engine tells the fleet: the workflows it runs, in the key store (issue 30, item 11).

Each engine keeps one key, ``{prefix}-engine:{engine_id}``, holding ``{engineId, app,
workflows, startedAt, host, pid}`` (``workflows``: the names its app registers, sorted). It is
written when the engine starts, again at every lease renewal tick (``run_lease / 3``: no task
of its own), lives ``max(35 s, run_lease)`` unless written again, and is removed when the engine
closes (shielded, bounded by ``cleanup_timeout``). ``durable-trio schedules add`` (without
``--app``) refuses a workflow no live engine of the namespace runs, ``schedules list`` and the
console mark a schedule of such a workflow: :func:`read_engines`, :func:`known_workflows`.
"""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Any, Final

import attrs
import orjson
import trio

from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._errors import BrokerError, DurableTrioError
from .._naming import QueueNames, sanitize_token

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from .._transport._ports import KeyStore
    from ._app import App

__all__ = [
    "EngineAdvert",
    "EngineDescriptor",
    "engine_key",
    "known_workflows",
    "read_engines",
]

#: An engine's key lives at least this long (or a lease) unless written again: as a worker's
#: liveness key, a few missed writes do not make a live engine look gone.
MIN_ADVERT_TTL: Final = 35.0


def engine_key(names: QueueNames, engine_id: str = "") -> str:
    """``{prefix}-engine:{engine_id}`` (``""``: the prefix of every engine's key)."""
    return f"{names.prefix}-engine:{sanitize_token(engine_id) if engine_id else ''}"


@attrs.frozen(repr=False, eq=False)
class EngineDescriptor:
    """One live engine of a namespace, as its key says."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    engine_id: str
    app: str
    workflows: tuple[str, ...]
    """The workflows its app registers, sorted."""
    started_at: float
    """Unix time it started."""
    host: str
    pid: int

    def to_json(self) -> dict[str, Any]:
        """As its key holds it (camelCase, as every ``--json`` output)."""
        return {
            "engineId": self.engine_id,
            "app": self.app,
            "workflows": list(self.workflows),
            "startedAt": self.started_at,
            "host": self.host,
            "pid": self.pid,
        }


class EngineAdvert:
    """One engine's key: written by :meth:`write` (at start and every lease renewal tick),
    removed by :meth:`withdraw` (at close). Best-effort: a key store error is reported once
    until a write works again, and the key simply expires. Without a key store, nothing.

    Args:
        keys: the backend's key store, or ``None``.
        names: the namespace's names.
        engine_id: the engine's id.
        app: its app (name and workflows).
        ttl: how long the key lives unless written again.
        report: the engine's error hook.
    """

    def __init__(
        self,
        keys: KeyStore | None,
        names: QueueNames,
        engine_id: str,
        app: App,
        *,
        ttl: float,
        report: Callable[[BaseException], None],
    ) -> None:
        self._keys = keys
        self._key = engine_key(names, engine_id)
        self.ttl = ttl
        self._report = report
        self._failing = False
        self._withdrawn = False
        self._value = orjson.dumps(
            {
                "engineId": engine_id,
                "app": app.name,
                "workflows": sorted(app.workflows),
                "startedAt": time.time(),
                "host": socket.gethostname(),
                "pid": os.getpid(),
            }
        )
        self.writes = 0
        """Writes that landed."""

    async def write(self) -> None:
        """Write the key (again): it lives :attr:`ttl` more seconds."""
        if self._keys is None or self._withdrawn:
            await trio.lowlevel.checkpoint()
            return
        try:
            await self._keys.put_many([(self._key, self._value, self.ttl)])
        except (BrokerError, DurableTrioError) as exc:
            if not self._failing:  # once per outage: the lease renewal reports the rest
                self._failing = True
                self._report(exc)
            return
        self._failing = False
        self.writes += 1

    async def withdraw(self, bound: float) -> None:
        """Remove the key now (shielded, bounded by ``bound`` seconds: else it expires).
        Idempotent; no write lands after it."""
        if self._keys is None or self._withdrawn:
            return
        self._withdrawn = True
        with trio.move_on_after(bound, shield=True):
            try:
                await self._keys.remove([self._key])
            except (BrokerError, DurableTrioError) as exc:
                self._report(exc)


async def read_engines(keys: KeyStore, names: QueueNames) -> list[EngineDescriptor]:
    """Every live engine of the namespace, by id (from their keys; a damaged key is
    skipped)."""
    prefix = engine_key(names)
    found: list[EngineDescriptor] = []
    for entry in await keys.entries(prefix):
        try:
            raw = orjson.loads(entry.value)
            workflows = raw["workflows"]
            if not isinstance(workflows, list) or not all(isinstance(w, str) for w in workflows):
                continue
            found.append(
                EngineDescriptor(
                    engine_id=str(raw["engineId"]),
                    app=str(raw["app"]),
                    workflows=tuple(workflows),
                    started_at=float(raw["startedAt"]),
                    host=str(raw.get("host", "")),
                    pid=int(raw.get("pid", 0)),
                )
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return sorted(found, key=lambda e: e.engine_id)


def known_workflows(engines: Iterable[EngineDescriptor]) -> frozenset[str] | None:
    """The workflows some live engine runs (``None``: no engine is live, nothing is known)."""
    listed = list(engines)
    if not listed:
        return None
    return frozenset(w for e in listed for w in e.workflows)
