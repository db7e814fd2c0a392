"""The engine's options (its own knobs; the transport's are passed through to it)."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from typing import Any

import attrs

from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._errors import ConfigError
from ._retry import Retry
from ._wall_clock import follow_the_timers

__all__ = ["EngineOptions"]


def _positive(_: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
        raise ConfigError(f"{attribute.name} must be a positive number of seconds, got {value!r}")


def _optional_non_negative(_: Any, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and not (
        isinstance(value, int | float) and value >= 0 and math.isfinite(value)
    ):
        raise ConfigError(f"{attribute.name} must be >= 0 seconds or None, got {value!r}")


def _optional_retention(_: Any, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and not (
        isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    ):
        raise ConfigError(
            f"{attribute.name} must be a positive number of seconds (math.inf: forever) or "
            f"None, got {value!r}"
        )


def _batch(_: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    if type(value) is not int or not 1 <= value <= 10_000:
        raise ConfigError(f"{attribute.name} must be an int from 1 to 10000, got {value!r}")


def _depth(_: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    if type(value) is not int or value < 0:
        raise ConfigError(f"{attribute.name} must be an int >= 0, got {value!r}")


@attrs.frozen(kw_only=True, repr=False, eq=False)
class EngineOptions:
    """The engine's own knobs (the transport's are passed through to it)."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    engine_id: str = attrs.field(factory=lambda: uuid.uuid4().hex)
    """Owner id on the runs this engine drives. Give a restarted engine the SAME id (one live
    process per id!) and it takes its runs back at once instead of after ``run_lease``."""
    run_lease: float = attrs.field(default=30.0, validator=_positive)
    """Seconds a run stays owned without renewal; a dead engine's runs are taken over after
    this (renewed every third of it)."""
    reconcile_interval: float | None = attrs.field(default=5.0, validator=_optional_non_negative)
    """Seconds between two looks for runs nobody drives (``None`` or 0: only at start)."""
    watch_interval: float | None = attrs.field(default=1.0, validator=_optional_non_negative)
    """Seconds between two re-reads of the checkpoints this engine's runs wait on, for results
    applied by another engine sharing the namespace (``None`` or 0: never; fine with one
    engine per namespace). Also the polling period of :meth:`Engine.result` for a run driven
    elsewhere."""
    reconcile: bool = True
    """Take over orphaned runs (at start and every ``reconcile_interval``). ``False``: drive
    only the runs this engine starts (a short-lived ``durable-trio run``)."""
    release_on_close: bool = True
    """On close, give up the runs still in flight so another engine takes them at once."""
    default_retry: Retry = attrs.field(factory=Retry)
    """The retry policy of steps that name none."""
    seed: int | str | None = None
    """Seeds the retry jitter per (run, step, attempt): the same delays on every run."""
    turn_timeout: float = attrs.field(default=300.0, validator=_positive)
    """Remote workflows: seconds to wait for a turn's decision before sending the turn again
    (a worker that died mid-turn is covered sooner by the broker's lease recovery; this
    covers a turn job lost for good, e.g. failed as poison)."""
    serve_tenants: bool = False
    """Serve as the control plane of store-less tenant pods (start-run, run requests, tenant
    run events; see ``docs/remote.md``)."""
    heartbeat_check_interval: float = attrs.field(default=1.0, validator=_positive)
    """Seconds between two looks for steps whose beats stopped for longer than their
    ``heartbeat_timeout`` (the failover comes at most this long after the timeout)."""
    cleanup_timeout: float = attrs.field(default=2.0, validator=_positive)
    """The bound on the close's release of runs."""
    step_timeout_grace: float = attrs.field(default=5.0, validator=_positive)
    """A step with a ``timeout``: seconds past it after which the engine checks the attempt
    itself, and fails it (``StepTimedOut``, retryable) when no live worker holds it (a worker
    killed mid-step), without waiting for the broker's stalled threshold."""
    unstarted_report_after: float | None = attrs.field(
        default=10.0, validator=_optional_non_negative
    )
    """Seconds after which a step attempt still waiting on a queue that no live worker
    serves is reported (``StepNotStarted`` through the error hook, at most once per queue per
    ``UNSTARTED_REPORT_INTERVAL``, 10 s, with a count of the attempts held back) and shown
    by :meth:`Engine.waiting`; it keeps waiting (a worker may yet come). ``None`` or 0:
    never. Failing it takes an explicit ``schedule_to_start_timeout``."""
    audit_interval: float | None = attrs.field(default=10.0, validator=_optional_non_negative)
    """Seconds between two rounds of the loss audit (docs/engine.md, "Crash recovery and
    reconcile"): a remote step attempt dispatched here whose job the broker no longer knows,
    with no result applied while it stayed gone for ``stalled_threshold + 2 *
    stalled_check_interval + audit_interval``, was lost (a task or result write the broker
    acknowledged and then lost in a failover); it is reported (``lost_dispatches``, a
    ``step.lost`` warning, :class:`~durable_trio.StepLost` through the error hook) and
    dispatched again. One broker call per task queue per round. ``None`` or 0: off."""

    wall_clock: Callable[[], float] = follow_the_timers
    """Schedules: the calendar time source, in Unix seconds. By default the clock the run
    store's durable timers follow: virtual (``durable_trio.testing.virtual_wall_clock()``, a
    fixed epoch plus trio's time) where they are (a memory store under a ``MockClock``),
    ``time.time`` elsewhere; ``open_engine`` resolves it once the store is open."""
    schedule_grace: float = attrs.field(default=60.0, validator=_positive)
    """Schedules: a tick at most this many seconds old when the scheduler sees it is on time
    and starts; an older one was missed (while no engine ran) and follows the schedule's
    ``catch_up`` policy."""
    schedule_recheck: float = attrs.field(default=5.0, validator=_positive)
    """Schedules: the scheduler sleeps until the next tick, but re-reads the stored schedules
    at least this often (for schedules added or changed by another engine or the CLI)."""

    max_child_depth: int = attrs.field(default=100, validator=_depth)
    """The most ancestors a run may have (issue 36): ``ctx.child`` / ``ctx.start_child`` in a
    run with this many raises :class:`~durable_trio.ChildDepthExceeded` (not retryable) and
    starts nothing, so a workflow that starts itself as a child stops there instead of growing
    without end (docs/engine.md, "Child workflows")."""
    cancel_grace: float = attrs.field(default=30.0, validator=_positive)
    """Seconds a cancelled run driven here may spend in its compensation (the code that
    catches :class:`RunCancelled`) before it is cut; the run ends cancelled either way
    (docs/engine.md, "Cancellation inside a workflow")."""

    retention: float | None = attrs.field(default=None, validator=_optional_retention)
    """Seconds a finished run (completed, failed or cancelled) is kept after its end, with its
    history, signals and events; then the engine deletes it (issue 34; docs/engine.md,
    "Retention"). ``None`` (the default) or ``math.inf``: kept for good. A workflow's own
    ``@app.workflow(retention=)`` wins over it."""
    retention_interval: float = attrs.field(default=60.0, validator=_positive)
    """Seconds between two prunes of the finished runs past their retention (each engine
    sleeps a jittered 75 % to 125 % of it; any engine may prune: deletes are idempotent)."""
    retention_batch: int = attrs.field(default=100, validator=_batch)
    """Runs deleted per store call (one transaction or script); a prune goes on batch after
    batch while they come back full."""
