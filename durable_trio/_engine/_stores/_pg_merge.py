"""Group commit for the PostgreSQL run store's hottest changes (issue 32).

A checkpoint's compare-and-set and a dispatch's mark are one small statement each, made by
hundreds of runs at once under load: the statement count, not the work in each, is what costs
(the engine's CPU per statement sent and read back, the server's per statement parsed, run and
committed). :class:`MergedWrites` sends the changes of one kind that wait while one of that
kind is in flight as ONE statement over arrays (``unnest``), in one transaction: N changes, one
statement, one commit.

Same answers, same states: the merged statement does, row by row, what the single one does
(the same function, the same compare-and-set), in the order the changes are given; its rows
are sorted by their key (run id first) so the runs' rows are locked in ascending order, as
``renew_runs`` and ``release_runs`` lock them, and every run's row before its checkpoints.

Each caller still returns only after its own change committed (the merged one), with its own
answer. A lone change (none in flight) goes at once, as the single statement: an idle store
pays nothing for this. A merged statement the server refuses (a deadlock the server broke, a
row one change made invalid: an error about the statement, not about the server being
unavailable) is not the others' failure: each change is then sent again on its own, and gets
its own answer or error.

Cancellation:
    As every change of the store: once submitted it runs to its end (shielded, bounded by
    ``bound``), and the cancellation is delivered after it.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Generic, TypeVar, cast

import trio

from ..._coalesce import Coalescer
from ..._errors import BrokerUnavailable, TransportClosed

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["MergedWrites"]

T = TypeVar("T")
R = TypeVar("R")


class MergedWrites(Generic[T, R]):
    """Changes of one kind, merged while one is in flight (see the module docs).

    Args:
        one: makes one change (the single statement) and answers it.
        many: makes several changes in one statement, one transaction; one answer each, in
            the order given.
        bound: seconds a change may take (its wait for the one in flight included).
    """

    def __init__(
        self,
        one: Callable[[T], Awaitable[R]],
        many: Callable[[list[T]], Awaitable[list[R]]],
        *,
        bound: float,
    ) -> None:
        self._one = one
        self._many = many
        self._bound = bound
        self._coalescer: Coalescer[T, R | Exception] = Coalescer(self._call)
        self.merged = 0
        """Changes sent in a merged statement (statistics)."""

    async def write(self, item: T) -> R:
        """Make the change ``item`` (merged with others if any wait) and answer it.

        Raises:
            BrokerUnavailable: not done within the bound, or the server is unavailable.
            PostgresError: the change failed (an error of its own).
            TransportClosed: the pool is closed.
            ValueError: a parameter psycopg cannot adapt (nothing of it was sent).
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        answer: R | Exception | None = None
        done = False
        with trio.move_on_after(self._bound, shield=True):
            answer = await self._coalescer.submit(item)
            done = True
        if not done:
            raise BrokerUnavailable(
                f"the PostgreSQL run store did not finish a change within {self._bound:g} s"
            )
        if isinstance(answer, Exception):
            raise answer
        await trio.lowlevel.checkpoint_if_cancelled()
        return cast("R", answer)

    async def _call(self, items: list[T]) -> list[R | Exception]:
        """(The coalescer's call.) One answer, or one exception, per item: never raises."""
        if len(items) > 1:
            try:
                answers: list[R | Exception] = list(await self._many(items))
            except (BrokerUnavailable, TransportClosed) as exc:
                # The server's or the pool's state, not the statement's: the same for each.
                return [copy.copy(exc) for _ in items]
            except Exception:  # each change is sent again on its own, below
                pass
            else:
                self.merged += len(items)
                return answers
        out: list[R | Exception] = []
        for item in items:  # one at a time: each its own change, its own answer or error
            try:
                out.append(await self._one(item))
            except Exception as exc:  # raised to its own caller by write
                out.append(exc)
        return out
