"""What a ``worker --processes`` supervisor tells the fleet: its slots, in the key store.

The supervisor (:mod:`durable_trio._supervisor`) writes one key per supervisor,
``{prefix}-supervisor:{host:pid}``, holding every slot (its child, restarts, crash loop, last
exit); ``durable-trio health``, the operations and the console read them here (issue 30: a
crash-looping child is shown, never given up silently).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import orjson

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._naming import QueueNames
    from ._ports import KeyStore

__all__ = ["SupervisedSlot", "crash_loop_lines", "read_supervisors", "supervisor_key"]


@attrs.frozen
class SupervisedSlot:
    """One slot of a supervisor, as its key in the key store says (``durable-trio health``)."""

    supervisor: str
    """The supervisor's id (``host:pid``)."""
    slot: int
    pid: int | None
    """Its child's pid (``None`` while it waits out a backoff)."""
    instance_id: str
    restarts: int
    crash_looping: bool
    last_exit: int | None
    last_exit_at: float | None
    deaths: int
    """Deaths within the policy's ``crash_window``."""
    window: float


def supervisor_key(names: QueueNames, supervisor_id: str = "") -> str:
    """``{prefix}-supervisor:{host:pid}``: a ``--processes`` supervisor's slots (``""``: the
    prefix of every supervisor's key)."""
    return f"{names.prefix}-supervisor:{supervisor_id}"


async def read_supervisors(keys: KeyStore, names: QueueNames) -> list[SupervisedSlot]:
    """Every slot of every live ``--processes`` supervisor of the namespace (from their keys;
    a damaged key is skipped)."""
    prefix = supervisor_key(names)
    out: list[SupervisedSlot] = []
    for entry in await keys.entries(prefix):
        try:
            state = orjson.loads(entry.value)
            for raw in state["slots"]:
                out.append(
                    SupervisedSlot(
                        supervisor=str(state["supervisor"]),
                        slot=int(raw["slot"]),
                        pid=None if raw.get("pid") is None else int(raw["pid"]),
                        instance_id=str(raw["instance"]),
                        restarts=int(raw["restarts"]),
                        crash_looping=bool(raw["crashLooping"]),
                        last_exit=None if raw.get("lastExit") is None else int(raw["lastExit"]),
                        last_exit_at=(
                            None if raw.get("lastExitAt") is None else float(raw["lastExitAt"])
                        ),
                        deaths=int(raw.get("deaths", 0)),
                        window=float(raw.get("window", 0.0)),
                    )
                )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return sorted(out, key=lambda s: (s.supervisor, s.slot))


def crash_loop_lines(slots: Sequence[SupervisedSlot]) -> list[str]:
    """One line per crash-looping slot, with its last exit status."""
    return [
        f"crash-looping: worker process {s.slot} of supervisor {s.supervisor}: {s.deaths} "
        f"deaths within {s.window:g} s, last exit status {s.last_exit}, restarted "
        f"{s.restarts} time(s) (instance {s.instance_id})"
        for s in slots
        if s.crash_looping
    ]
