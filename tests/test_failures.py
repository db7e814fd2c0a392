"""The one exception a block with background tasks ends with (``_failures``)."""

from __future__ import annotations

from contextlib import asynccontextmanager, suppress
from typing import TYPE_CHECKING

import pytest
import trio

from durable_trio._failures import one_exception, raise_bare

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


async def a_cancelled() -> trio.Cancelled:
    with trio.CancelScope() as scope:
        scope.cancel()
        try:
            await trio.lowlevel.checkpoint()
        except trio.Cancelled as exc:
            caught = exc
            raise
    return caught


def group(*errors: BaseException) -> BaseExceptionGroup[BaseException]:
    return BaseExceptionGroup("Exceptions from Trio nursery", list(errors))


def test_nothing_raised_is_nothing_to_raise() -> None:
    assert one_exception(None, [], owner="it") is None


def test_a_lone_background_failure_is_unwrapped_and_the_others_attached() -> None:
    first, second = TypeError("first"), KeyError("second")
    error = one_exception(None, [group(group(first)), group(second)], owner="it")
    assert error is first
    assert first.__context__ is second
    assert first.__notes__ == [
        "durable_trio: it also raised KeyError('second') at the same time (attached as __context__)"
    ]


async def test_the_body_wins_over_failures_and_cancellations_are_dropped() -> None:
    body, failure, cancel = ValueError("mine"), TypeError("bg"), await a_cancelled()
    assert one_exception(body, [group(cancel, group(failure))], owner="it") is body
    assert body.__context__ is failure


async def test_a_body_cancelled_by_the_failure_gives_way_to_it() -> None:
    cancel, failure = await a_cancelled(), TypeError("bg")
    error = one_exception(cancel, [group(failure)], owner="it")
    assert error is failure
    assert failure.__context__ is None  # a cancel is no failure to attach


async def test_only_cancellations_raise_a_cancellation_never_nothing() -> None:
    body, other = await a_cancelled(), await a_cancelled()
    assert one_exception(body, [group(other)], owner="it") is body
    assert one_exception(None, [group(other)], owner="it") is other


def test_the_body_context_is_kept_beside_the_failure_unless_it_was_suppressed() -> None:
    handled, failure = KeyError("handled"), TypeError("bg")
    body = ValueError("mine")
    body.__context__ = handled
    one_exception(body, [group(failure)], owner="it")
    assert isinstance(body.__context__, BaseExceptionGroup)
    assert body.__context__.exceptions == (failure, handled)
    hidden = ValueError("from None")
    hidden.__context__, hidden.__suppress_context__ = handled, True
    one_exception(hidden, [group(failure)], owner="it")
    context: BaseException | None = hidden.__context__  # (set anew by one_exception)
    assert context is failure
    assert not hidden.__suppress_context__


def test_an_interrupt_of_the_background_is_never_a_footnote() -> None:
    body, interrupt = ValueError("mine"), KeyboardInterrupt()
    error = one_exception(body, [group(TypeError("bg"), interrupt)], owner="it")
    assert error is interrupt
    assert isinstance(interrupt.__context__, BaseExceptionGroup)
    assert interrupt.__context__.exceptions[0] is body
    # ... while the body's own interrupt stays first
    own = KeyboardInterrupt()
    assert one_exception(own, [group(SystemExit(1))], owner="it") is own


async def test_raise_bare_keeps_the_context_in_a_generator_an_exception_was_thrown_into() -> None:
    failure, original = TypeError("bg"), KeyError("its own context")
    failure.__context__ = original

    @asynccontextmanager
    async def block() -> AsyncIterator[None]:
        with suppress(trio.Cancelled):
            yield
        raise_bare(failure)

    with pytest.raises(TypeError) as caught:
        async with block():
            raise await a_cancelled()
    assert caught.value.__context__ is original
