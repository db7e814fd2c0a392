"""Drive psycopg's sans-I/O generators from Trio.

psycopg's protocol code (``psycopg.generators``) never touches a socket itself: each generator
yields what it waits for (:class:`psycopg.waiting.Wait`: read, write, or either) and is resumed
with what became ready (:class:`psycopg.waiting.Ready`). This module resumes them from Trio's own
I/O waits: no second event loop, no thread.

Cancellation:
    Every wait is a Trio checkpoint, so ``Cancelled`` can arrive at any of them. It propagates
    out of :func:`drive` unchanged, with the generator left suspended where it was: the
    *connection* is then mid-operation, and making it safe again (or closing it) is the job of
    the caller (``_connection.py``), never of this module.
"""

from __future__ import annotations

import select
from typing import TYPE_CHECKING, Final, TypeVar

import trio
from psycopg.waiting import Ready, Wait

if TYPE_CHECKING:
    from psycopg.abc import PQGen, PQGenConn

__all__ = ["drive", "drive_conn", "ready_now"]

RV = TypeVar("RV")

#: How long a wait for "either readable or writable" waits for writable alone before it looks
#: whether the socket became readable meanwhile (see :func:`_wait_either`).
_EITHER_PATIENCE: Final = 0.05
_POLL_MASK: Final = {
    Wait.R: select.POLLIN,
    Wait.W: select.POLLOUT,
    Wait.RW: select.POLLIN | select.POLLOUT,
}


def ready_now(fileno: int, wait: Wait = Wait.R) -> Ready:
    """What ``fileno`` is ready for at this instant (one ``poll`` system call, no waiting).

    Args:
        fileno: the socket.
        wait: what to look for.

    Returns:
        ``Ready.NONE``, ``Ready.R``, ``Ready.W`` or ``Ready.RW``; a socket in error or hung up
        counts as readable (reading it is how the error is found).
    """
    poller = select.poll()
    poller.register(fileno, _POLL_MASK[wait])
    ready = 0
    for _fd, events in poller.poll(0):
        if events & (select.POLLIN | select.POLLERR | select.POLLHUP):
            ready |= Ready.R
        if events & select.POLLOUT:
            ready |= Ready.W
    return Ready(ready)


async def _wait_either(fileno: int) -> Ready:
    """Wait until ``fileno`` is readable or writable.

    psycopg asks for this while a request is only partly sent: the server may answer (an error,
    a notice) before reading the rest, and a client that only waited to write could then wait
    forever on a server waiting for it to read. A race of two tasks would need a nursery per
    wait (and turn a cancellation into an exception group); instead this waits to write, but
    never longer than ``_EITHER_PATIENCE`` before looking (``poll``) whether the socket became
    readable. The rare stall is short, and nothing can hang.
    """
    with trio.move_on_after(_EITHER_PATIENCE):
        await trio.lowlevel.wait_writable(fileno)
    return ready_now(fileno, Wait.RW)


async def _wait(fileno: int, wait: Wait) -> Ready:
    if wait == Wait.R:
        await trio.lowlevel.wait_readable(fileno)
        return Ready.R
    if wait == Wait.W:
        await trio.lowlevel.wait_writable(fileno)
        return Ready.W
    return await _wait_either(fileno)


async def drive(gen: PQGen[RV], fileno: int) -> RV:
    """Run ``gen`` to its end, waiting on ``fileno`` whenever it asks to, and return its value.

    Args:
        gen: a psycopg generator of a connection whose socket does not change (queries,
            results, ``send``, ``fetch_many``, ``notifies``).
        fileno: that connection's socket.

    Returns:
        what the generator returns.

    Raises:
        psycopg.Error: what the generator raises (a lost connection is an
            ``OperationalError``).
        trio.ClosedResourceError: the connection was closed by another task meanwhile.

    Cancellation:
        Raises ``Cancelled`` at any wait, leaving ``gen`` suspended (see the module docs).
    """
    try:
        wait = next(gen)
        while True:
            wait = gen.send(await _wait(fileno, wait))
    except StopIteration as stop:
        value: RV = stop.value
        return value


async def drive_conn(gen: PQGenConn[RV]) -> RV:
    """Like :func:`drive`, for a generator that names the socket with each wait (the cancel
    request's, whose socket is only known once it is being opened).

    Args:
        gen: the generator, yielding ``(fileno, wait)`` pairs.

    Returns:
        what the generator returns.

    Cancellation:
        Raises ``Cancelled`` at any wait, leaving ``gen`` suspended.
    """
    try:
        fileno, wait = next(gen)
        while True:
            fileno, wait = gen.send(await _wait(fileno, wait))
    except StopIteration as stop:
        value: RV = stop.value
        return value
