"""The one small exception tree every public call raises from (httpcore's flat tree).

Adapters translate their own failures (socket errors, sqlite3 errors, Redis error replies) into
these at their edge, so a caller never has to know which backend it runs on.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "BrokerError",
    "BrokerUnavailable",
    "ConfigError",
    "DamagedJob",
    "DurableTrioError",
    "JobError",
    "LeaseLost",
    "PayloadError",
    "PayloadTooLarge",
    "StoreLost",
    "TransportClosed",
]


class DurableTrioError(Exception):
    """Base class of every error this package raises or reports."""


class ConfigError(DurableTrioError, ValueError):
    """An option or URL that cannot work (a negative timeout, an unknown backend scheme)."""


class AuthenticationError(ConfigError):
    """The backend refused the credentials: a wrong user name or password, a disabled user, or
    an ACL that denies the commands needed (Redis ``WRONGPASS``, ``NOAUTH``, ``NOPERM``).

    Final: :func:`~durable_trio.open_backend` raises it once, without retrying (waiting would
    not fix the URL). Its message names the server and the refusal, never the credentials.
    """


class PayloadError(DurableTrioError, ValueError):
    """A wire message that is not what the protocol says: not JSON, the wrong shape, a bad field.

    Attributes:
        path: where in the message it went wrong (``$.attempt``), when known.
    """

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class PayloadTooLarge(PayloadError):
    """A payload over ``max_payload_bytes``: refused at dispatch, failed (not parsed) on a queue."""


class BrokerError(DurableTrioError):
    """A broker or key store call failed. Usually transient: loops report it and back off."""


class BrokerUnavailable(BrokerError):
    """The broker could not be reached (connection refused or reset, a timeout)."""


class StoreLost(BrokerUnavailable):
    """The store's file was deleted or replaced under this process (SQLite): its connection
    still reaches the old file, which nobody else can, so every later call on it is refused
    with this error, naming the file and what happened, instead of writing where no other
    process will ever look. Loops report it and keep trying (so it stays loud); restart the
    process to open the file now at that path (docs/deployment.md, "SQLite notes")."""


class TransportClosed(DurableTrioError):
    """The transport is closed (or closing) and takes no new work."""


class JobError(DurableTrioError):
    """Something went wrong with one job; reported through the error hook with its coordinates.

    Attributes:
        queue: the queue the job was taken from.
        job_id: the job's id.
    """

    def __init__(self, message: str, *, queue: str, job_id: str) -> None:
        super().__init__(f"{message} [queue={queue!r} job={job_id!r}]")
        self.queue = queue
        self.job_id = job_id


class LeaseLost(JobError):
    """A claim was re-delivered to someone else (the worker went silent past the threshold)."""


class DamagedJob(JobError):
    """A job whose stored fields could not be read (damaged broker data, an evicted key, bytes
    written by another program). The transport sets it aside unread: failed, with the raw bytes
    and this reason kept in the broker's failed set (or its quarantine when even the job's id
    was unreadable). Reported through the error hook; no loop stops for it."""
