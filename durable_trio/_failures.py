"""How a block that runs background tasks ends: with one exception, never an internal group.

``open_queue_transport`` and ``open_engine`` run their loops in nurseries of their own around
the caller's block. Left to trio, a loop that fails while the block raises would end the block
with an ``ExceptionGroup`` holding both (or, caught naively, with only one of them): the caller's
``except ValueError`` would then miss its own exception, and only when the two happen to meet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn, TypeVar

import trio

from ._logs import get_logger

if TYPE_CHECKING:
    import logging
    from collections.abc import Callable, Iterable, Iterator

__all__ = ["one_exception", "raise_bare", "report_through"]


_E = TypeVar("_E", bound=BaseException)


def report_through(
    hook: Callable[[_E], object],
    exc: _E,
    log: logging.Logger | None = None,
) -> None:
    """Hand ``exc`` to an ``on_error`` hook; a hook that raises is logged (on ``log``, default
    the ``durable_trio`` logger), never propagated: a broken hook must not take a loop down
    with it."""
    try:
        hook(exc)
    except Exception:
        (log or get_logger("durable_trio")).exception("the on_error hook raised")


def _leaves(error: BaseException) -> Iterator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


def _is_cancellation(error: BaseException) -> bool:
    return all(isinstance(leaf, trio.Cancelled) for leaf in _leaves(error))


def one_exception(
    body: BaseException | None, background: Iterable[BaseException], *, owner: str
) -> BaseException | None:
    """The one exception a block ends with, given what its body and its background raised.

    The body's own exception wins, as it is: the caller's ``except`` clauses are written for
    it. A background failure that met it is attached, not dropped: as the body exception's
    ``__context__`` (together with the context it already had, in a group) and named in a note.
    Without a body exception (or when the body only saw the cancel that the failure caused) the
    first background failure is raised, unwrapped from the nurseries' groups, the others
    attached to it the same way. A background failure that is not an ``Exception``
    (``KeyboardInterrupt``, ``SystemExit``) wins over a body's plain ``Exception``, which is
    attached to it: an interrupt must not become a footnote. Cancellations are dropped once a
    failure is raised (they were its consequence, or an outer cancel that any exception carries
    through); with nothing else, a ``Cancelled`` is raised, so no cancel is lost.

    Args:
        body: what the body (or the opening before it) raised, if anything.
        background: what the background tasks' nurseries (and the parts closed after the
            body) raised.
        owner: the part whose background this is, for the note ("the queue transport").

    Returns:
        The exception to raise with :func:`raise_bare`, or ``None``: nothing to raise.
    """
    background = list(background)
    failures = [
        leaf
        for error in background
        for leaf in _leaves(error)
        if not isinstance(leaf, trio.Cancelled)
    ]
    body_failed = body is not None and not _is_cancellation(body)
    interrupts = [f for f in failures if not isinstance(f, Exception)]
    if body is not None and body_failed and not (interrupts and isinstance(body, Exception)):
        primary = body
    elif failures:
        primary = interrupts[0] if interrupts else failures[0]
        failures.remove(primary)
        if body_failed:
            assert body is not None
            failures.insert(0, body)
    elif body is not None:
        return body
    else:
        cancels = [leaf for error in background for leaf in _leaves(error)]
        return cancels[0] if cancels else None
    if failures:
        _attach(primary, failures, owner)
    return primary


def _attach(primary: BaseException, others: list[BaseException], owner: str) -> None:
    kept = list(others)
    what = f"what {owner} raised at the same time"
    if primary.__context__ is not None and not primary.__suppress_context__:
        kept.append(primary.__context__)
        what += ", then the context this exception had"
    primary.__context__ = kept[0] if len(kept) == 1 else BaseExceptionGroup(what, kept)
    # (``raise ... from None`` hid the old context; the failures attached now must show)
    primary.__suppress_context__ = False
    named = ", ".join(repr(error) for error in others)
    primary.add_note(
        f"durable_trio: {owner} also raised {named} at the same time (attached as __context__)"
    )


def raise_bare(error: BaseException) -> NoReturn:
    """Raise ``error`` keeping its ``__context__``: raised in a generator that an exception was
    thrown into, Python would replace it with the exception being handled there."""
    context, suppress = error.__context__, error.__suppress_context__
    try:
        raise error
    finally:
        error.__context__, error.__suppress_context__ = context, suppress
        del error, context
