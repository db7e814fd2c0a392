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
    """The store was emptied, deleted or replaced under a running process; whatever it held
    before (runs, queued jobs, claims, schedules) is out of this process's reach.

    - Redis: the identity stamped in the store when it was first used is gone (a
      ``FLUSHALL``, a restart without its data, a failover to an empty replica) or is another
      one (another server at the same address). Reported loudly (logged at ERROR, through
      ``on_error``, in health and the console) and kept as an alarm in the store until an
      operator acknowledges it; the processes work on (docs/decisions.md, "A store emptied
      under running processes"). :attr:`lost`, :attr:`found`, :attr:`detected_at` and
      :attr:`detected_by` say which identity and when.
    - PostgreSQL: the schema's identity row (stamped by its ``store`` migration) is another one
      (the schema dropped and created again, the database replaced) or gone: reported and kept
      as on Redis, with the same attributes. While the tables are missing, every broker and
      worker-key call raises this error naming the schema; the processes do not create the
      tables again (docs/deployment.md, "A schema dropped or replaced").
    - SQLite: the database file was deleted or replaced under this process: its connection
      still reaches the old file, which nobody else can, so every later call on it is refused
      with this error, naming the file and what happened, instead of writing where no other
      process will ever look. Loops report it and keep trying (so it stays loud); restart the
      process to open the file now at that path (docs/deployment.md, "SQLite notes"). The
      identity attributes are ``None``.

    Attributes:
        lost: the identity that vanished (``"<id> <unix time stamped>"``), or ``None``.
        found: the identity found instead, ``None`` if there was none.
        detected_at: unix time of the detection, or ``None``.
        detected_by: who detected it (``host:pid``), or ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        lost: str | None = None,
        found: str | None = None,
        detected_at: float | None = None,
        detected_by: str | None = None,
    ) -> None:
        super().__init__(message)
        self.lost = lost
        self.found = found
        self.detected_at = detected_at
        self.detected_by = detected_by

    @classmethod
    def identity_gone(
        cls, lost: str, found: str | None, *, detected_at: float, detected_by: str
    ) -> StoreLost:
        """The loss a store identity check found (Redis): ``lost`` gone, ``found`` instead."""
        replaced = f"found the identity {found!r} instead" if found else "found no identity at all"
        return cls(
            f"STORE LOST: the store was emptied or replaced (FLUSHALL, a restart without its "
            f"data, a failover to an empty replica?): its identity {lost!r} is gone, "
            f"{detected_by} {replaced} (unix time {detected_at:.0f}); the runs, queued jobs, "
            "claims and schedules it held before are lost. Kept as an alarm until "
            "acknowledged (docs/deployment.md)",
            lost=lost,
            found=found,
            detected_at=detected_at,
            detected_by=detected_by,
        )


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
