"""Paging over a run store split into shards (the Redis run store on a Cluster).

Each shard numbers its own runs (``seq``); a page merges the shards' newest runs by creation
time. The cursor holds one bound per shard, so every shard is paged on its own sequence: a run
created while someone pages gets a higher number in its shard and never shifts the pages that
follow, whichever shard it lands in. The first page pins every shard (a shard that gave
nothing to it is bounded just above the newest run it had), so a run created meanwhile in a
shard not yet read does not turn up later either.

The cursor is ``"r2."`` followed by the URL-safe base64 of the bounds, comma separated: a
number (runs below it), ``x`` (this shard is done); opaque and versioned like the single
sequence's ``"r1."`` (see :mod:`._paging`).
"""

from __future__ import annotations

import base64
import binascii
from typing import Final

import attrs

from ..._errors import ConfigError
from .._records import DamagedRun, RunRecord

__all__ = ["DONE", "ShardPage", "decode_bounds", "encode_bounds", "merge_shards"]

_PREFIX: Final = "r2."

#: A shard with nothing left to page.
DONE: Final = -1

#: A shard bound: ``None`` (not read yet: the first page), :data:`DONE`, or the exclusive upper
#: bound of the seqs still to page.
Bound = int | None


def encode_bounds(bounds: list[Bound]) -> str | None:
    """The cursor for ``bounds`` (``None``: every shard is done, there is no next page)."""
    if all(bound == DONE for bound in bounds):
        return None
    text = ",".join("x" if bound == DONE else str(bound) for bound in bounds)
    return _PREFIX + base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def decode_bounds(cursor: str | None, shards: int) -> list[Bound]:
    """The bounds a cursor stands for (no cursor: every shard unread).

    Raises:
        ConfigError: not a cursor a store of ``shards`` shards returned.
    """
    if cursor is None:
        return [None] * shards
    if not isinstance(cursor, str) or not cursor.startswith(_PREFIX):
        raise ConfigError(f"not a run list cursor: {cursor!r}")
    body = cursor[len(_PREFIX) :]
    try:
        parts = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode("ascii").split(",")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise ConfigError(f"not a run list cursor: {cursor!r}") from None
    if len(parts) != shards or not all(p == "x" or (p.isdigit() and len(p) <= 18) for p in parts):
        raise ConfigError(f"not a run list cursor: {cursor!r}")
    return [DONE if part == "x" else int(part) for part in parts]


@attrs.frozen
class ShardPage:
    """One shard's answer to a page query.

    Attributes:
        runs: ``(created, seq, item)`` of its matching runs, newest (highest seq) first.
        following: where its scan stopped (the exclusive bound to go on from), ``None`` when
            it reached the end of its index.
    """

    runs: list[tuple[float, int, RunRecord | DamagedRun]]
    following: int | None


def merge_shards(
    pages: dict[int, ShardPage], bounds: list[Bound], limit: int
) -> tuple[list[RunRecord | DamagedRun], list[Bound]]:
    """The page (up to ``limit`` items, newest created first) and the bounds that follow it.

    Each shard's runs are taken as a prefix of its list (a k-way merge by creation time, ties
    by shard), so its bound is the seq of the last one taken; a shard all of whose runs were
    taken goes on from where its scan stopped (or is done); a shard none of whose runs were
    taken stays where it was, pinned just above its newest run on the first page.

    Args:
        pages: the shards that were asked (the others are done already), by shard.
        bounds: the bounds the page was asked with (one per shard).
        limit: the page size.
    """
    heads = {shard: 0 for shard in pages}
    taken: list[RunRecord | DamagedRun] = []
    while len(taken) < limit:
        best = None
        for shard, at in heads.items():
            runs = pages[shard].runs
            if at < len(runs) and (best is None or runs[at][0] > pages[best].runs[heads[best]][0]):
                best = shard
        if best is None:
            break
        taken.append(pages[best].runs[heads[best]][2])
        heads[best] += 1
    following = list(bounds)
    for shard, page in pages.items():
        count = heads[shard]
        if count == len(page.runs):
            following[shard] = DONE if page.following is None else page.following
        elif count > 0:
            following[shard] = page.runs[count - 1][1]
        elif bounds[shard] is None:
            following[shard] = page.runs[0][1] + 1  # pinned: nothing newer than it is read
    return taken, following
