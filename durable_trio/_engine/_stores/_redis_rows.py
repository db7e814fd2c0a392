"""Reading the Redis run store's hashes back into records: a hash that is missing a field or
holds one that cannot be read (a bad restore, an operator's write) is a
:class:`~durable_trio.RunDataError`, as a damaged row is in the SQL stores; advisory fields
(a trace, a last beat, the attempt log) read as absent instead."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import orjson

from .._records import (
    DamagedRun,
    RunDataError,
    RunRecord,
    RunStatus,
    StepKind,
    StepRecord,
    StepState,
    first_or_later,
    read_attempt_log,
    read_trace,
)
from .._tags import read_tags

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["fields", "number", "opt_float", "read_listed", "read_run", "read_step", "tag_index"]


def a_float(raw: bytes) -> float:
    """A stored time or number of seconds; ``nan`` (which ``float`` reads) is no number: a
    ``ValueError``, which the row mappers make a :class:`RunDataError`."""
    value = float(raw)
    if value != value:
        raise ValueError(f"{raw!r} is not a number")
    return value


def opt_float(raw: bytes | None) -> float | None:
    return a_float(raw) if raw else None


def fields(reply: list[Any]) -> dict[bytes, bytes]:
    return {reply[i]: reply[i + 1] for i in range(0, len(reply), 2)}


def read_run(run_id: str, f: dict[bytes, bytes]) -> RunRecord:
    """The run of a hash; :class:`RunDataError` if a field is missing or cannot be read
    (damaged: a bad restore, an operator's write), as the SQL stores answer."""
    try:
        return _run(run_id, f)
    except (KeyError, ValueError, TypeError) as exc:  # (JSON and UTF-8 errors are ValueErrors)
        raise RunDataError(f"run {run_id!r}: its stored hash cannot be read ({exc!r})") from exc


def read_listed(
    hashes: Iterable[tuple[str, dict[bytes, bytes]]],
) -> tuple[list[RunRecord], list[DamagedRun]]:
    """The runs of a listing's ``(run id, hash)`` pairs, and each hash that cannot be read as
    a :class:`DamagedRun`: one damaged hash is named, never fails the listing."""
    runs: list[RunRecord] = []
    damaged: list[DamagedRun] = []
    for run_id, f in hashes:
        try:
            runs.append(read_run(run_id, f))
        except RunDataError as exc:
            damaged.append(DamagedRun(run_id, str(exc)))
    return runs, damaged


def number(f: dict[bytes, bytes], field: bytes) -> float:
    """A numeric field of a damaged hash, as far as it can be read (0 if not)."""
    try:
        value = float(f[field])
    except (KeyError, ValueError):
        return 0.0
    return value if math.isfinite(value) else 0.0


def read_step(run_id: str, step_id: str, f: dict[bytes, bytes]) -> StepRecord:
    """The checkpoint of a hash; :class:`RunDataError` if a field cannot be read."""
    try:
        return _step(run_id, step_id, f)
    except (KeyError, ValueError, TypeError) as exc:
        raise RunDataError(
            f"run {run_id!r}: its stored checkpoint {step_id!r} cannot be read ({exc!r})"
        ) from exc


def _run(run_id: str, f: dict[bytes, bytes]) -> RunRecord:
    return RunRecord(
        run_id=run_id,
        workflow=f[b"workflow"].decode(),
        input=orjson.loads(f[b"input"]),
        status=RunStatus(f[b"status"].decode()),
        created_at=a_float(f[b"created"]),
        updated_at=a_float(f[b"updated"]),
        output=orjson.loads(f[b"output"]),
        error=orjson.loads(f[b"error"]),
        owner=f[b"owner"].decode() or None,
        lease_until=opt_float(f[b"lease"]),
        timeout=opt_float(f.get(b"timeout")),  # absent: a run stored before timeouts
        trace=read_trace(f.get(b"trace")),  # absent: a run stored before traces
        parent=f.get(b"parent", b"").decode() or None,  # absent: stored before children
        depth=int(f.get(b"depth", b"0")),  # absent: stored before the depth limit
        tags=read_tags(f.get(b"tags")),  # absent: stored before tags (issue 34)
    )


def _step(run_id: str, step_id: str, f: dict[bytes, bytes]) -> StepRecord:
    priority = f.get(b"priority")
    return StepRecord(
        run_id=run_id,
        step_id=step_id,
        kind=StepKind(f[b"kind"].decode()),
        name=f[b"name"].decode(),
        status=StepState(f[b"status"].decode()),
        attempt=first_or_later(int(f[b"attempt"])),
        input=orjson.loads(f[b"input"]),
        output=orjson.loads(f[b"output"]),
        error=orjson.loads(f[b"error"]),
        retry=orjson.loads(f[b"retry"]),
        wake_at=opt_float(f.get(b"wake_at")),
        dispatched=f.get(b"dispatched") == b"1",
        priority=int(priority) if priority else None,
        created_at=a_float(f[b"created"]),
        updated_at=a_float(f[b"updated"]),
        # absent: a step stored before heartbeats
        heartbeat_timeout=opt_float(f.get(b"hb_timeout")),
        heartbeat=_beat(f.get(b"heartbeat")),
        attempts=read_attempt_log(f.get(b"attempts")),  # absent: a step stored before them
    )


def _beat(raw: bytes | None) -> Any:
    """A stored last beat; advisory, so a damaged one reads as none."""
    if not raw:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def tag_index(prefix: str, key: str, value: str) -> str:
    """A shard's index of the runs tagged ``key=value`` (a key holds no ``:``, issue 34)."""
    return f"{prefix}:tag:{key}:{value}"
