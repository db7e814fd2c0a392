"""Coalescing: the calls made in one scheduling round share one broker call."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, TypeVar

import trio

from ._errors import BrokerError, BrokerUnavailable

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["Coalescer"]

T = TypeVar("T")
R = TypeVar("R")


class _Batch(Generic[T, R]):
    __slots__ = ("done", "error", "items", "results")

    def __init__(self, first: T) -> None:
        self.items: list[T] = [first]
        self.done = trio.Event()
        self.results: list[R] = []
        self.error: BaseException | None = None


class Coalescer(Generic[T, R]):
    """Submit items one by one; the items submitted in the same scheduling round go to the
    broker in ONE call of ``call(items) -> results`` (one result per item, in order).

    The first submitter of a round is the leader: it yields once (so every task made runnable
    with it can join), closes the batch, makes the call and hands each follower its result.
    The price is one scheduling round (a few µs) per batch; the gain, on Redis, is one script
    run for N finalizes, and on SQLite one transaction.

    Cancellation:
        A follower cancelled while it waits leaves its item in the batch (it is sent anyway,
        like a write already handed to a socket). A leader cancelled during the call makes the
        followers fail with :class:`BrokerUnavailable`.
    """

    def __init__(self, call: Callable[[list[T]], Awaitable[list[R]]]) -> None:
        self._call = call
        self._open: _Batch[T, R] | None = None

    async def submit(self, item: T) -> R:
        batch = self._open
        if batch is not None:
            index = len(batch.items)
            batch.items.append(item)
            await batch.done.wait()
            if batch.error is not None:
                raise BrokerError(f"a coalesced broker call failed: {batch.error}") from batch.error
            return batch.results[index]
        batch = self._open = _Batch(item)
        try:
            await trio.lowlevel.cancel_shielded_checkpoint()  # this round's others join now
        finally:
            self._open = None
        try:
            batch.results = await self._call(batch.items)
        except BaseException as exc:
            batch.error = (
                BrokerUnavailable("the coalesced broker call was cancelled")
                if isinstance(exc, trio.Cancelled)
                else exc
            )
            raise
        finally:
            batch.done.set()
        return batch.results[0]


def results_of(count: int, value: Any = None) -> list[Any]:
    """``count`` copies of ``value`` (for calls that answer nothing per item)."""
    return [value] * count
