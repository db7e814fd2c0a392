"""One Redis connection: a coalescing writer task and a FIFO reader task over one Trio stream.

Callers never touch the socket. :meth:`Connection.execute` packs its command, appends the bytes to
the *outbox* and a reply slot to the *pending* queue in one synchronous step (no checkpoint in
between, so both queues always hold the same commands in the same order), then waits on its slot.

* The commands queued during one pass of Trio's scheduler leave together: on a plain TCP
  socket a Trio instrument (:class:`_Flusher`) writes each connection's outbox at the end
  of the pass, in one non-blocking system call made from no task (no task hop; no command
  cut in half by a cancellation). A caller that finds the connection idle and *leads*
  (below) makes that call for its own command at once: nothing is queued yet to share a
  write with, and the server works on it while the pass runs on. The **writer** task sends
  what the socket did not take (waiting until it drains), meets any error, and sends
  everything on a TLS stream.
* Replies are read by whoever waits on the socket: a reply is fed to ``hiredis.Reader`` and
  handed to the oldest pending slot. On a plain socket on Linux (not pub/sub), a caller that
  finds the connection with nothing pending *leads*: it waits on the socket itself, reads,
  and hands every complete reply to its slot (rescheduling the other callers), so a lone
  caller's round trip is one task step, not two (reader woken, then caller). When its own
  reply is complete with other replies still due, or when it is cancelled, the role passes
  to the **reader** task, which reads until nothing is pending. Otherwise (an idle
  connection, or a caller leading) the reader waits on an epoll set of its own that watches
  the socket for a hang-up only (``EPOLLRDHUP``), so a connection the server closes is
  still seen while idle. Elsewhere (TLS, pub/sub, no ``select.epoll``) the reader reads
  every reply, as before.

**Cancellation safety.** A caller that is cancelled (or times out) after enqueuing never removes its
slot once its command may have left, so the reply stream and the pending queue can never get out
of step:

* a caller cancelled at its slot's wait while its command has not left and is the last queued
  takes it back (``_Slot.abort``), so one that will wait on its slot is not checked for
  cancellation before it queues; one that will lead (wait on the socket) is;
* on a shared (pooled) connection the slot stays and its reply is read and dropped (*drain*);
* on a dedicated connection (``discard_on_cancel=True``) the connection is discarded instead, so a
  cancelled blocking command (``BLPOP``) cannot pop an item that nobody will ever read;
* a per-command timeout always discards the connection (the server may be stuck): every caller
  still waiting on it gets :class:`~durable_trio._errors.BrokerUnavailable`, never a hang.

A cancelled caller's command may still have run on the server (it may already have been sent).
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import socket
import ssl
from collections import deque
from typing import TYPE_CHECKING, Any, Final, cast

import attrs
import hiredis
import outcome
import trio

from .._errors import BrokerUnavailable, DurableTrioError, TransportClosed
from ._commands import ANSWER_ONCE as _ANSWER_ONCE
from ._commands import RedisArg
from ._commands import check as _check
from ._commands import command_name as _name
from ._commands import pack as _pack
from ._errors import RedisCommandTimeout, RedisReplyError, handshake_error, raisable
from ._replicas import check_acknowledged, replica_wait, waited_timeout

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from ._url import RedisURL

__all__ = ["Connection", "ConnectionStats", "RedisArg", "connect"]

# Trio's primitives of every command, looked up once (not as module attributes per call).
_current_task = trio.lowlevel.current_task
_reschedule = trio.lowlevel.reschedule
_wait_task_rescheduled = trio.lowlevel.wait_task_rescheduled
_checkpoint_if_cancelled = trio.lowlevel.checkpoint_if_cancelled
_wait_readable = trio.lowlevel.wait_readable
_read, _write = os.read, os.write
_NOT_ENOUGH_DATA: Final = object()
_RECEIVE_SIZE: Final = 65536
_PUSH_KINDS: Final = frozenset({b"message", b"pmessage", b"smessage"})
_EVAL_FOR: Final = {"EVALSHA": "EVAL", "EVALSHA_RO": "EVAL_RO"}
# What the reader's own epoll set watches the socket for (``Connection._arm``): a hang-up only
# (the connection is idle, or a caller leads), or the replies too (the reader reads them).
_HANGUP: Final = getattr(select, "EPOLLRDHUP", 0)
_REPLIES: Final = _HANGUP | getattr(select, "EPOLLIN", 0)


def _unsolicited(reply: Any) -> bool:
    """Whether ``reply`` is a server-initiated ``sunsubscribe`` (no command asked for it)."""
    return type(reply) is list and len(reply) > 1 and reply[0] == b"sunsubscribe"


def _fresh(error: DurableTrioError) -> DurableTrioError:
    """A copy of ``error`` (one shared instance must not collect every caller's frames)."""
    copy = type(error)(*error.args)
    copy.__cause__ = error.__cause__
    return copy


def _unavailable(message: str, cause: BaseException | None = None) -> BrokerUnavailable:
    error = BrokerUnavailable(message)
    error.__cause__ = cause
    return error


@attrs.define
class ConnectionStats:
    """Counters of one connection (for tests, benchmarks and debugging).

    Attributes:
        commands: commands enqueued.
        batches: writes (``commands / batches`` is the coalescing).
        replies: replies read.
        dropped: replies read for callers that had been cancelled (drained, not delivered).
    """

    commands: int = 0
    batches: int = 0
    replies: int = 0
    dropped: int = 0


class _Slot(outcome.Outcome[list[Any]]):
    """One request, queued by its caller when made (its bytes to the outbox, the slot to the
    pending queue, in one synchronous step), then where the reader puts its reply (or replies).

    ``task`` is the waiting caller, rescheduled directly by whoever completes the slot (the
    reader, a leading caller, or ``_fail``); it is ``None`` once rescheduled, while its caller
    leads (reads the socket itself: ``Connection._lead``), or once the caller was cancelled (the
    slot is then *abandoned*: it stays queued and its reply is dropped on arrival, unless its
    command had not left and was the last queued: then it is taken back, ``data`` ``None``).
    """

    __slots__ = ("conn", "data", "deadline", "error", "expected", "replies", "task", "timeout")

    def __init__(
        self, conn: Connection, data: bytes, expected: int, reply_timeout: float | None
    ) -> None:
        if conn._error is not None:
            raise conn._dead()
        self.conn = conn
        self.data: bytes | None = data
        self.expected = expected
        self.timeout = timeout = conn._command_timeout if reply_timeout is None else reply_timeout
        # The clock is read once a write: a command queued behind this pass's first (whose
        # write is queued) shares its reading, at most a pass or two old.
        now = conn._stamp if conn._flush_queued else conn._now()
        self.deadline = deadline = now + timeout
        self.task: trio.lowlevel.Task | None = _current_task()
        self.replies: list[Any] = []
        self.error: DurableTrioError | None = None
        # From here to the caller's wait there is no checkpoint: outbox and pending in step.
        conn._pending.append(self)
        conn._outstanding += expected
        conn.stats.commands += expected
        conn._outbox.append(data)
        if not conn._flush_queued and conn._writer_idle is not None:
            # The writer is parked, so nothing is being sent: on a plain socket the flusher
            # writes the outbox when the scheduler's pass ends (every command queued in the
            # pass in one write, no task hop); otherwise the writer is woken for it. A busy
            # writer sends the outbox itself when its send is done.
            if conn._flusher is not None:
                conn._flush_queued = True
                conn._stamp = now
                conn._flusher.queue(conn)
            else:
                conn._wake_writer()
        if deadline < conn._watch_deadline:
            conn._watch_deadline = conn._watch_scope.deadline = deadline

    def abort(self, _raise_cancel: Any) -> trio.lowlevel.Abort:
        """The caller's wait was cancelled: abandon the slot, or take the command back if it
        has not left and is the last queued (its bytes are then the outbox's last item, the
        very object queued: a write cut short puts back a copy of what it did not send)."""
        self.task = None
        conn = self.conn
        pending, outbox = conn._pending, conn._outbox
        if pending and pending[-1] is self and outbox and outbox[-1] is self.data:
            pending.pop()
            outbox.pop()
            conn._outstanding -= self.expected
            conn.stats.commands -= self.expected
            self.data = None
        return trio.lowlevel.Abort.SUCCEEDED

    def cancelled(self) -> None:
        """The caller's wait ended in a cancellation: on a dedicated connection, discard it
        (unless the command was taken back), so a cancelled ``BLPOP`` pops nothing unread."""
        conn = self.conn
        if (
            self.task is None
            and self.error is None
            and self.data is not None
            and conn._discard_on_cancel
        ):
            conn._fail(
                _unavailable(
                    f"connection to {conn._url.address} discarded: "
                    "a command was cancelled before its reply"
                )
            )

    def wake(self) -> None:
        task = self.task
        if task is not None:
            self.task = None
            _reschedule(task, self)

    # The slot is the outcome its caller is rescheduled with (``trio.lowlevel.reschedule``'s
    # ``next_send``), so no ``outcome.Value`` is made and unwrapped a reply. A slot is itself
    # alone (``Outcome``'s attrs equality would make every slot equal to every other).
    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = None  # (as Outcome's: never a key)

    def unwrap(self) -> list[Any]:
        """The replies, or the connection's error (a fresh copy) raised."""
        if self.error is not None:
            raise _fresh(self.error)
        return self.replies

    def send(self, gen: Any) -> Any:  # (outcome.Outcome's; unused here)
        if self.error is not None:
            return gen.throw(_fresh(self.error))
        return gen.send(self.replies)

    async def asend(self, agen: Any) -> Any:  # (outcome.Outcome's; unused here)
        if self.error is not None:
            return await agen.athrow(_fresh(self.error))
        return await agen.asend(self.replies)


class _Flusher(trio.abc.Instrument):
    """Writes the commands the connections queued during a scheduler pass, when it ends.

    One per ``trio.run`` (a :class:`~trio.lowlevel.RunVar`), installed as an instrument while
    connections use it: its ``before_io_wait`` runs once per pass of Trio's scheduler, after
    every task that was runnable has run and before the loop waits for I/O. So the commands of
    all the callers that ran in a pass leave in one write per connection, and no task hop is
    needed to send them (auto-pipelining).
    """

    def __init__(self) -> None:
        self._queued: list[Connection] = []
        self._users = 0

    @classmethod
    def get(cls) -> _Flusher:
        """This run's flusher (installed on first use), with one more user."""
        try:
            flusher = _FLUSHER.get()
        except LookupError:
            flusher = cls()
            _FLUSHER.set(flusher)
        if flusher._users == 0:
            trio.lowlevel.add_instrument(flusher)
        flusher._users += 1
        return flusher

    def release(self) -> None:
        """One user less (a closed connection); uninstalled when none is left."""
        self._users -= 1
        if self._users == 0:
            with contextlib.suppress(KeyError):  # never installed, or disabled by an error
                trio.lowlevel.remove_instrument(self)

    def queue(self, conn: Connection) -> None:
        """Write ``conn``'s outbox at the end of this pass."""
        self._queued.append(conn)

    def before_io_wait(self, timeout: float) -> None:
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        woken = False
        for conn in queued:
            try:
                woken = conn._flush(timeout) or woken
            except Exception as exc:  # never out of an instrument (Trio would disable it)
                conn._fail(_unavailable(f"lost connection to {conn.url.address}: {exc!r}", exc))
        if woken and timeout > 0:
            # A writer was made runnable after the loop chose to sleep: wake the loop up.
            trio.lowlevel.current_trio_token().run_sync_soon(_nothing, idempotent=True)


def _nothing() -> None:
    pass


_FLUSHER: Final = trio.lowlevel.RunVar[_Flusher]("durable_trio_redis_flusher")


def _hangup_watch(fd: int) -> select.epoll | None:
    """An epoll set watching ``fd`` for a hang-up, if this system has one (and a descriptor)."""
    if fd < 0 or not _HANGUP or not hasattr(select, "epoll"):
        return None
    try:
        watch = select.epoll()
    except OSError:  # no descriptor left: the reader reads every reply, as before
        return None
    try:
        watch.register(fd, _HANGUP)
    except OSError:
        watch.close()
        return None
    return watch


class Connection:
    """One connection to Redis, shared by any number of Trio tasks.

    Get one from :meth:`RedisClient.dedicated` (or indirectly through the client's pool); its
    reader and writer tasks run in the client's nursery. Replies are returned as hiredis gives
    them: ``bytes`` for strings, ``int``, ``None`` for nil, ``list`` for arrays (an error nested in
    an array is a :class:`RedisReplyError` value). A connection that fails is never reused: every
    later call raises :class:`~durable_trio._errors.BrokerUnavailable` (or
    :class:`~durable_trio._errors.TransportClosed` once closed on purpose).
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        url: RedisURL,
        *,
        command_timeout: float,
        discard_on_cancel: bool = False,
        scripts: Mapping[str, bytes] | None = None,
        push_buffer: int | None = None,
    ) -> None:
        self._stream = stream
        self._url = url
        self._command_timeout = command_timeout
        self._discard_on_cancel = discard_on_cancel
        self._scripts: Mapping[str, bytes] = {} if scripts is None else scripts
        self._scope = trio.CancelScope()
        # The socket's descriptor for the direct write (see ``_request``); -1: always the writer.
        self._fd = (
            stream.socket.fileno()
            if type(stream) is trio.SocketStream and os.name == "posix"
            else -1
        )
        self._now = trio.lowlevel.current_clock().current_time
        self._flusher = _Flusher.get() if self._fd >= 0 else None
        self._flush_queued = False
        self._stamp = 0.0  # the clock's reading for the commands of the write queued
        self._flush_held = False  # a leader woke callers: their commands and its own leave together
        self._outbox: list[bytes] = []
        self._pending: deque[_Slot] = deque()
        self._outstanding = 0
        self._writer_idle: trio.lowlevel.Task | None = None  # the writer, while it waits
        self._watch_deadline = math.inf
        self._watch_scope = trio.CancelScope()
        self._error: DurableTrioError | None = None
        self._parser = hiredis.Reader(replyError=RedisReplyError, notEnoughData=_NOT_ENOUGH_DATA)
        # Leading callers (module docs): the slot of the caller reading the socket, and the
        # reader's own epoll set over the socket (None: the reader reads every reply), with
        # what it watches for (_HANGUP, _REPLIES, or 0 while a caller leads after a hang-up).
        self._lead: _Slot | None = None
        self._watch = _hangup_watch(self._fd) if push_buffer is None else None
        self._watching = 0 if self._watch is None else _HANGUP
        self.stats = ConnectionStats()
        self._push_send: trio.MemorySendChannel[tuple[bytes, bytes]] | None = None
        self._push_receive: trio.MemoryReceiveChannel[tuple[bytes, bytes]] | None = None
        if push_buffer is not None:
            self._push_send, self._push_receive = trio.open_memory_channel[tuple[bytes, bytes]](
                push_buffer
            )

    # -- public surface ---------------------------------------------------------------------

    @property
    def url(self) -> RedisURL:
        """The settings this connection was made with."""
        return self._url

    @property
    def healthy(self) -> bool:
        """True until the connection fails or is closed (it is then never used again)."""
        return self._error is None

    @property
    def load(self) -> int:
        """Replies still expected (the pool sends new commands to the least loaded connection)."""
        return self._outstanding

    async def execute(self, *args: RedisArg, reply_timeout: float | None = None) -> Any:
        """Send one command and return its reply.

        ``EVALSHA`` of a script registered with :meth:`RedisClient.script` that gets ``NOSCRIPT``
        is retried once as ``EVAL`` (which also caches the script on the server).

        Args:
            *args: the command and its arguments, e.g. ``"SET", "k", b"v", "EX", 60``.
            reply_timeout: seconds to wait for the reply before the connection is deemed stuck
                and discarded (raising :class:`RedisCommandTimeout`); ``None`` uses the
                connection's command timeout, ``math.inf`` waits forever (blocking commands).
                Cancelling the call instead (``trio.move_on_after``) follows the connection's
                cancellation rule (drain or discard, see the module docs).

        Returns:
            the reply.

        Raises:
            RedisReplyError: the server answered with an error.
            RedisCommandTimeout: no reply in time (the connection is discarded).
            BrokerUnavailable: the connection is (or went) down.
            TransportClosed: the connection or its client was closed.
            ValueError: an empty command, or one that does not answer once (``SUBSCRIBE``).
        """
        return await self._command(args, reply_timeout)

    async def _command(self, args: tuple[RedisArg, ...], reply_timeout: float | None) -> Any:
        """:meth:`execute`'s body, awaited directly by the client's ``execute``, with
        :meth:`_request` written out in it (one coroutine frame less a command)."""
        if not args or args[0] not in _ANSWER_ONCE:
            _check(args)
        if self._url.min_replicas and replica_wait(self._url, [args]) is not None:
            # A write of a min_replicas connection: the pipeline appends (and checks) its WAIT.
            try:
                (reply,) = await self.pipeline([args], reply_timeout=reply_timeout)
            except RedisReplyError as exc:
                exc.index = None  # one command, as the unwaited path raises it
                raise
            return reply
        data = _pack(args)
        if (self._lead is None and self._watching == _HANGUP) or self._error is not None:
            await _checkpoint_if_cancelled()  # (see _request)
            (reply,) = await self._lead_replies(_Slot(self, data, 1, reply_timeout))
        else:
            slot = _Slot(self, data, 1, reply_timeout)
            try:
                (reply,) = await _wait_task_rescheduled(slot.abort)
            except BaseException:
                slot.cancelled()
                raise
        if isinstance(reply, RedisReplyError):
            if reply.code == "NOSCRIPT":
                retry = self._eval_instead(args)
                if retry is not None:
                    return await self._command(retry, reply_timeout)
            raise raisable(reply, self._url.address)
        return reply

    async def pipeline(
        self,
        commands: Iterable[Sequence[RedisArg]],
        *,
        raise_on_error: bool = True,
        reply_timeout: float | None = None,
    ) -> list[Any]:
        """Send many commands in one write and return all their replies, in order.

        This is not a transaction (wrap the commands in ``MULTI`` / ``EXEC`` for that). Every
        command runs even if an earlier one fails. ``EVALSHA`` commands of registered scripts that
        get ``NOSCRIPT`` are retried once as ``EVAL`` after the rest of the pipeline, in their
        original relative order (the only reordering this client ever does).

        Args:
            commands: the commands, each a sequence like ``("SET", "a", "1")``.
            raise_on_error: if true (the default), after *all* replies are read, the first error
                reply is raised (with its ``index`` set); if false, error replies are returned as
                :class:`RedisReplyError` objects in their slots.
            reply_timeout: seconds for the whole pipeline (see :meth:`execute`).

        Returns:
            one reply per command (``[]`` for no commands).

        Raises:
            RedisReplyError: ``raise_on_error`` and some command failed.
            RedisCommandTimeout: no complete answer in time (the connection is discarded).
            BrokerUnavailable: the connection is (or went) down.
            TransportClosed: the connection or its client was closed.
            ValueError: an empty command, or one that does not answer once.
        """
        batch = [tuple(command) for command in commands]
        if not batch:
            await trio.lowlevel.checkpoint()
            return []
        for command in batch:
            _check(command)
        data = b"".join([_pack(command) for command in batch])
        wait = replica_wait(self._url, batch)
        if wait is not None:
            return await self._pipeline_waited(batch, data, wait, raise_on_error, reply_timeout)
        replies = await self._request(data, len(batch), reply_timeout)
        return await self._finish(batch, replies, raise_on_error, reply_timeout)

    async def _pipeline_waited(
        self,
        batch: list[tuple[RedisArg, ...]],
        data: bytes,
        wait: tuple[RedisArg, ...],
        raise_on_error: bool,
        reply_timeout: float | None,
    ) -> list[Any]:
        """:meth:`pipeline` with ``WAIT`` after it (``min_replicas``, see ``_replicas.py``): in
        the same request, and again after any ``NOSCRIPT`` retry (run after the first
        ``WAIT``). Error replies are raised first (the caller's own fault), then too few
        replicas."""
        timeout = waited_timeout(self._url, reply_timeout, self._command_timeout)
        *replies, acked = await self._request(data + _pack(wait), len(batch) + 1, timeout)
        retried = any(
            isinstance(reply, RedisReplyError) and reply.code == "NOSCRIPT" for reply in replies
        )
        replies = await self._finish(batch, replies, raise_on_error, timeout)
        if retried:
            (acked,) = await self._request(_pack(wait), 1, timeout)
        check_acknowledged(self._url, acked)
        return replies

    async def _finish(
        self,
        batch: list[tuple[RedisArg, ...]],
        replies: list[Any],
        raise_on_error: bool,
        reply_timeout: float | None,
    ) -> list[Any]:
        """The ``NOSCRIPT`` retries and the error check of :meth:`pipeline`."""
        retries = [
            (index, retry)
            for index, reply in enumerate(replies)
            if isinstance(reply, RedisReplyError)
            and reply.code == "NOSCRIPT"
            and (retry := self._eval_instead(batch[index])) is not None
        ]
        if retries:
            again = await self._request(
                b"".join([_pack(retry) for _, retry in retries]), len(retries), reply_timeout
            )
            for (index, _), reply in zip(retries, again, strict=True):
                replies[index] = reply
        if raise_on_error:
            for index, reply in enumerate(replies):
                if isinstance(reply, RedisReplyError):
                    reply.index = index
                    raise raisable(reply, self._url.address)
        return replies

    def close(self) -> None:
        """Discard the connection now: waiting callers get ``TransportClosed``; idempotent."""
        self._fail(TransportClosed(f"connection to {self._url.address} closed"))

    # -- internals used by the pool and the pub/sub helper ----------------------------------

    def _dead(self) -> DurableTrioError:
        assert self._error is not None
        return _fresh(self._error)

    def _eval_instead(self, command: Sequence[RedisArg]) -> tuple[RedisArg, ...] | None:
        if len(command) < 3:
            return None
        name = _EVAL_FOR.get(_name(command[0]))
        sha = command[1]
        sha = sha.decode("ascii", "replace") if isinstance(sha, bytes) else str(sha)
        source = self._scripts.get(sha.lower())
        if name is None or source is None:
            return None
        return (name, source, *command[2:])

    async def _request(self, data: bytes, expected: int, reply_timeout: float | None) -> list[Any]:
        """Enqueue ``data`` (``expected`` commands) and wait for all their replies."""
        if (self._lead is None and self._watching == _HANGUP) or self._error is not None:
            # Nothing else pending and nobody reading: this caller reads its reply itself. Its
            # command may leave before its first wait: a cancelled caller must send none.
            await _checkpoint_if_cancelled()
            return await self._lead_replies(_Slot(self, data, expected, reply_timeout))
        # No check first: a caller cancelled already is cancelled at its wait, before its
        # command can leave (at the end of the pass), and takes it back (``_Slot.abort``).
        slot = _Slot(self, data, expected, reply_timeout)
        try:
            replies: list[Any] = await _wait_task_rescheduled(slot.abort)
        except BaseException:
            slot.cancelled()
            raise
        return replies

    async def _lead_replies(self, slot: _Slot) -> list[Any]:
        """Wait for ``slot``'s replies (alone pending) by reading the socket in this task.

        A read is one synchronous step, so a cancellation (at the wait) never finds bytes read
        and not delivered. The reader takes over any replies still due (a cancelled leader's
        own: drained, or the connection discarded, as for any caller)."""
        self._lead = slot
        slot.task = None  # nobody reschedules this task: it reads
        if self._flush_queued and not self._flush_held:
            # Nothing queued yet to share a write with: it leaves now (module docs).
            self._send_outbox()
        pending = self._pending
        fd = self._fd
        others = False
        try:
            while len(slot.replies) < slot.expected and slot.error is None:
                await _wait_readable(fd)
                before = len(pending)
                self._receive()
                others = others or before - len(pending) > 1
        except trio.ClosedResourceError as exc:  # _fail woke this task (notify_closing)
            self._fail(_unavailable(f"lost connection to {self._url.address}: {exc!r}", exc))
            assert slot.error is not None
            raise _fresh(slot.error) from None
        except BaseException:
            slot.cancelled()
            raise
        finally:
            self._lead = None
            self._arm(_REPLIES if pending else _HANGUP)
        if slot.error is not None:
            raise _fresh(slot.error)
        if others:
            # The callers this read woke run in the next pass: a command this one sends now
            # waits for theirs, to leave in the same write (``_flush``).
            self._flush_held = True
        return slot.replies

    def _arm(self, mask: int) -> None:
        """Make the reader's epoll set watch the socket for ``mask`` (0: for nothing)."""
        watch = self._watch
        if mask == self._watching or watch is None or self._error is not None:
            return
        try:
            if not mask:
                watch.unregister(self._fd)
            elif not self._watching:
                watch.register(self._fd, mask)
            else:
                watch.modify(self._fd, mask)
        except OSError as exc:  # nobody would read the replies due: fail them now
            self._fail(_unavailable(f"lost connection to {self._url.address}: {exc!r}", exc))
            return
        self._watching = mask

    def _receive(self) -> None:
        """One non-blocking read of the socket: each complete reply to its slot, or ``_fail``."""
        if self._error is not None:
            return  # the descriptor may be closed already
        try:
            data = _read(self._fd, _RECEIVE_SIZE)
        except BlockingIOError:  # a spurious wake-up
            return
        except OSError as exc:
            self._fail(_unavailable(f"lost connection to {self._url.address}: {exc!r}", exc))
            return
        if not data:
            self._fail(_unavailable(f"{self._url.address} closed the connection"))
            return
        self._parser.feed(data)
        try:
            self._deliver_all(self._parser)
        except Exception as exc:  # a reply nobody asked for, a protocol error
            self._fail(_unavailable(f"lost connection to {self._url.address}: {exc!r}", exc))

    def _fail(self, error: DurableTrioError) -> None:
        """Mark the connection dead (first error wins), fail every waiter, stop its tasks."""
        if self._error is not None:
            return
        self._error = error
        pending, self._pending = self._pending, deque()
        self._outbox.clear()
        self._outstanding = 0
        for slot in pending:
            if slot.error is None:
                slot.error = error
            slot.wake()
        if self._lead is not None:
            # The leading caller waits on the socket, not on its slot: wake it up there.
            trio.lowlevel.notify_closing(self._fd)
        if self._push_send is not None:
            self._push_send.close()
        self._scope.cancel()

    async def _run(self) -> None:
        """The connection's task (in the client's nursery): reader + writer, then close."""
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    if self._watch is None:
                        nursery.start_soon(self._read_loop)
                    else:
                        nursery.start_soon(self._watch_loop, self._watch)
                    nursery.start_soon(self._write_loop)
                    nursery.start_soon(self._watchdog)
        finally:
            self.close()
            self._release()
            await trio.aclose_forcefully(self._stream)

    def _release(self) -> None:
        """Let go of the flusher and close the reader's epoll set (the connection is closed)."""
        flusher, self._flusher = self._flusher, None
        if flusher is not None:
            flusher.release()
        watch, self._watch = self._watch, None
        if watch is not None:
            trio.lowlevel.notify_closing(watch.fileno())
            watch.close()

    async def _watchdog(self) -> None:
        """Discard the connection when a command waits past its deadline.

        Replies are FIFO, so the connection is stuck as soon as *any* pending command is overdue.
        One cancel-scope deadline per connection (the earliest pending one, lowered by
        ``_request`` when needed, recomputed here when it fires) replaces a scope per command.
        """
        while True:
            self._watch_scope = trio.CancelScope(deadline=self._watch_deadline)
            with self._watch_scope:
                await trio.sleep_forever()
            now = trio.current_time()
            overdue = [slot for slot in self._pending if slot.deadline <= now]
            if overdue:
                for slot in overdue:
                    slot.error = RedisCommandTimeout(
                        f"no reply from {self._url.address} within {slot.timeout:g}s"
                    )
                self._fail(
                    _unavailable(
                        f"connection to {self._url.address} discarded: a command got no reply "
                        f"within {overdue[0].timeout:g}s"
                    )
                )
                return
            self._watch_deadline = min((slot.deadline for slot in self._pending), default=math.inf)

    def _flush(self, timeout: float) -> bool:
        """The flusher's write of the outbox at the end of a pass (:meth:`_send_outbox`), held
        for one pass when a leading caller woke other callers in this one and they have yet to
        run (``timeout == 0``: the loop will not sleep), so that their next commands leave in
        the same write as the leader's. Returns whether the writer was woken."""
        if self._flush_held:
            self._flush_held = False
            if timeout == 0 and self._flusher is not None:
                self._flusher.queue(self)  # written at the end of the next pass
                return False
        self._flush_queued = False
        return self._send_outbox()

    def _send_outbox(self) -> bool:
        """One non-blocking write of the outbox, never cut short by a cancellation (the
        flusher's, or a leading caller's: its connection stays listed for the pass). What the
        socket does not take, and any error, go to the writer; returns whether it was woken."""
        outbox = self._outbox
        if not outbox or self._writer_idle is None or self._error is not None:
            return False  # nothing to send, or the writer's to send (or nothing to write to)
        data = outbox[0] if len(outbox) == 1 else b"".join(outbox)
        outbox.clear()
        try:
            sent = _write(self._fd, data)
        except OSError:  # EAGAIN, or a broken socket the writer's send will report
            sent = 0
        else:
            self.stats.batches += 1
        if sent == len(data):
            return False
        outbox.append(data[sent:])
        self._wake_writer()
        return True

    async def _send_all(self, data: bytes) -> None:
        """``send_all`` straight on the descriptor: what the socket takes now, then the rest
        as it drains (no yield when it takes everything at once, the usual case)."""
        fd = self._fd
        view = memoryview(data)
        while view:
            try:
                sent = os.write(fd, view)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(fd)
            else:
                view = view[sent:]

    def _wake_writer(self) -> None:
        task, self._writer_idle = self._writer_idle, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    def _abort_writer_wait(self, _raise_cancel: Any) -> trio.lowlevel.Abort:
        self._writer_idle = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def _write_loop(self) -> None:
        outbox = self._outbox
        try:
            while True:
                if not outbox:
                    self._writer_idle = trio.lowlevel.current_task()
                    await trio.lowlevel.wait_task_rescheduled(self._abort_writer_wait)
                    continue
                data = outbox[0] if len(outbox) == 1 else b"".join(outbox)
                outbox.clear()
                self.stats.batches += 1
                if self._fd < 0:
                    await self._stream.send_all(data)
                else:
                    await self._send_all(data)
        except Exception as exc:
            self._fail(_unavailable(f"lost connection to {self._url.address}: {exc!r}", exc))

    async def _watch_loop(self, watch: select.epoll) -> None:
        """The reader where callers lead: reads the replies no caller leads for, sees hang-ups.

        It waits on its own epoll set over the socket (a caller may wait on the socket), which
        watches for the replies too only while some are due and no caller leads (``_arm``)."""
        wait_fd = watch.fileno()
        try:
            while True:
                await trio.lowlevel.wait_readable(wait_fd)
                if self._lead is not None:
                    # A hang-up while a caller reads: the caller meets it when it reads (the
                    # end of the stream, or the error). Stop watching till the caller leaves.
                    self._arm(0)
                    continue
                self._receive()
                if not self._pending:
                    self._arm(_HANGUP)
        except Exception as exc:
            self._fail(_unavailable(f"lost connection to {self._url.address}: {exc!r}", exc))

    async def _read_loop(self) -> None:
        reader = self._parser
        push = self._push_send
        fd = self._fd
        try:
            while True:
                if fd < 0:
                    data = await self._stream.receive_some(_RECEIVE_SIZE)
                else:
                    # Straight on the descriptor: wait, then one read (the stream's
                    # receive_some would try first, fail, and yield once more when it works).
                    await trio.lowlevel.wait_readable(fd)
                    try:
                        data = os.read(fd, _RECEIVE_SIZE)
                    except BlockingIOError:  # a spurious wake-up
                        continue
                if not data:
                    self._fail(_unavailable(f"{self._url.address} closed the connection"))
                    return
                reader.feed(cast("bytes", data))
                if push is None:
                    self._deliver_all(reader)
                    continue
                while (reply := reader.gets()) is not _NOT_ENOUGH_DATA:
                    if not self._pending and _unsolicited(reply):
                        # A Cluster node gave a sharded channel's slot away (or the channel's
                        # master became a replica): the subscriber must go where it went.
                        self._fail(
                            _unavailable(f"{self._url.address} ended a sharded subscription")
                        )
                        return
                    if type(reply) is list and len(reply) > 2 and reply[0] in _PUSH_KINDS:
                        if reply[0] == b"pmessage":
                            await push.send((reply[2], reply[3]))
                        else:
                            await push.send((reply[1], reply[2]))
                    else:
                        self._deliver(reply)
        except Exception as exc:
            self._fail(_unavailable(f"lost connection to {self._url.address}: {exc!r}", exc))

    def _deliver_all(self, reader: hiredis.Reader) -> None:
        """Hand every complete reply in ``reader`` to its slot (:meth:`_deliver`, inlined)."""
        pending = self._pending
        stats = self.stats
        read = 0
        try:
            while (reply := reader.gets()) is not _NOT_ENOUGH_DATA:
                if not pending:
                    raise RuntimeError(f"unexpected reply with no command waiting: {reply!r:.80}")
                read += 1
                slot = pending[0]
                replies = slot.replies
                replies.append(reply)
                if len(replies) == slot.expected:
                    pending.popleft()
                    task = slot.task
                    if task is None:
                        if slot is not self._lead:
                            stats.dropped += 1
                    else:
                        slot.task = None
                        _reschedule(task, slot)
        finally:
            self._outstanding -= read
            stats.replies += read

    def _deliver(self, reply: Any) -> None:
        if not self._pending:
            raise RuntimeError(f"unexpected reply with no command waiting: {reply!r:.80}")
        slot = self._pending[0]
        slot.replies.append(reply)
        self._outstanding -= 1
        self.stats.replies += 1
        if len(slot.replies) == slot.expected:
            self._pending.popleft()
            if slot.task is None:
                self.stats.dropped += 1
            else:
                slot.wake()


async def _open_stream(url: RedisURL, connect_timeout: float) -> trio.abc.Stream:
    context = url.ssl_context() if url.tls else None  # ConfigError surfaces as is
    try:
        with trio.fail_after(connect_timeout):
            tcp = await trio.open_tcp_stream(url.host, url.port)
            try:
                tcp.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                if context is None:
                    return tcp
                tls = trio.SSLStream(tcp, context, server_hostname=url.host)
                await tls.do_handshake()
                return tls
            except BaseException:
                await trio.aclose_forcefully(tcp)
                raise
    except trio.TooSlowError as exc:
        message = f"could not connect to {url.address} within {connect_timeout:g}s"
        raise _unavailable(message, exc) from exc
    except (OSError, ssl.SSLError, trio.BrokenResourceError) as exc:
        reason = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) else exc
        raise _unavailable(f"could not connect to {url.address}: {reason}", exc) from exc


async def connect(
    url: RedisURL,
    nursery: trio.Nursery,
    *,
    connect_timeout: float,
    command_timeout: float,
    discard_on_cancel: bool = False,
    scripts: Mapping[str, bytes] | None = None,
    push_buffer: int | None = None,
) -> Connection:
    """Open a connection whose tasks run in ``nursery`` and run the URL's handshake on it.

    ``AUTH`` / ``SELECT`` / ``CLIENT SETNAME`` are pipelined in one round trip within
    ``connect_timeout``. On any failure (or cancellation) nothing is left running.

    Args:
        url: where and how to connect.
        nursery: owns the connection's reader/writer task.
        connect_timeout: seconds for TCP connect + TLS handshake, and again for the handshake.
        command_timeout: default per-command timeout of the connection.
        discard_on_cancel: discard (rather than drain) when a waiting caller is cancelled.
        scripts: ``sha1 -> source`` of known scripts, for the ``NOSCRIPT`` fallback.
        push_buffer: make it a pub/sub connection whose messages go to a channel this big.

    Returns:
        the connection, ready for commands.

    Raises:
        BrokerUnavailable: could not connect (refused, unreachable, timed out, TLS failure).
        RedisAuthError: the credentials were refused (``WRONGPASS``, any error reply to
            ``AUTH``) or the user may not run the handshake (``NOPERM``).
        RedisDatabaseRefused: the database number was refused (``SELECT``).
        RedisReplyError: another refusal of the handshake.
        TransportClosed: the nursery no longer takes new tasks (the client is closing).
        ConfigError: the TLS settings cannot work (an unreadable CA file).
    """
    stream = await _open_stream(url, connect_timeout)
    conn = Connection(
        stream,
        url,
        command_timeout=command_timeout,
        discard_on_cancel=discard_on_cancel,
        scripts=scripts,
        push_buffer=push_buffer,
    )
    try:
        nursery.start_soon(conn._run)
    except RuntimeError as exc:  # "Nursery is closed to new arrivals"
        conn._release()
        await trio.aclose_forcefully(stream)
        raise TransportClosed("the Redis client is closed") from exc
    handshake = url.handshake()
    if handshake:
        try:
            replies = await conn.pipeline(
                handshake, raise_on_error=False, reply_timeout=connect_timeout
            )
        except BaseException:
            conn.close()
            raise
        for index, reply in enumerate(replies):
            if isinstance(reply, RedisReplyError):
                conn.close()
                error = handshake_error(handshake[index], reply, url.address)
                error.index = index
                raise error
    return conn
