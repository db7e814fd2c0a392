"""The key layout of one Redis queue: the names of its keys, each under the queue's hash tag
``{Q}`` (one Cluster slot per queue), grouped as each script takes them, and the priority range
a ``ready`` score holds (see the key layout in :mod:`durable_trio.brokers.redis`)."""

from __future__ import annotations

from typing import Final

import attrs

from ..._attrs_shared import shared_repr
from ._bell import Bell

__all__ = ["MAX_PRIORITY", "MIN_PRIORITY", "PUSH_KEYS", "SLOT_KEYS", "Queue"]

#: Priorities a job may have: a ``ready`` score is a double, exact for integers up to 2**53.
MIN_PRIORITY: Final = -(2**53)
MAX_PRIORITY: Final = 2**53

#: The keys of a push script (see :data:`~durable_trio.brokers.redis._seq.TAKE_SEQ`: the last
#: four are read or written only to repair a damaged sequence counter).
PUSH_KEYS: Final = (
    "seq", "ready", "delayed", "jobs", "meta", "armed", "claims", "moved", "active", "quarantine"
)  # fmt: skip


#: The keys a script that ends a lease (or parks a job) takes for the fleet-wide limit, in this
#: order after its own (see :data:`~durable_trio.brokers.redis._slots.FREE_SLOT`).
SLOT_KEYS: Final = ("held", "parked", "full", "ready", "armed")


@attrs.frozen(eq=False, repr=False)
class Queue:
    """The key names of one queue (every one under its hash tag ``{name}``), grouped as each
    script takes them, and the broker's wake-up state for it (:attr:`bell`)."""

    __repr__ = shared_repr

    name: str
    channel: bytes
    push_keys: tuple[str, ...]
    claim_keys: tuple[str, ...]
    complete_keys: tuple[str, ...]
    fail_keys: tuple[str, ...]
    retry_keys: tuple[str, ...]
    active_key: str
    claimed_key: str
    """Set by every claim, cleared by a sweep that leaves no claim: idle queues are skipped."""
    recover_keys: tuple[str, ...]
    size_keys: tuple[str, ...]
    peek_keys: tuple[str, ...]
    limit_keys: tuple[str, ...]
    """The keys of the script that sets the queue's limit (see ``SET_LIMIT``)."""
    limit_key: str
    parked_key: str
    failed_key: str
    quarantine_key: str
    armed_key: str
    ready_key: str
    delayed_key: str
    jobs_key: str
    moved_key: str
    bell: Bell = attrs.Factory(Bell)
    """A broker's wake-up state for this queue (its doorbell's rings, its last empty pop)."""

    @classmethod
    def make(cls, name: str, db: int) -> Queue:
        """The keys of queue ``name`` whose doorbell rings on database ``db``'s channel.

        Raises:
            ValueError: ``name`` is empty or has braces (it is the keys' hash tag).
        """
        if not name or "{" in name or "}" in name:
            raise ValueError(f"a Redis queue name is not empty and has no braces: {name!r}")

        def keys(*parts: str) -> tuple[str, ...]:
            return tuple(f"{{{name}}}:{part}" for part in parts)

        return cls(
            name=name,
            channel=f"{{{name}}}:doorbell@{db}".encode(),
            push_keys=keys(*PUSH_KEYS),
            claim_keys=keys(
                "seq",
                "ready",
                "delayed",
                "active",
                "jobs",
                "meta",
                "stalls",
                "claims",
                "armed",
                "claimed",
                "quarantine",
                "moved",
                *SLOT_KEYS,
                "limit",
            ),
            complete_keys=keys("active", "jobs", "meta", "stalls", "claims", *SLOT_KEYS),
            fail_keys=keys("active", "jobs", "meta", "stalls", "claims", "failed", *SLOT_KEYS),
            retry_keys=keys(
                "seq",
                "ready",
                "delayed",
                "active",
                "jobs",
                "meta",
                "stalls",
                "claims",
                "armed",
                "failed",
                "moved",
                "quarantine",
                *SLOT_KEYS,
            ),
            active_key=keys("active")[0],
            recover_keys=keys(
                "seq",
                "ready",
                "active",
                "jobs",
                "meta",
                "stalls",
                "claims",
                "armed",
                "claimed",
                "quarantine",
                "moved",
                "delayed",
                *SLOT_KEYS,
            ),
            claimed_key=keys("claimed")[0],
            size_keys=keys("ready", "delayed", "parked"),
            peek_keys=keys("ready", "delayed", "armed", "limit", "active", "jobs", "held", "full"),
            limit_keys=keys("limit", *SLOT_KEYS, "active", "jobs"),
            limit_key=keys("limit")[0],
            parked_key=keys("parked")[0],
            failed_key=keys("failed")[0],
            quarantine_key=keys("quarantine")[0],
            armed_key=keys("armed")[0],
            ready_key=keys("ready")[0],
            delayed_key=keys("delayed")[0],
            jobs_key=keys("jobs")[0],
            moved_key=keys("moved")[0],
        )
