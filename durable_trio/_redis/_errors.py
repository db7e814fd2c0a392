"""The Redis client's own errors, each a leaf of the project's error tree (:mod:`.._errors`)."""

from __future__ import annotations

from .._errors import AuthenticationError, BrokerError, BrokerUnavailable, ConfigError

__all__ = [
    "RedisAuthError",
    "RedisBusyReply",
    "RedisCommandTimeout",
    "RedisCrossSlotError",
    "RedisDatabaseRefused",
    "RedisOutOfMemory",
    "RedisReplyError",
    "handshake_error",
    "is_auth_refusal",
    "raisable",
    "refused_again",
]

#: Replies that mean "not now" rather than "wrong": the server is loading its data, running a
#: busy script, failing over. Raised as :class:`RedisBusyReply` (a BrokerUnavailable too).
TRANSIENT_CODES = frozenset({"LOADING", "BUSY", "TRYAGAIN", "MASTERDOWN", "CLUSTERDOWN"})

#: Replies that mean "these credentials will not do": a wrong password or user (``WRONGPASS``),
#: none given where one is needed (``NOAUTH``), an ACL that denies the command (``NOPERM``).
#: Raised as :class:`RedisAuthError`. Servers before 6.0 answer a wrong password with
#: ``-ERR invalid password``: see :func:`is_auth_refusal`.
AUTH_CODES = frozenset({"WRONGPASS", "NOAUTH", "NOPERM"})


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


class RedisOutOfMemory(RedisReplyError, BrokerUnavailable):
    """Redis refused a write because it is out of memory (``-OOM command not allowed when used
    memory > 'maxmemory'``): it runs at ``maxmemory`` with ``maxmemory-policy noeviction``
    (the policy the broker asks for), so it keeps every key and refuses what would add one.

    Nothing was written: a script is refused at its first write, before any other (one that
    already wrote runs to its end). Transient, like :class:`RedisBusyReply`: a
    :class:`~durable_trio.BrokerUnavailable`, so a worker tries its finalize again and the
    loops back off until memory is freed (or ``maxmemory`` raised); its message says so,
    rather than looking like a broken connection.
    """

    def __init__(self, reply: str) -> None:
        super().__init__(reply)
        self.args = (
            f"Redis is out of memory and refuses writes (used memory > maxmemory, "
            f"maxmemory-policy noeviction): free memory or raise maxmemory; nothing of the "
            f"refused command was written, and work resumes once memory is back [{reply}]",
        )


class RedisClusterTLSMismatch(BrokerError, ConfigError):
    """A ``rediss+cluster://`` client read a slot map that names no TLS port: the nodes run
    without ``tls-cluster yes``, so they do not know each other's TLS ports and would send the
    client to plain ones (where a TLS handshake only times out).

    A :class:`~durable_trio.ConfigError`, final: the first command (and ``open_backend``) fails
    with it at once, naming the setting. A :class:`~durable_trio.BrokerError` too, so a
    background refresh that meets it is quiet, like any other failed refresh.
    """


class RedisAuthError(RedisReplyError, AuthenticationError):
    """Redis refused the credentials or the user's ACL denied a command (``WRONGPASS``,
    ``NOAUTH``, ``NOPERM``, ``-ERR invalid password``, any error reply to ``AUTH``).

    An :class:`~durable_trio.AuthenticationError`, so opening a backend fails with it once,
    without retrying. It is a :class:`RedisReplyError` too: when it happens later (a password
    rotated while the process runs), the loops that report broker failures and back off treat it
    like any other, instead of ending the process.

    Attributes:
        address: ``host:port`` of the server that refused (never the credentials).
        sentinel: the sentinels refused the URL's ``sentinel_password`` (not the data nodes'
            credentials): the message says so, since the two are fixed in different places.
    """

    def __init__(self, reply: str, *, address: str = "", sentinel: bool = False) -> None:
        super().__init__(reply)
        self.address = address
        self.sentinel = sentinel
        # The message says what to fix; the reply text is the server's (Redis never echoes the
        # password given to AUTH in it).
        where = f"Redis at {address}" if address else "Redis"
        if sentinel:
            text = (
                f"{where} refused the sentinel_password of the backend URL: {reply} "
                "(check the sentinel_password option, percent-encoded: the sentinels' "
                "requirepass, not the data nodes' password)"
            )
        else:
            text = (
                f"{where} refused the credentials of the backend URL: {reply} "
                "(check its user name and password, percent-encoded, and the user's ACL)"
            )
        self.args = (text,)


class RedisDatabaseRefused(RedisReplyError, ConfigError):
    """Redis refused the backend URL's database number (``SELECT``: ``-ERR DB index is out of
    range``): the URL is wrong, the server is up. A :class:`~durable_trio.ConfigError`, so
    opening a backend fails with it once, in words, as for refused credentials (not as an
    outage, "unavailable").

    Attributes:
        address: ``host:port`` of the server that refused.
        database: the database number the URL asked for.
    """

    def __init__(self, reply: str, *, address: str = "", database: str = "") -> None:
        super().__init__(reply)
        self.address = address
        self.database = database
        where = f"Redis at {address}" if address else "Redis"
        self.args = (
            f"{where} refused database {database} of the backend URL: {reply} (the /DB after "
            "the host must be below the server's `databases` setting, 16 by default)",
        )


def handshake_error(
    command: tuple[str, ...], reply: RedisReplyError, address: str
) -> RedisReplyError:
    """The exception to raise for ``reply`` to a connection's handshake ``command``.

    Whatever the server says to ``AUTH``, the credentials will not do (servers before 6.0
    answer a wrong password with a plain ``-ERR``): a :class:`RedisAuthError`. An ``-ERR``
    to ``SELECT``: a :class:`RedisDatabaseRefused`. Else as :func:`raisable`.
    """
    if command[0] == "AUTH":
        return RedisAuthError(reply.reply, address=address)
    if command[0] == "SELECT" and reply.code == "ERR":
        return RedisDatabaseRefused(reply.reply, address=address, database=command[1])
    return raisable(reply, address)


def refused_again(
    refusal: RedisAuthError | RedisDatabaseRefused,
) -> RedisAuthError | RedisDatabaseRefused:
    """A new exception saying ``refusal`` again (a client backing off after it raises this,
    never "unavailable": waiting alone would not fix the URL)."""
    again: RedisAuthError | RedisDatabaseRefused
    if isinstance(refusal, RedisAuthError):
        again = RedisAuthError(refusal.reply, address=refusal.address, sentinel=refusal.sentinel)
    else:
        again = RedisDatabaseRefused(
            refusal.reply, address=refusal.address, database=refusal.database
        )
    again.index = refusal.index
    return again


def is_auth_refusal(reply: RedisReplyError) -> bool:
    """Whether ``reply`` says the credentials (or the ACL) will not do.

    Args:
        reply: an error reply.

    Returns:
        true for ``WRONGPASS`` / ``NOAUTH`` / ``NOPERM`` and the older servers' ``-ERR invalid
        password``.
    """
    return reply.code in AUTH_CODES or (
        reply.code == "ERR" and "invalid password" in reply.reply.lower()
    )


def raisable(reply: RedisReplyError, address: str = "") -> RedisReplyError:
    """The exception to raise for ``reply``: a :class:`RedisBusyReply` for a transient one, a
    :class:`RedisOutOfMemory` for ``-OOM``, a :class:`RedisAuthError` for a refusal of the
    credentials (see :func:`is_auth_refusal`).

    Args:
        reply: the error reply.
        address: ``host:port`` of the server, for the message of an authentication error.

    Returns:
        the exception (``reply`` itself when it needs no other type).
    """
    if isinstance(reply, RedisBusyReply | RedisAuthError | RedisOutOfMemory):
        return reply
    if reply.code == "OOM":
        full = RedisOutOfMemory(reply.reply)
        full.index = reply.index
        return full
    if reply.code in TRANSIENT_CODES:
        busy = RedisBusyReply(reply.reply)
        busy.index = reply.index
        return busy
    if is_auth_refusal(reply):
        refused = RedisAuthError(reply.reply, address=address)
        refused.index = reply.index
        return refused
    return reply


class RedisCrossSlotError(ConfigError):
    """A command for a Redis Cluster whose keys are in more than one slot (what the server
    answers with ``-CROSSSLOT``), refused by the client before anything is sent.

    A :class:`~durable_trio.ConfigError`: retrying cannot help; give the keys one ``{hash tag}``.

    Attributes:
        slots: the slots the keys fall in, sorted.
    """

    def __init__(self, command: str, slots: list[int]) -> None:
        shown = ", ".join(str(slot) for slot in slots[:5]) + (", ..." if len(slots) > 5 else "")
        super().__init__(
            f"CROSSSLOT: the keys of {command} are in {len(slots)} Cluster slots ({shown}); "
            "one command's keys must share one slot: give them one {hash tag}"
        )
        self.slots = slots
