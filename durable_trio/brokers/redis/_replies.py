"""The Redis broker's reply parsers: what a script returned, or a record read back, made into
the contract's types (:class:`~durable_trio.brokers.ClaimedJob`,
:class:`~durable_trio.brokers.FailedJob`, ...). Each is the one validating decode of its
reply: whatever is stored, it returns a value (a damaged field flags the result), never raises.
"""

from __future__ import annotations

import math
import re
from typing import Any, Final

import orjson

from .._contract import ClaimedJob, FailedJob, JobState, Lease, QuarantinedEntry, Stall
from ._queue import MAX_PRIORITY, MIN_PRIORITY

__all__ = [
    "read_claim",
    "read_claims",
    "read_failed",
    "read_failed_key",
    "read_job_state",
    "read_job_states",
    "read_quarantined",
    "read_seconds",
    "read_stalls",
]

#: A meta value: "priority:attempts:stalled_count:id" (ASCII digits only: ``int`` alone would
#: also take spaces, underscores and other scripts' digits, where the Lua scripts do not).
_META = re.compile(rb"(-?[0-9]{1,17}):([0-9]{1,15}):([0-9]{1,15}):(.*)", re.DOTALL)

#: The head of a failed record (see ``_FAILED_RECORD``): six numbers, or seven when the job's
#: meta was unreadable and is kept raw; then `` k`` and the length of the job's concurrency
#: key, if it had one. (Bounded: ``int`` refuses over 4,300 digits.)
_FAILED_HEAD = re.compile(
    rb"([0-9]{1,15}(?:\.[0-9]{1,9})?) ([0-9]{1,15}) ([0-9]{1,15})"
    rb" ([0-9]{1,15}) ([0-9]{1,15}) ([0-9]{1,15})(?: (-1|[0-9]{1,15}))?(?: k([0-9]{1,15}))?"
)

#: The head of a quarantine record: "at len(reason)".
_QUARANTINE_HEAD = re.compile(rb"([0-9]{1,15}(?:\.[0-9]{1,9})?) ([0-9]{1,15})")

#: Bytes of a damaged value shown in a damage reason (the whole value stays in the record).
_SHOWN: Final = 60


def _show(value: bytes) -> str:
    """A damaged stored value, short and printable, for a damage reason."""
    text = repr(value[:_SHOWN])
    return text + f"... ({len(value)} bytes)" if len(value) > _SHOWN else text


def _text(raw: bytes) -> tuple[str, bool]:
    """``raw`` as text, and whether it was valid UTF-8 (if not: backslash escapes, readable)."""
    try:
        return raw.decode(), True
    except UnicodeDecodeError:
        return raw.decode(errors="backslashreplace"), False


def read_stalls(history: bytes | None) -> tuple[Stall, ...] | None:
    """A stall history (``[[at, worker], ...]``, ``[at, worker, 0]`` for a stall that did not
    count), ``()`` if none, ``None`` if unreadable."""
    if not history:
        return ()
    try:
        entries = orjson.loads(history)
    except orjson.JSONDecodeError:
        return None
    if type(entries) is not list:
        return None
    stalls = []
    for entry in entries:
        if type(entry) is not list or len(entry) not in (2, 3):
            return None
        at, worker, *flag = entry
        if type(at) not in (int, float) or type(worker) is not str:
            return None
        if flag and (type(flag[0]) is not int or flag[0] != 0):  # (only 0: not counted)
            return None
        stalls.append(Stall(at=float(at), worker=worker, counted=not flag))
    return tuple(stalls)


def read_claim(fields: list[Any], start: int, *, ahead: bool = False) -> ClaimedJob:
    """A :class:`ClaimedJob` from four reply fields: meta, data, stall history, token; popped
    ahead of a free slot with ``ahead``. Not started (as the script stored it) if ``ahead`` or
    a suspect (its readable meta counts stalls).

    The one validating decode of a claim: whatever is stored, it returns (never raises). A
    damaged field makes a claim flagged with ``damage`` (data: the raw bytes read); an empty
    token is a report of an entry the script already moved to the quarantine (then ``meta`` is
    the reason and ``data`` the internal id, if any).
    """
    meta, data, history, token = fields[start : start + 4]
    meta = meta if meta is not None else b""
    if not token:
        where = f" (internal id {data.decode(errors='replace')})" if data else ""
        return ClaimedJob(
            id="", data=b"", lease=Lease("", ""), damage=meta.decode(errors="replace") + where
        )
    damage = []
    job_id, priority, attempts, stalled = "", 0, 0, 0
    match = _META.fullmatch(meta)
    if match is None:
        damage.append(f"meta unreadable: {_show(meta)}")
    else:
        priority, attempts, stalled = int(match[1]), int(match[2]), int(match[3])
        job_id, readable = _text(match[4])
        if not readable:
            damage.append(f"job id is not UTF-8: {job_id}")
        if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            damage.append(f"meta priority out of range: {priority}")
            priority = 0
    if data is None:
        damage.append("job body missing (deleted or evicted)")
        data = b""
    stalls = read_stalls(history) if history else ()
    if stalls is None:
        damage.append(f"stall history unreadable: {_show(history)}")
        stalls = ()
    # (positional, in the field order: a claim of every job a worker takes)
    return ClaimedJob(
        job_id, data, Lease(job_id, token.decode()), attempts, stalled, stalls, priority,
        not ahead and stalled == 0, "; ".join(damage) if damage else None,
    )  # fmt: skip


def _failed_parts(record: bytes) -> tuple[re.Match[bytes] | None, bytes, tuple[int, ...]]:
    """A failed record's head match (``None``: unreadable), its body, and where the id, the
    error, the stall history, the raw meta and the key end in the body."""
    head, _, rest = record.partition(b"\n")
    match = _FAILED_HEAD.fullmatch(head)
    a = b = c = d = e = 0
    if match is not None:
        a = int(match[4])
        b = a + int(match[5])
        c = b + int(match[6])
        d = c + max(int(match[7] or 0), 0)
        e = d + int(match[8] or 0)
    if e > len(rest):
        match = None
    return match, rest, (a, b, c, d, e)


def read_failed_key(record: bytes) -> str | None:
    """The concurrency key a failed record keeps (``None``: none, or unreadable)."""
    match, rest, (_, _, _, d, e) = _failed_parts(record)
    if match is None or e == d:
        return None
    key, readable = _text(rest[d:e])
    return key if readable else None


def read_failed(record: bytes) -> FailedJob:
    """A :class:`FailedJob` from a failed record; never raises. A record that cannot be read
    is returned whole as ``data``, with an ``error`` naming the damage."""
    match, rest, (a, b, c, d, e) = _failed_parts(record)
    head = record.partition(b"\n")[0]
    if match is None:
        return FailedJob(
            id="", data=record, error=f"damaged failed record: {_show(head)}", failed_at=0.0
        )
    job_id, readable = _text(rest[:a])
    notes = [] if readable else [f"job id is not UTF-8: {job_id}"]
    # (In full: the record is the only place a person can read what was stored.)
    stalls = read_stalls(rest[b:c])
    if stalls is None:
        notes.append(f"stored stall history: {rest[b:c]!r}")
        stalls = ()
    if match[7] is not None:
        notes.append("no stored meta" if match[7] == b"-1" else f"stored meta: {rest[c:d]!r}")
    error = rest[a:b].decode(errors="replace")
    return FailedJob(
        id=job_id,
        data=rest[e:],
        error=f"{error} ({'; '.join(notes)})" if notes else error,
        failed_at=float(match[1]),
        attempts=int(match[2]),
        stalled_count=int(match[3]),
        stalls=stalls,
    )


def read_quarantined(queue: str, record: bytes) -> QuarantinedEntry:
    """A :class:`QuarantinedEntry` from a quarantine record; never raises."""
    head, _, rest = record.partition(b"\n")
    match = _QUARANTINE_HEAD.fullmatch(head)
    if match is None or int(match[2]) > len(rest):
        return QuarantinedEntry(queue=queue, reason="damaged quarantine record", raw=record, at=0.0)
    length = int(match[2])
    return QuarantinedEntry(
        queue=queue,
        reason=rest[:length].decode(errors="replace"),
        raw=rest[length:],
        at=float(match[1]),
    )


def read_claims(reply: list[Any], count: int) -> list[ClaimedJob]:
    """The claims (and reports) of a claim script's reply, the first ``count`` CLAIMS started
    as the script stored them (a report, say of a counter repaired while promoting, may come
    before them and is no claim)."""
    claims: list[ClaimedJob] = []
    started = 0
    for i in range(1, len(reply), 4):
        claim = read_claim(reply, i, ahead=started >= count)
        started += bool(claim.lease.token)
        claims.append(claim)
    return claims


def read_seconds(value: bytes | None) -> float | None:
    """A duration the claim or peek script returned, ``None`` for none (or an unreadable one)."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) else None


def read_job_state(found: list[Any] | None) -> JobState | None:
    """The reply of the job-state script (``{1, worker}``, ``{0}`` or nil) as a
    :class:`~durable_trio.brokers.JobState`, ``None``: not on the queue."""
    if not found:
        return None
    if int(found[0]) == 1:
        worker = found[1]
        text = worker.decode() if isinstance(worker, bytes) else str(worker)
        return JobState(claimed=True, worker=text)
    return JobState(claimed=False)


def read_job_states(found: list[Any], count: int) -> list[JobState | None]:
    """The reply of the job-states script for ``count`` job ids (two fields each)."""
    out: list[JobState | None] = []
    for i in range(count):
        flag = int(found[2 * i])
        if flag == 1:
            worker = found[2 * i + 1]
            text = worker.decode() if isinstance(worker, bytes) else str(worker)
            out.append(JobState(claimed=True, worker=text))
        else:
            out.append(JobState(claimed=False) if flag == 0 else None)
    return out
