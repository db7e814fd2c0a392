"""The Redis client's own errors, each a leaf of the project's error tree (:mod:`.._errors`)."""

from __future__ import annotations

from .._errors import BrokerError, BrokerUnavailable

__all__ = ["RedisBusyReply", "RedisCommandTimeout", "RedisReplyError", "raisable"]

#: Replies that mean "not now" rather than "wrong": the server is loading its data, running a
#: busy script, failing over. Raised as :class:`RedisBusyReply` (a BrokerUnavailable too).
TRANSIENT_CODES = frozenset({"LOADING", "BUSY", "TRYAGAIN", "MASTERDOWN", "CLUSTERDOWN"})


class RedisReplyError(BrokerError):
    """Redis answered a command with an error reply (``-WRONGTYPE ...``, ``-NOAUTH ...``).

    hiredis builds these directly while parsing (it is the reader's ``replyError`` class), so an
    error nested inside an array reply (an ``EXEC`` result, a pipeline slot) is an instance of this
    class too, returned as a value rather than raised.

    Attributes:
        reply: the full error text, as the server sent it (without the leading ``-``).
        code: its first word, upper case (``"ERR"``, ``"WRONGTYPE"``, ``"NOSCRIPT"``), or ``""``.
        index: for an error raised out of a pipeline, the position of the failing command;
            otherwise ``None``.
    """

    index: int | None = None

    def __init__(self, reply: str) -> None:
        super().__init__(reply)
        self.reply = reply
        head, _, _ = reply.partition(" ")
        self.code = head if head.isupper() else ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.reply!r})"


class RedisCommandTimeout(BrokerUnavailable):
    """A command got no (complete) reply within its timeout; its connection was discarded."""


class RedisBusyReply(RedisReplyError, BrokerUnavailable):
    """An error reply that means the server cannot serve now (``-LOADING``, ``-BUSY``, ...):
    transient, so callers treat it like an unreachable server."""


def raisable(reply: RedisReplyError) -> RedisReplyError:
    """The exception to raise for ``reply``: a :class:`RedisBusyReply` for a transient one."""
    if reply.code in TRANSIENT_CODES and not isinstance(reply, RedisBusyReply):
        busy = RedisBusyReply(reply.reply)
        busy.index = reply.index
        return busy
    return reply
