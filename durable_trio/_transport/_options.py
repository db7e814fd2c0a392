"""The queue transport's options, their defaults, and the reasons for each default."""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable
from typing import Any

import attrs

from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._codec import DEFAULT_MAX_PAYLOAD_BYTES
from .._errors import ConfigError
from .._logs import get_logger, log_failure
from ._adaptive import Adaptive

__all__ = ["ErrorHook", "TransportOptions", "log_error"]

#: Called with every error a loop survives (sync; keep it quick; it must not raise).
ErrorHook = Callable[[BaseException], None]

_log = get_logger("durable_trio")

#: Empty polls sleep this long (200 ms).
DEFAULT_POLL_INTERVAL = 0.2
#: After consecutive empty polls the sleep doubles up to this many poll intervals (800 ms): an
#: idle worker serving many step names would otherwise hit the broker names x 5 times a second.
DEFAULT_IDLE_BACKOFF_MAX = 4
#: A claim silent this long is presumed dead, on a broker that renews claims: renewal makes a
#: claim's age measure the worker's silence, not the step's runtime, so this can be short and still
#: never re-run a healthy long step. Larger than 30 s so a step that blocks its event loop for a
#: while (CPU-heavy code starves the renewal timer) is not mistaken for a dead worker.
DEFAULT_RENEWING_STALLED_THRESHOLD = 120.0
#: The same on a broker that cannot renew: a claim then ages with the step, so this must clear
#: the longest legitimate step (re-delivery double-runs a merely slow one).
DEFAULT_STALLED_THRESHOLD = 1800.0
#: The reclaim sweep's cadence: coarse, never per poll.
DEFAULT_STALLED_CHECK_INTERVAL = 30.0
#: Seconds after which the claims of a worker whose liveness is gone are taken back: its keys
#: live 35 s after its last beat, plus a few renewals' margin (issue 30, item 9).
DEFAULT_DEAD_WORKER_THRESHOLD = 40.0
#: Reclaims before a job is failed as poison instead of re-delivered again.
DEFAULT_MAX_STALLED_COUNT = 3
#: How long close waits for running handlers before cancelling them.
DEFAULT_CLOSE_TIMEOUT = 5.0
#: The bound on each of close's cleanup phases (withdrawing keys; cancelling and handing back
#: claims): close never hangs on a dead broker.
DEFAULT_CLEANUP_TIMEOUT = 2.0
#: Handler failures (a raising result handler, a failed result push) before a job is failed for
#: good instead of handed back again: nothing is redelivered forever.
DEFAULT_MAX_JOB_ATTEMPTS = 5
#: Liveness key cadence (T11, docs/spec.md).
DEFAULT_WORKER_HEARTBEAT_INTERVAL = 10.0


def log_error(exc: BaseException) -> None:
    """The default error hook: log at ERROR, with the traceback where the error was raised (a
    finding reported without being raised, ``StepNotStarted``, ``LeaseLost``, ..., in one
    line: :func:`~durable_trio._logs.log_exception`).

    A ``BrokerUnavailable`` (a store or broker down: refused, lost, timed out) is one line,
    naming the loop it stopped (``... (in reconcile_forever)``): every loop meets it again and
    again through an outage, and its traceback says nothing its message does not. Another
    ``BrokerError`` the same loop meets again soon after is one line too
    (:func:`~durable_trio._logs.log_failure`). With the ``durable_trio`` logger at DEBUG each
    has its traceback."""
    log_failure(_log, logging.ERROR, exc)


def _positive(_: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
        raise ConfigError(f"{attribute.name} must be a positive number of seconds, got {value!r}")


def _non_negative(_: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (isinstance(value, int | float) and value >= 0 and math.isfinite(value)):
        raise ConfigError(f"{attribute.name} must be >= 0 seconds, got {value!r}")


def _at_least_one(_: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    if type(value) is not int or value < 1:
        raise ConfigError(f"{attribute.name} must be an integer >= 1, got {value!r}")


def _concurrency(_: Any, attribute: attrs.Attribute[Any], value: int | Adaptive) -> None:
    if not isinstance(value, Adaptive):
        _at_least_one(_, attribute, value)


def _optional_count(_: Any, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and (type(value) is not int or value < 0):
        raise ConfigError(f"{attribute.name} must be None or an integer >= 0, got {value!r}")


def _optional_positive(_: Any, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None:
        _positive(_, attribute, value)


@attrs.frozen(kw_only=True, repr=False, eq=False)
class TransportOptions:
    """Every knob of :func:`~durable_trio.open_queue_transport`, validated (seconds as floats)."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    namespace: str | None = None
    """Key prefix of every queue (T2); ``durable`` when absent."""
    partition: str | None = None
    """Tenant partition of the routing tokens (T1)."""
    concurrency: int | Adaptive = attrs.field(default=1, validator=_concurrency)
    """Step handlers running at once in this process, across every step name: a fixed ``int``,
    or ``Adaptive(min=..., max=...)`` to let the controller move it (T6)."""
    result_concurrency: int = attrs.field(default=1, validator=_at_least_one)
    """Result handlers running at once."""
    close_timeout: float = attrs.field(default=DEFAULT_CLOSE_TIMEOUT, validator=_non_negative)
    cleanup_timeout: float = attrs.field(default=DEFAULT_CLEANUP_TIMEOUT, validator=_positive)
    poll_interval: float = attrs.field(default=DEFAULT_POLL_INTERVAL, validator=_positive)
    idle_backoff_max: int = attrs.field(default=DEFAULT_IDLE_BACKOFF_MAX, validator=_at_least_one)
    stalled_threshold: float | None = attrs.field(default=None, validator=_optional_positive)
    """``None``: 120 s on a broker that renews claims, 30 min on one that cannot."""
    stalled_check_interval: float = attrs.field(
        default=DEFAULT_STALLED_CHECK_INTERVAL, validator=_non_negative
    )
    """0 turns the reclaim sweep off."""
    dead_worker_threshold: float | None = attrs.field(
        default=DEFAULT_DEAD_WORKER_THRESHOLD, validator=_optional_positive
    )
    """A worker whose liveness is gone (its keys expired, or its process on this host is dead)
    has its claims taken back once they are this old, instead of after ``stalled_threshold``;
    live workers renew their claims every third of it (issue 30, item 9: see
    ``docs/concepts.md``, "Dead workers"). ``None``: only ``stalled_threshold``. Needs a
    worker-key store and a broker that renews claims."""
    max_stalled_count: int = attrs.field(default=DEFAULT_MAX_STALLED_COUNT, validator=_at_least_one)
    prefetch: int | None = attrs.field(default=0, validator=_optional_count)
    """Jobs a loop claims ahead of its free slots, so a freed slot never waits for a round
    trip (``0``, the default: none, a loop claims only what it can start; ``None``: as many
    as the loop's concurrency). Prefetched claims are renewed, and handed back on close, like
    running ones; the broker stores them as not started until their handler starts, so a
    worker that dies holding them never makes them suspects (their stall is not counted
    toward ``max_stalled_count``). Only on a broker that can (``SupportsClaimAhead``: memory,
    SQLite, Redis); elsewhere it is 0."""
    isolate_suspects: bool = True
    """Run a *suspect* — a step task that stalled before while its handler ran — alone in this
    process: it waits for the other step handlers to finish, no new one starts while it waits
    or runs. A poison step that kills whichever process runs it then kills no innocent step
    beside it after its first run (docs/concepts.md, "A suspect runs alone")."""
    suspect_wait: float = attrs.field(default=10.0, validator=_positive)
    """Longest time a suspect waits for the handlers beside it to finish (this process takes
    no new step meanwhile). Past it the suspect is handed back, attempt-neutral and uncounted,
    for this long, so an idle worker may take it; set it above the longest step to make
    a busy worker wait instead."""
    max_job_attempts: int = attrs.field(default=DEFAULT_MAX_JOB_ATTEMPTS, validator=_at_least_one)
    worker_heartbeat_interval: float = attrs.field(
        default=DEFAULT_WORKER_HEARTBEAT_INTERVAL, validator=_positive
    )
    turn_heartbeat_interval: float = attrs.field(default=10.0, validator=_positive)
    """A remote workflow turn heartbeats this often while it runs (T14)."""
    step_heartbeat_interval: float = attrs.field(default=1.0, validator=_positive)
    """A step handler's beats (``step_info().heartbeat()``) are pushed at most this often
    (at most a third of the step's ``heartbeat_timeout``); beats in between are coalesced."""
    inbox_ttl: float = attrs.field(default=60.0, validator=_positive)
    """An inbox registration lives this long; it is announced again every third of it."""
    tenant_subscribers_cache: float = attrs.field(default=1.0, validator=_non_negative)
    """Seconds the control plane reads a tenant's subscribers through a cache (T21)."""
    inbox_sweep_interval: float = attrs.field(default=60.0, validator=_non_negative)
    """How often the control plane's janitor drains dead instances' inboxes (0: never)."""
    descriptor_cache: float = attrs.field(default=5.0, validator=_non_negative)
    """Seconds worker descriptors are read through a cache (T13)."""
    cancel_on_lost_lease: bool = True
    """T8: cancel a handler whose lease was lost (``False``: let it finish, still unfinalized)."""
    max_payload_bytes: int = attrs.field(default=DEFAULT_MAX_PAYLOAD_BYTES, validator=_at_least_one)
    instance_id: str = attrs.field(factory=lambda: uuid.uuid4().hex)
    on_error: ErrorHook = log_error
