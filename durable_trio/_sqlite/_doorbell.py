"""The cross-process doorbell of a SQLite file: Unix datagram sockets beside the database file.

The broker rings it for its queues, the run store (with a folder suffix of its own) for its
runs' wakes; what follows says "broker" for either.

A broker that waits for work binds a socket ``<db file>.bells/<pid>-<random>``, and a small
thread blocks on it. A broker that committed something that can make work ready on a queue
sends one non-blocking datagram naming that queue to every other socket in that folder; the
receiving thread hands the names to its broker, which wakes those queues' waiters (a datagram
that names no queue makes the broker's connection thread run its wake-up tick at once instead).
The listing is cached and read again only when the folder's modification time changes (one
``stat`` per ring). docs/decisions.md says why this mechanism.

The doorbell is only a hint, never the source of truth: the broker's safety-net tick still runs
every ``wakeup_interval`` and catches whatever a lost datagram missed. So every failure here is
silent after one log line: a folder that cannot be made or written, a path too long for
``AF_UNIX`` (108 bytes) where ``/proc/self/fd`` cannot shorten it, a socket file removed, a
full receive buffer (its owner will wake anyway), a dead process's socket (``ECONNREFUSED``:
unlinked by the sender that found it).
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import socket
import threading
import time
from typing import TYPE_CHECKING, Final
from urllib.parse import unquote, urlsplit

from .._logs import get_logger

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["Doorbell", "bells_folder"]

_log = get_logger("durable_trio")

#: ``sun_path`` holds 108 bytes, the terminating NUL included. A longer path is reached
#: through a descriptor of its folder, ``/proc/self/fd/<fd>/<name>`` (Linux): the kernel
#: resolves it as any path, so the socket file still lands in the folder (see ``_short``).
_MAX_SOCKET_PATH: Final = 107
_PROC_FDS: Final = "/proc/self/fd"

#: A folder modified this recently (seconds) may change again within the same timestamp (its
#: granularity is coarse on some file systems): its listing is not trusted and read again.
_RACY: Final = 1.0

#: A ring names its queue: ``q`` + the name in UTF-8 (the receiver wakes that queue's waiters
#: only); ``?`` when the name cannot be sent (too long, not encodable): every waiting queue of
#: the receiver looks again (its tick). An empty datagram is never sent: ``recv`` returns
#: empty when the receiver is shut down.
_QUEUE: Final = b"q"
_ANY: Final = b"?"
_MAX_DATAGRAM: Final = 1024

#: The shortest time between two wake-ups of one broker by its doorbell (seconds; see
#: ``_receive``). 5 ms keeps S3's latency (jobs a few ms apart wake at once) and wins back a
#: part of a dense stream's throughput (docs/benchmarks.md, the doorbell's before and after).
#: A ring that answers one of ours (a request/reply exchange) waits only :data:`ANSWER_GAP`.
MIN_GAP: float = 0.005

#: What a ring that answers one of ours waits instead of the rest of :data:`MIN_GAP` (issue
#: 30, item 8): nothing. An answer has nothing to gather, and rings of no interest here (see
#: ``interested``) no longer open gaps or hide an answer among them. Measured back to back on
#: this machine (docs/benchmarks.md, "The doorbell's answer gap"): request/reply 5.1 ms before,
#: 1.4-1.5 ms now; S3 (a job 2 ms after the last result) 1.3 ms before, 1.0 ms now.
ANSWER_GAP: float = 0.0

#: How long a close waits for the receiving thread (it is woken by ``shutdown`` at once).
CLOSE_TIMEOUT: Final = 1.0


def _named(datagrams: list[bytes]) -> frozenset[str] | None:
    """The queues ``datagrams`` name, or ``None`` if one names none (every waiting queue looks
    again)."""
    queues: set[str] = set()
    for datagram in datagrams:
        if not datagram.startswith(_QUEUE):
            return None
        queues.add(datagram[1:].decode(errors="replace"))
    return frozenset(queues)


def _always(_queues: frozenset[str] | None) -> bool:
    return True


def bells_folder(path: str, suffix: str = ".bells") -> str | None:
    """The doorbell folder of the database at ``path`` (a file name or a ``file:`` URI), or
    ``None`` for an in-memory database (nobody else can open it). ``suffix`` names the folder
    beside the file (the run stores' wakes have a folder of their own)."""
    if path.startswith("file:"):
        parts = urlsplit(path)
        if "mode=memory" in parts.query:
            return None
        path = unquote(parts.path)
    if path in ("", ":memory:"):
        return None
    return os.path.abspath(path) + suffix


class Doorbell:
    """One broker's doorbell on one database file (see the module docstring).

    Args:
        path: the database file (or ``file:`` URI).
        on_ring: called in the receiving thread when datagrams arrive, with the queues they
            name, or ``None`` if one could not name its queue (coalesced: once per wake-up of
            the thread, however many arrived); it must not block or raise.
        suffix: the folder's suffix (see :func:`bells_folder`).
        purpose: what other processes' rings tell, for the one warning when it cannot work.
        interested: called in the receiving thread with the queues arriving rings name (or
            ``None``): whether a waiter here may care. Rings nobody cares about are handed
            to ``on_ring`` at once and do not count as a wake-up (see ``_receive``); ``None``:
            every ring is of interest.
    """

    def __init__(
        self,
        path: str,
        on_ring: Callable[[frozenset[str] | None], None],
        *,
        suffix: str = ".bells",
        purpose: str = "pushes are noticed by the wake-up tick",
        interested: Callable[[frozenset[str] | None], bool] | None = None,
    ) -> None:
        self.folder = bells_folder(path, suffix)
        self._interested: Callable[[frozenset[str] | None], bool] = interested or _always
        self._purpose = purpose
        self._on_ring = on_ring
        self._lock = threading.Lock()
        self._sender: socket.socket | None = None
        self._listing: tuple[int, float, tuple[str, ...]] | None = None
        """(the folder's ``st_mtime_ns``, when it was listed (wall clock), the socket names)."""
        self._own: str | None = None
        """Our socket's file name (in the folder), while bound."""
        self._receiver: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._folder_fd: int | None = None
        """The ringing thread's descriptor of the folder, when its paths are too long."""
        self._warned = False
        self._closed = False
        self.sent = 0
        """Datagrams sent (one per other socket per ring)."""
        self.received = 0
        """Wake-ups the receiving thread handed to the broker (each for one ring or more)."""
        self.unlinked = 0
        """Dead processes' sockets removed."""
        self.skipped_gaps = 0
        """Wake-ups within :data:`MIN_GAP` of the last that waited only :data:`ANSWER_GAP`
        (answers to our rings)."""
        self._rang = False
        """Whether this doorbell rang another since its last wake-up (written by the ringing
        thread, read and cleared by the receiving one: a plain flag, a lost race costs one
        gap or one early wake-up, never a ring)."""

    @property
    def bound(self) -> bool:
        """Whether this broker listens (its socket is bound)."""
        return self._own is not None

    # -- listening

    def listen(self) -> None:
        """Bind our socket and start the receiving thread, unless already done. Never raises:
        without a doorbell the broker's tick alone wakes the waiters (one log line says so)."""
        with self._lock:
            if self._own is not None or self.folder is None or self._closed:
                return
            name = f"{os.getpid()}-{secrets.token_hex(6)}"
            address = os.path.join(self.folder, name)
            receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            folder_fd: int | None = None
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(self.folder)
                if _fits(address):
                    receiver.bind(address)
                else:
                    folder_fd = _open_folder(self.folder)
                    if folder_fd is None:
                        receiver.close()
                        self._warn(f"the path {address!r} is too long for a Unix socket")
                        return
                    receiver.bind(_short(folder_fd, name))
            except OSError as exc:
                receiver.close()
                self._warn(f"cannot bind {address!r}: {exc}")
                return
            finally:
                if folder_fd is not None:
                    os.close(folder_fd)  # the bound socket stays in the folder without it
            self._own, self._receiver = name, receiver
            self._thread = threading.Thread(
                target=self._receive, args=(receiver,), name=f"durable-trio-doorbell:{name}",
                daemon=True,
            )
            self._thread.start()

    def check(self) -> None:
        """Bind a fresh socket if ours was removed (by a person, or with its folder). Cheap
        (one ``stat``): the safety-net tick calls it."""
        own = self._own
        if own is None or self.folder is None:
            return
        try:
            os.stat(os.path.join(self.folder, own))
        except FileNotFoundError:
            self._stop_listening()
            self.listen()
        except OSError:
            pass  # not ours to judge: the tick still runs

    def close(self) -> None:
        """Stop the receiving thread (bounded by :data:`CLOSE_TIMEOUT`) and remove our socket.
        Idempotent."""
        with self._lock:
            self._closed = True
        self._stop_listening()
        with self._lock:
            sender, self._sender = self._sender, None
            folder_fd, self._folder_fd = self._folder_fd, None
        if sender is not None:
            sender.close()
        if folder_fd is not None:
            os.close(folder_fd)

    def _stop_listening(self) -> None:
        with self._lock:
            own, receiver, thread = self._own, self._receiver, self._thread
            self._own = self._receiver = self._thread = None
        if receiver is None:
            return
        with contextlib.suppress(OSError):
            receiver.shutdown(socket.SHUT_RDWR)  # wakes the blocked recv at once
        if thread is not None and thread is not threading.current_thread():
            thread.join(CLOSE_TIMEOUT)
        receiver.close()
        if own is not None and self.folder is not None:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.folder, own))

    def _receive(self, receiver: socket.socket) -> None:
        last = -math.inf
        while True:
            try:
                datagram = receiver.recv(_MAX_DATAGRAM)
                if not datagram:
                    return  # shut down: the broker closes
                # Rings closer than MIN_GAP to the last wake-up wait out the gap, gathering
                # the rings that follow: under a stream of pushes a waiter wakes once for
                # several jobs (each wake-up costs its process a pop, a write transaction
                # that contends with the pusher's), while a ring after a quiet spell wakes at
                # once. The one ring that answers ours (we rang since our last wake-up, and
                # nothing else waits: a request/reply exchange back to back, issue 30, item 8)
                # has nothing to gather: it waits only ANSWER_GAP.
                datagrams = [datagram]
                _drain(receiver, datagrams)
                # Rings for queues nobody here waits on (another process's traffic, e.g. an
                # engine's own results queue) are handed over at once and are not a wake-up:
                # they neither open a gap for the next ring, which may be the answer to ours,
                # nor count as a second ring to gather (issue 30, item 8).
                wanted = [d for d in datagrams if self._interested(_named([d]))]
                if not wanted:
                    self._on_ring(_named(datagrams))
                    continue
                wait = last + MIN_GAP - time.monotonic()
                if wait > 0:
                    if self._rang and len(wanted) == 1:
                        self.skipped_gaps += 1
                        wait = min(wait, ANSWER_GAP)
                    time.sleep(wait)
                    # Drain what else arrived: one wake-up answers every ring so far.
                    _drain(receiver, datagrams)
            except OSError:
                return
            self.received += 1
            self._rang = False
            last = time.monotonic()
            self._on_ring(_named(datagrams))

    # -- ringing

    def ring(self, queue: str | None) -> None:
        """Send one datagram naming ``queue`` to every other broker's socket (``None``: naming
        none, the receivers look at every waiting queue). Never blocks, never raises.

        Called by one thread at a time (the broker's connection thread)."""
        if self.folder is None or self._closed:
            return
        try:
            names = self._names()
            if not names:
                return
            sender = self._sender
            if sender is None:
                sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                sender.setblocking(False)
                self._sender = sender
            try:
                payload = _ANY if queue is None else _QUEUE + queue.encode()
            except UnicodeEncodeError:
                payload = _ANY
            if len(payload) > _MAX_DATAGRAM:
                payload = _ANY
            own = self._own
            for name in names:
                if name != own and self._send(sender, name, payload):
                    self._rang = True
        except OSError as exc:
            self._warn(f"cannot ring the doorbells in {self.folder!r}: {exc}")

    def _names(self) -> tuple[str, ...]:
        assert self.folder is not None
        try:
            folder = os.stat(self.folder)
        except FileNotFoundError:
            self._forget_folder()
            return ()
        mtime = folder.st_mtime_ns
        listing = self._listing
        if listing is not None and listing[0] == mtime and listing[1] - mtime / 1e9 > _RACY:
            return listing[2]
        if self._folder_fd is not None:
            held = os.fstat(self._folder_fd)
            if (held.st_dev, held.st_ino) != (folder.st_dev, folder.st_ino):
                self._forget_folder()  # removed and made again: our descriptor names the old
        listed_at = time.time()
        names = tuple(os.listdir(self.folder))
        self._listing = (mtime, listed_at, names)
        return names

    def _send(self, sender: socket.socket, name: str, payload: bytes) -> bool:
        """Send ``payload`` to socket ``name``; whether it was sent."""
        assert self.folder is not None
        address = os.path.join(self.folder, name)
        try:
            sender.sendto(payload, self._reachable(address, name))
            self.sent += 1
            return True
        except ConnectionRefusedError:
            # Nobody reads it: a process that died without closing (kill -9).
            with contextlib.suppress(OSError):
                os.unlink(address)
                self.unlinked += 1
            self._listing = None
        except FileNotFoundError:
            self._forget_folder()  # gone, or made again: a fresh descriptor next time
        except (BlockingIOError, BrokenPipeError):
            pass  # its buffer is full (it will wake anyway), or it is closing
        except OSError as exc:
            self._warn(f"cannot ring {address!r}: {exc}")
        return False

    def _reachable(self, address: str, name: str) -> str:
        """``address``, or the same socket reached through our descriptor of the folder."""
        if _fits(address):
            return address
        assert self.folder is not None
        if self._folder_fd is None:
            self._folder_fd = _open_folder(self.folder)
            if self._folder_fd is None:
                raise OSError(f"the path {address!r} is too long for a Unix socket")
        return _short(self._folder_fd, name)

    def _forget_folder(self) -> None:
        self._listing = None
        folder_fd, self._folder_fd = self._folder_fd, None
        if folder_fd is not None:
            with contextlib.suppress(OSError):
                os.close(folder_fd)

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            _log.warning(
                "SQLite doorbell: %s; other processes' %s alone", message, self._purpose,
            )


def _drain(receiver: socket.socket, datagrams: list[bytes]) -> None:
    """Append what else already arrived on ``receiver`` (without blocking)."""
    with contextlib.suppress(OSError):
        while datagram := receiver.recv(_MAX_DATAGRAM, socket.MSG_DONTWAIT):
            datagrams.append(datagram)


def _fits(address: str) -> bool:
    return len(os.fsencode(address)) <= _MAX_SOCKET_PATH


def _open_folder(folder: str) -> int | None:
    """A descriptor of ``folder`` to reach its sockets by a short path, or ``None`` where
    ``/proc/self/fd`` does not resolve (not Linux)."""
    if not os.path.isdir(_PROC_FDS):
        return None
    return os.open(folder, getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY)


def _short(folder_fd: int, name: str) -> str:
    """The socket ``name`` in the folder open as ``folder_fd``, by a path that fits
    ``sun_path``: ``/proc/self/fd/<fd>`` is a link to the folder, which the kernel follows when
    it resolves the path of ``bind`` or ``sendto``."""
    return f"{_PROC_FDS}/{folder_fd}/{name}"
