"""The store's identity on Redis: a loss nobody would otherwise report, detected.

A Redis restarted with an empty dataset (no persistence, a lost volume), a ``FLUSHALL``, a
failover to an empty replica: the runs whose start had returned, the queued jobs and the claims
are gone, and the processes see nothing but a few connection errors. So the store carries an
identity, stamped once when it is first used, and every broker checks it:

=============================  ======  ==========================================================
``{durable-trio}:identity``    string  ``"<16 hex digits> <unix time stamped>"``, set by the
                                       first broker to find none, never changed (a new one is
                                       stamped only with the alarm, after a loss)
``{durable-trio}:store-lost``  string  the alarm: a JSON record of the first detection of a loss
                                       (``lost``, ``found``, ``at``, ``by``), kept until an
                                       operator acknowledges it (deletes the key)
=============================  ======  ==========================================================

A broker reads the identity when it is entered, then every ``store_check_interval`` seconds and
whenever its client opens a connection (a reconnection: what a restart looks like from here):
one ``MGET`` of both keys while all is well (the identity it knows is there), else ONE script
run. If the identity it knows is gone or another one, the store was emptied or replaced: the
script records the alarm (the first detector's record stays) and stamps a new identity if there
is none, in the same step (it reads both keys again, so a change between the two is seen); the
broker logs a :class:`~durable_trio.StoreLost` at ERROR once, hands it to ``on_error``, and keeps
it (:meth:`StoreIdentity.read_loss`: health, the console) until the record is deleted. A process
that starts later finds the record and reports it the same way. The processes work on: the
store works, only what it held is gone (docs/decisions.md, "A store emptied under running
processes").

On a Redis Cluster the identity is one key, on one master: the loss of that master's data is
detected, not that of another master alone (a master restarted empty with no replica to take
over).
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from typing import TYPE_CHECKING, Any, Final

import orjson
import trio

from ..._errors import BrokerError, StoreLost, TransportClosed
from ..._failures import report_through
from ..._logs import get_logger

if TYPE_CHECKING:
    from collections.abc import Callable

    from trio_util import RepeatedEvent

    from ..._redis import RedisClient, RedisClusterClient

__all__ = [
    "ALARM_KEY",
    "IDENTITY_KEY",
    "StoreIdentity",
    "acknowledge_store_loss",
    "read_store_loss",
]

logger = get_logger("durable_trio.redis")

#: The store's identity (one hash tag with the alarm: the script touches one Cluster slot).
IDENTITY_KEY: Final = "{durable-trio}:identity"

#: The loss alarm, until an operator deletes it.
ALARM_KEY: Final = "{durable-trio}:store-lost"

# KEYS: identity alarm. ARGV: the identity this process knows ('' = none yet), a fresh one, the
# alarm record to write if this run finds a loss (a JSON object, "found" added here).
# Returns {identity now, alarm record or false, 1 if this run found the loss else 0}. Writes
# nothing while the identity is the one known (or a first one is there).
_CHECK: Final = """
local found = redis.call('GET', KEYS[1])
local alarm = redis.call('GET', KEYS[2])
if found and (ARGV[1] == '' or found == ARGV[1]) then
  return {found, alarm, 0}
end
if ARGV[1] == '' then
  -- A store used for the first time (or never stamped): the first stamp, no alarm.
  redis.call('SET', KEYS[1], ARGV[2])
  return {ARGV[2], alarm, 0}
end
-- Emptied or replaced: the alarm (the first detector's record stays), then a new identity if
-- none stands, in one step, so no later check takes the new store for the old one quietly.
local replaced = found
if not found then
  found = ARGV[2]
  redis.call('SET', KEYS[1], found)
end
if not alarm then
  -- (the record's "found": the identity that stood instead of the known one, or null)
  alarm = string.sub(ARGV[3], 1, -2) .. ',"found":' .. (replaced and cjson.encode(replaced) or
    'null') .. '}'
  redis.call('SET', KEYS[2], alarm)
end
return {found, alarm, 1}
"""


def _who() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _loss(record: bytes | str) -> StoreLost:
    """The :class:`StoreLost` of a stored alarm record (a damaged record still raises the
    alarm, with what could be read)."""
    try:
        fields: Any = orjson.loads(record)
        return StoreLost.identity_gone(
            str(fields["lost"]),
            str(fields["found"]) if fields.get("found") else None,
            detected_at=float(fields["at"]),
            detected_by=str(fields["by"]),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        text = record.decode(errors="replace") if isinstance(record, bytes) else record
        return StoreLost.identity_gone(
            f"(unreadable alarm record: {text[:80]!r})", None, detected_at=0.0, detected_by="?"
        )


async def read_store_loss(client: RedisClient | RedisClusterClient) -> StoreLost | None:
    """The loss alarm recorded in the store, ``None`` if there is none (one ``GET``, no
    write: for a health read).

    Raises:
        BrokerError: Redis did not answer.
    """
    record = await client.execute("GET", ALARM_KEY)
    return None if record is None else _loss(record)


async def acknowledge_store_loss(client: RedisClient | RedisClusterClient) -> bool:
    """Delete the loss alarm (an operator has seen it); the running brokers clear theirs at
    their next check. ``False``: there was none.

    Raises:
        BrokerError: Redis did not answer.
    """
    return bool(await client.execute("DEL", ALARM_KEY))


class StoreIdentity:
    """One broker's watch on the store's identity (see the module docs).

    Args:
        client: the broker's client.
        interval: seconds between two checks.
        on_error: the broker's hook (a :class:`~durable_trio.StoreLost` is handed to it once per
            alarm).
        connected: set by the client on every new connection (a check follows at once), or
            ``None`` (periodic checks only).
    """

    def __init__(
        self,
        client: RedisClient | RedisClusterClient,
        interval: float,
        on_error: Callable[[Exception], object] | None,
        connected: RepeatedEvent | None,
    ) -> None:
        self._client = client
        self._check = client.script(_CHECK)
        self._interval = interval
        self._on_error = on_error
        self._connected = connected
        self.identity: str | None = None
        """The identity this process knows (``None``: not read yet)."""
        self._alarm: StoreLost | None = None
        self._stored = False  # the alarm is the store's record (cleared once it is deleted)
        self._scope = trio.CancelScope()

    @property
    def alarm(self) -> StoreLost | None:
        """The loss this process knows of, until acknowledged (``None``: none)."""
        return self._alarm

    async def check(self) -> None:
        """One check: stamp, compare, record and raise the alarm (see the module docs).

        Raises:
            BrokerError: Redis did not answer (the next check tries again).
        """
        if self.identity is not None:
            # All is well nearly always: one plain read (one command where the script is three,
            # and no write for a ``min_replicas`` WAIT); the script only when something changed.
            found, stored = await self._client.execute("MGET", IDENTITY_KEY, ALARM_KEY)
            if found is not None and found.decode(errors="replace") == self.identity:
                self._settle(stored)
                return
        known = self.identity or ""
        stamp = f"{secrets.token_hex(8)} {time.time():.0f}"
        at, by = round(time.time(), 3), _who()
        record = orjson.dumps({"lost": known, "at": at, "by": by})
        now, stored, lost_here = await self._check(
            (IDENTITY_KEY, ALARM_KEY), (known, stamp, record)
        )
        now = now.decode()
        if lost_here:
            replaced = None if now == stamp else now  # (another one stood: another store)
            self._raise(
                StoreLost.identity_gone(known, replaced, detected_at=at, detected_by=by),
                stored=False,
            )
        self.identity = now
        self._settle(stored)

    def _settle(self, stored: bytes | None) -> None:
        """The alarm as the store's record says (``stored``: the record, ``None``: none)."""
        if stored is not None:
            self._raise(_loss(stored), stored=True)
        elif self._stored:
            logger.warning("the store-loss alarm was acknowledged (its record deleted)")
            self._alarm, self._stored = None, False

    @property
    def unrecorded(self) -> StoreLost | None:
        """The alarm, if its record could not be written to the store (else ``None``)."""
        return None if self._stored else self._alarm

    def _raise(self, loss: StoreLost, *, stored: bool) -> None:
        """Keep ``loss`` as the alarm; one not known yet is logged at ERROR and reported once
        (a record another process wrote of the loss this one found is not reported again)."""
        known = self._alarm
        self._alarm, self._stored = loss, stored
        if known is None or (not stored and (known.lost, known.detected_by) != (
            loss.lost, loss.detected_by
        )):  # fmt: skip
            logger.error("%s", loss)
            if self._on_error is not None:
                report_through(self._on_error, loss, logger)

    async def read_loss(self) -> StoreLost | None:
        """The loss recorded in the store (or found by this watch and not recorded yet),
        ``None`` if none stands (one ``GET``; see :func:`read_store_loss`).

        Raises:
            BrokerError: Redis did not answer.
        """
        stored = await read_store_loss(self._client)
        return stored if stored is not None else self.unrecorded

    async def acknowledge(self) -> bool:
        """Delete the loss alarm (see :func:`acknowledge_store_loss`). ``False``: none stood.

        Raises:
            BrokerError: Redis did not answer.
        """
        return await acknowledge_store_loss(self._client)

    def stop(self) -> None:
        """End :meth:`watch` (from any task; it does not wait)."""
        self._scope.cancel()

    async def watch(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Check now, then every ``interval`` seconds and after every new connection, until
        :meth:`stop`. A failed check is logged at debug level (the broker's own calls report
        the outage) and tried again at the next tick."""
        with self._scope:
            task_status.started()
            while True:
                try:
                    await self.check()
                except BrokerError as exc:
                    logger.debug("store identity not checked: %s", exc)
                except TransportClosed:
                    return
                with trio.move_on_after(self._interval):
                    if self._connected is None:
                        await trio.sleep_forever()
                    else:
                        await self._connected.wait()
