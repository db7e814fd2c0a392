"""The engine's loss audit: a dispatched step task, or its result, that the broker lost.

Redis replicates asynchronously: without ``min_replicas`` (``WAIT``) a write the master
acknowledged can die with it in a failover. Two writes matter to a run: the step's task (the
engine's push) and its result (the worker's push). If either is lost while the engine that
waits on the step stays alive, nothing else would ever notice: the checkpoint says pending and
dispatched, no worker holds the task, no result is coming. The audit notices.

Every ``audit_interval`` seconds (engine option, default 10 s; ``None`` or 0: off) one round
looks at the remote step attempts this engine dispatched and still waits on, that became
ready (dispatch plus backoff) at least one ``audit_interval`` ago:

1. it asks the broker where their jobs stand, batched: one call per task queue
   (:class:`~durable_trio.brokers.SupportsJobStates`; a broker with only
   :class:`~durable_trio.brokers.SupportsJobState` gets one call per job; a broker with
   neither is not audited);
2. a job the broker still knows (waiting, delayed, claimed, running) is fine, whatever its
   age: a backlog is not a loss;
3. a job the broker no longer knows has finished (its result may be on its way) or was lost.
   Seen gone, it is suspect; still gone and still unanswered once it has been gone for
   ``stalled_threshold + 2 * stalled_check_interval + audit_interval`` (a result claimed but
   never finalized, say by a result consumer that lost its pop's reply, comes back through
   the stalled sweep within that), it is LOST. A round that fails (the broker failing over)
   starts every suspicion over. Before acting the audit re-reads the checkpoint from the
   store (and waits for a result being applied to it here): only a step still pending at the
   same attempt, with no result applied, is dispatched again.

A lost attempt is reported: a warning on the ``durable_trio.events`` logger (event
``step.lost``, naming run, step, attempt and queue), the counter ``lost_dispatches`` of
:meth:`Engine.statistics`, and a :class:`StepLost` through the error hook. Then its SAME
attempt is dispatched again (the idempotency key of a step task is ``(run, step, attempt)``):
if the original result was only late after all, the step runs twice and the second result is
absorbed by the result handler's compare-and-set, counted in ``duplicate_results`` and
``duplicate_completions`` (:meth:`Engine.duplicates` gives the cause).

So a loss is dispatched again at most ``3 * audit_interval + stalled_threshold + 2 *
stalled_check_interval`` after the attempt became ready.

Cost per round: nothing when no attempt is old enough; else one broker call per task queue
holding audited attempts (on Redis a script that scans that queue's meta hash once, O(jobs
on the queue); on SQLite one indexed read; on memory a scan), and one store read per step
found lost. The audit covers the attempts THIS engine dispatched (it knows their job ids):
the engine that takes over a dead engine's run audits an attempt only once it dispatches it
itself (a retry, or a dispatch that was never confirmed).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import attrs
import trio

from .._attrs_shared import shared_eq, shared_repr
from .._errors import BrokerError, TransportClosed
from .._logs import get_logger
from .._periodic import fixed_rate
from .._telemetry import EVENTS_LOGGER
from .._transport._facade import stalled_threshold_of
from ..brokers import SupportsJobState, SupportsJobStates
from ._errors import EngineError
from ._records import StepKind, StepState

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..brokers import JobState
    from ._records import StepRecord
    from ._services import EngineServices
    from ._step_timeouts import StepTimeouts

__all__ = ["LossAudit", "SentAttempts", "StepLost"]

_log = get_logger(EVENTS_LOGGER)

#: Step names whose task queue the audit keeps (past that it starts over).
_QUEUE_CACHE_NAMES = 1024


class StepLost(EngineError):
    """Reported (not raised): the broker lost a step attempt's task or its result (a write it
    had acknowledged, e.g. in a Redis failover without ``min_replicas``); the engine
    dispatched the same attempt again.

    Attributes:
        run_id, step_id, name, attempt: the step attempt.
        queue: its task queue.
        job_id: the job the broker no longer knows.
        waited: seconds since the attempt became ready.
    """

    def __init__(
        self,
        run_id: str,
        step_id: str,
        name: str,
        attempt: int,
        queue: str,
        job_id: str,
        waited: float,
    ) -> None:
        super().__init__(
            f"step {name!r} (run {run_id}, step {step_id}, attempt {attempt}) was lost: its "
            f"job {job_id} is no longer on queue {queue!r} and no result arrived "
            f"{waited:.1f} s after it became ready (the broker lost the task or its result): "
            "dispatched again"
        )
        self.run_id = run_id
        self.step_id = step_id
        self.name = name
        self.attempt = attempt
        self.queue = queue
        self.job_id = job_id
        self.waited = waited


@attrs.define(repr=False, eq=False)
class _Sent:
    """One attempt this engine dispatched and still audits."""

    __repr__ = shared_repr
    __eq__ = shared_eq  # (and so unhashable, as attrs leaves a mutable class)

    attempt: int
    name: str
    queue: str
    job_id: str
    ready_at: float
    gone_since: float | None = None
    """Trio time of the round that first found its job gone (``None``: not suspect)."""


class SentAttempts:
    """The attempts dispatched here that the audit still follows, by ``(run_id, step_id)``:
    the engine's services tell it of every dispatch (:meth:`dispatched`); the audit
    (:class:`LossAudit`) reads it and drops what it no longer follows. Made by the engine
    before its services.

    Args:
        task_queue: the task queue of a step name (the transport's names).
    """

    def __init__(self, task_queue: Callable[[str], str]) -> None:
        self._task_queue = task_queue
        self._sent: dict[tuple[str, str], _Sent] = {}
        self._queues: dict[str, str] = {}  # task queue by step name

    def dispatched(
        self, record: StepRecord, timeouts: StepTimeouts, job_id: str, delay: float
    ) -> None:
        """``record``'s current attempt went out as job ``job_id``, ready after ``delay``."""
        del timeouts
        name = record.name
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = self._task_queue(name)
            if len(self._queues) > _QUEUE_CACHE_NAMES:
                self._queues = {name: queue}
        self._sent[(record.run_id, record.step_id)] = _Sent(
            record.attempt, name, queue, job_id, trio.current_time() + delay
        )

    def get(self, key: tuple[str, str]) -> _Sent | None:
        """The attempt of step ``key`` followed, if one is."""
        return self._sent.get(key)

    def entries(self) -> list[tuple[tuple[str, str], _Sent]]:
        """Every attempt followed (a copy: the audit drops entries as it goes)."""
        return list(self._sent.items())

    def drop(self, key: tuple[str, str], sent: _Sent) -> None:
        """Stop following ``sent`` (if it is still the attempt of ``key`` followed)."""
        if self._sent.get(key) is sent:
            del self._sent[key]

    def unsuspect(self) -> None:
        """Every suspicion starts over."""
        for sent in self._sent.values():
            sent.gone_since = None


class LossAudit:
    """The audit (see the module docstring): reads :class:`SentAttempts`, which the engine's
    services tell of every dispatch. Made by the engine; :meth:`run` runs in its loops
    nursery."""

    def __init__(self, services: EngineServices, sent: SentAttempts, interval: float) -> None:
        self.services = services
        self._sent = sent
        self.interval = interval
        self.rounds = 0
        """Rounds run so far."""
        self.broker_calls = 0
        """Broker calls made by the audit so far."""

    async def run(self) -> None:
        """One round every ``interval`` until cancelled (the engine closing); a broker or
        store error is reported and the next round tries again."""
        async for _ in fixed_rate(self.interval, catch_up=False):
            try:
                await self.audit()
            except (BrokerError, TransportClosed) as exc:
                # A broker in trouble may hold results back (a failover under way): the
                # suspicions start over once it answers again.
                self._sent.unsuspect()
                self.services.report(exc)

    def _pending(self, key: tuple[str, str], sent: _Sent) -> bool:
        """Whether this engine still waits on ``sent``'s attempt (its local view)."""
        waiter = self.services.waiters.get(key)
        if waiter is None:
            return False  # settled, or its run no longer driven here
        record = waiter.record
        return record is None or (
            record.status is StepState.PENDING and record.attempt == sent.attempt
        )

    async def audit(self) -> int:
        """One round now. Returns how many lost attempts it dispatched again."""
        self.rounds += 1
        now = trio.current_time()
        by_queue: dict[str, list[tuple[tuple[str, str], _Sent]]] = defaultdict(list)
        for key, sent in self._sent.entries():
            if not self._pending(key, sent):
                self._sent.drop(key, sent)
                continue
            if now - sent.ready_at >= self.interval:
                by_queue[sent.queue].append((key, sent))
        if not by_queue:
            return 0
        lost: list[tuple[tuple[str, str], _Sent]] = []
        for queue, entries in by_queue.items():
            states = await self._states(queue, [sent.job_id for _, sent in entries])
            if states is None:
                return 0  # the broker cannot tell: no audit
            for (key, sent), state in zip(entries, states, strict=True):
                if state is not None:
                    sent.gone_since = None
                elif sent.gone_since is None:
                    sent.gone_since = now
                elif now - sent.gone_since >= self._patience() and self._sent.get(key) is sent:
                    lost.append((key, sent))
        found = 0
        for key, sent in lost:
            found += await self._confirm(key, sent)
        return found

    def _patience(self) -> float:
        """How long a job must stay gone, unanswered, before it counts as lost: long enough
        for a result claimed but never finalized (the engine's result consumer lost the reply
        to its pop, or died) to be taken back by the reclaim sweep and applied
        (``stalled_threshold`` plus two sweep periods), plus one round."""
        transport = self.services.transport
        sweep = transport.options.stalled_check_interval
        return stalled_threshold_of(transport) + 2 * sweep + self.interval

    async def _states(self, queue: str, job_ids: list[str]) -> list[JobState | None] | None:
        broker = self.services.transport.backend.broker
        if isinstance(broker, SupportsJobStates):
            self.broker_calls += 1
            return await broker.job_states(queue, job_ids)
        if isinstance(broker, SupportsJobState):
            self.broker_calls += len(job_ids)
            return [await broker.job_state(queue, job_id) for job_id in job_ids]
        return None

    async def _confirm(self, key: tuple[str, str], sent: _Sent) -> int:
        """``sent`` was seen gone in two rounds: re-check the store, then report it and
        dispatch its attempt again."""
        services = self.services
        applying = services.applying.get(key)
        if applying is not None:  # a result of it is being applied here: let it finish
            await applying.wait()
        if not self._pending(key, sent):
            return 0
        record = await services.store.get_step(*key)
        if (
            record is None
            or record.kind is not StepKind.REMOTE
            or record.status is not StepState.PENDING
            or record.attempt != sent.attempt
            or key in services.applying
            or self._sent.get(key) is not sent
        ):
            waiter = services.waiters.get(key)
            if waiter is not None and record is not None:
                waiter.update(record)  # (applied elsewhere: the waiter learns it now)
            return 0
        waited = trio.current_time() - sent.ready_at
        services.count("lost_dispatches")
        _log.warning(
            "step %s lost: attempt %d of run %s (job %s gone from queue %s, no result): "
            "dispatched again",
            sent.name,
            sent.attempt,
            key[0],
            sent.job_id,
            sent.queue,
            extra={
                "event": "step.lost",
                "run_id": key[0],
                "step_id": key[1],
                "attempt": sent.attempt,
                "step": sent.name,
                "queue": sent.queue,
                "job_id": sent.job_id,
                "waited": waited,
                "outcome": "lost",
            },
        )
        services.report(
            StepLost(key[0], key[1], sent.name, sent.attempt, sent.queue, sent.job_id, waited)
        )
        # The same attempt again (a fresh job): its dispatch tells this audit the new job id.
        await services.dispatch(record, 0.0)
        return 1
