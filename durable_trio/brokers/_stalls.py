"""A claim's stall history as the SQL brokers store it: JSON text in one column.

``[{"at": seconds, "worker": id}, ...]``, oldest first, with ``"counted": false`` only on a
stall that did not count towards the poison threshold. SQLite's and PostgreSQL's brokers both
write it with :func:`stalls_json` and read it back with :func:`parse_stalls`, which never
raises: a damaged history reads as ``None`` and the broker sets the claim aside.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

from ._contract import Stall

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["parse_stalls", "stalls_json"]


def parse_stalls(value: object) -> tuple[Stall, ...] | None:
    """The stall history stored as ``value``, or ``None`` if it is not one (damaged)."""
    if type(value) is not str:
        return None
    if value == "[]":
        return ()
    try:
        items = json.loads(value)
    except (ValueError, RecursionError):  # (ValueError: also an int of too many digits)
        return None
    if type(items) is not list:
        return None
    stalls = []
    for item in items:
        if type(item) is not dict:
            return None
        at, worker = item.get("at"), item.get("worker")
        if isinstance(at, bool) or not isinstance(at, (int, float)) or type(worker) is not str:
            return None
        try:
            seconds = float(at)
        except OverflowError:  # an int past a float's range
            return None
        counted = item.get("counted", True)
        if not math.isfinite(seconds) or type(counted) is not bool:
            return None
        stalls.append(Stall(at=seconds, worker=worker, counted=counted))
    return tuple(stalls)


def stalls_json(stalls: Sequence[Stall]) -> str:
    """``stalls`` as stored (``counted`` only when false)."""
    return json.dumps(
        [
            {"at": s.at, "worker": s.worker}
            if s.counted
            else {"at": s.at, "worker": s.worker, "counted": False}
            for s in stalls
        ]
    )
