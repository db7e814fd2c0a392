"""``close_on_signals``: SIGINT / SIGTERM start the bounded close that leaving a block starts.

::

    async with open_backend(url) as backend:          # outlives both phases: the handback needs it
        async with close_on_signals() as signals:     # 2nd signal: this block's scope is cancelled
            async with open_worker(app, backend):
                await signals.wait()                  # 1st signal: returns, the worker closes

Cancelling the scope *around* ``open_worker`` or ``open_engine`` on the first signal would cancel
running handlers at once instead of giving them ``close_timeout``; so the first signal only ends
the body, the second cancels this block's own scope (everything inside it at once, the close's
cleanup still shielded and bounded), and the backend, opened outside, closes last.
"""

from __future__ import annotations

import signal
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

from ._logs import get_logger

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterable

__all__ = ["SignalClose", "close_on_signals"]

_log = get_logger("durable_trio")

#: What a service manager or a terminal sends to ask a process to stop.
DEFAULT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _log_warning(message: str) -> None:
    _log.warning("%s", message)


def _carries_cancelled(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(trio.Cancelled) is not None
    return isinstance(exc, trio.Cancelled)


class SignalClose:
    """What :func:`close_on_signals` yields: the body's side of a signal-driven close.

    Attributes:
        received: the signals received so far, in order (at most two are acted on).
    """

    def __init__(self, hard: trio.CancelScope) -> None:
        self.received: list[int] = []
        self._hard = hard
        self._first = trio.Event()
        self._bodies: set[trio.CancelScope] = set()

    @property
    def signum(self) -> int | None:
        """The first signal received (``None``: none yet)."""
        return self.received[0] if self.received else None

    @property
    def forced(self) -> bool:
        """A second signal cut the close short ("close now")."""
        return len(self.received) >= 2

    @property
    def exit_status(self) -> int:
        """A service's conventional exit status: 0 unless a second signal forced the close,
        then ``128 + signum`` of that signal (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.received[1] if self.forced else 0

    async def wait(self) -> None:
        """Return once the first signal arrives (at once if one already did)."""
        await self._first.wait()

    def body(self) -> trio.CancelScope:
        """A fresh cancel scope the first signal cancels (already cancelled after one).

        For a body that does work instead of waiting: ``with signals.body(): await
        engine.result(run_id)``. Enter it *inside* ``open_worker`` / ``open_engine`` so only
        the body stops and leaving the block runs the graceful close.
        """
        scope = trio.CancelScope()
        if self._first.is_set():
            scope.cancel()
        else:
            self._bodies.add(scope)
        return scope

    def _graceful(self) -> None:
        self._first.set()
        bodies, self._bodies = self._bodies, set()
        for scope in bodies:
            scope.cancel()

    def _now(self) -> None:
        self._hard.cancel()


@asynccontextmanager
async def close_on_signals(
    signals: Iterable[int] = DEFAULT_SIGNALS,
    *,
    announce: Callable[[str], object] | None = None,
) -> AsyncIterator[SignalClose]:
    """Turn SIGINT / SIGTERM into a graceful close, and a second one into "close now".

    The first signal makes :meth:`SignalClose.wait` return and cancels every
    :meth:`SignalClose.body` scope, so the body ends and leaving ``open_worker`` /
    ``open_engine`` runs its bounded close: running handlers get ``close_timeout``, the rest
    are handed back attempt-neutrally, an engine releases its runs. A second signal (of any
    of ``signals``) cancels this block's own scope: handlers still running are cancelled at
    once, while the close's cleanup (handback, release) stays shielded and bounded by
    ``cleanup_timeout``. Later signals are ignored until the block ends.

    Open it *inside* ``open_backend`` and around ``open_worker`` / ``open_engine``: the second
    signal's cancel then stops the handlers but not the backend, which the handback needs and
    which closes last.

    Args:
        signals: the signals to act on (default SIGINT and SIGTERM). While the block runs they
            no longer raise ``KeyboardInterrupt`` or kill the process.
        announce: called with a one-line message on each signal acted on (default: a
            warning on the ``durable_trio`` logger).

    Raises:
        RuntimeError: not in the main thread (Python delivers signals only there).

    Cancellation:
        The block swallows only its own scope's cancellation (the second signal's); an
        outer cancel propagates as usual.
    """
    say = announce or _log_warning
    # The body's own exception leaves bare, not wrapped in the nursery's ExceptionGroup; a
    # Cancelled goes on into the nursery, whose scope swallows it if it is the second signal's.
    body_error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        closer = SignalClose(nursery.cancel_scope)

        async def watch(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with trio.open_signal_receiver(*signals) as receiver:
                task_status.started()
                async for signum in receiver:
                    closer.received.append(signum)
                    name = signal.Signals(signum).name
                    if len(closer.received) == 1:
                        say(f"{name}: closing gracefully (send it again to close now)")
                        closer._graceful()
                    elif len(closer.received) == 2:
                        say(f"{name} again: closing now")
                        closer._now()

        await nursery.start(watch)
        try:
            yield closer
        except BaseException as exc:
            if _carries_cancelled(exc):
                raise
            body_error = exc
        finally:
            nursery.cancel_scope.cancel()
    if body_error is not None:
        raise body_error
