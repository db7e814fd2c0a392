"""Producers: every job a transport pushes (never deferred), coalesced into batches where the
broker takes them (one broker call per scheduling round)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from .._coalesce import Coalescer, results_of
from .._codec import encode_envelope, encode_result
from .._naming import sanitize_token
from .._telemetry import carrier
from .._wire import JobKind, StepResult, StepStatus
from ..brokers import Job, SupportsBatchFinalize

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from .._naming import QueueNames
    from .._wire import RemoteTask
    from ..brokers import Lease, QueueBroker
    from ._options import TransportOptions

__all__ = ["Producers"]


class Producers:
    """Makes jobs (fresh ids, encoded envelopes) and pushes them; owns the coalescers of the
    pushes, completes and result-plus-acknowledgement finishes, one per queue."""

    def __init__(
        self,
        broker: QueueBroker,
        names: QueueNames,
        options: TransportOptions,
        *,
        check_open: Callable[[], None],
    ) -> None:
        self._broker = broker
        self._names = names
        self._check_open = check_open
        self._max_payload_bytes = options.max_payload_bytes
        self._ids = itertools.count(1)
        self._id_prefix = f"{sanitize_token(options.instance_id)[:24]}-"
        # (a runtime Protocol check inspects every member: made once here, not per call)
        self._many = broker if isinstance(broker, SupportsBatchFinalize) else None
        # Finalizes and pushes made in one scheduling round share one broker call, where the
        # broker can take them so (not the memory broker: its calls cost less than the round).
        self._batch_finalize = (
            broker
            if isinstance(broker, SupportsBatchFinalize)
            and getattr(broker, "coalesce_finalize", True)
            else None
        )
        self.batched = self._batch_finalize is not None
        """Finalizes go through coalescers (and a result is pushed with its task's ack)."""
        self._pushers: dict[str, Coalescer[tuple[Job, int | None], None]] = {}
        self._completers: dict[str, Coalescer[Lease, bool]] = {}
        self._finishers: dict[str, Coalescer[tuple[Lease, Job], bool]] = {}

    async def push(
        self,
        queue: str,
        kind: JobKind,
        payload: Any,
        *,
        priority: int | None = None,
        delay: float = 0.0,
        key: str | None = None,
    ) -> str:
        self._check_open()
        job = self.new_job(kind, payload, priority, key)
        if delay > 0:
            await self._broker.push_on(queue, job, priority=priority, delay=delay)
        else:
            await self.push_job(queue, job, priority)
        return job.id

    def new_job(
        self, kind: JobKind, payload: Any, priority: int | None = None, key: str | None = None
    ) -> Job:
        """A job with a fresh id and ``payload`` encoded in its envelope (with the current
        trace context, when this process traces: docs/observability.md), and its concurrency
        ``key`` (``Job.key``)."""
        job_id = f"{self._id_prefix}{next(self._ids)}"
        return Job(
            job_id,
            encode_envelope(
                job_id, kind, payload, priority, self._max_payload_bytes, trace=carrier()
            ),
            key,
        )

    def result_job(self, task: RemoteTask, output: Any, delivery: dict[str, Any]) -> Job:
        """The job of ``task``'s completed result, as :meth:`new_job` makes it of
        ``StepResult(..., COMPLETED, output=output, task_id=task.task_id, delivery=delivery)``
        — the hot path of every step that completes, so without building that ``StepResult``
        unless the result is refused (:func:`~durable_trio._codec.encode_result`).

        Raises:
            PayloadError: as :meth:`new_job` (the output cannot be sent).
        """
        job_id = f"{self._id_prefix}{next(self._ids)}"
        trace = carrier()
        data = encode_result(job_id, task, output, delivery, self._max_payload_bytes, trace)
        if data is None:  # refused, or maybe: the general path, for its error
            result = StepResult(
                task.run_id, task.step_id, task.attempt, StepStatus.COMPLETED, output=output,
                task_id=task.task_id, delivery=delivery,
            )  # fmt: skip
            data = encode_envelope(
                job_id, JobKind.RESULT, result, None, self._max_payload_bytes, trace=trace
            )
        return Job(job_id, data)

    def _pusher(self, queue: str) -> Coalescer[tuple[Job, int | None], None]:
        pusher = self._pushers.get(queue)
        if pusher is None:
            broker = self._batch_finalize
            assert broker is not None

            async def push_many(items: list[tuple[Job, int | None]]) -> list[None]:
                await broker.push_many(queue, [j for j, _ in items], [p for _, p in items])
                return results_of(len(items))

            pusher = self._pushers[queue] = Coalescer(push_many)
        return pusher

    def forget_pusher(self, queue: str) -> None:
        """Drop an idle queue's pusher: a queue addressed to one instance (a pod's inbox) is
        pushed to for as long as that instance lives, so a long-running control plane would
        otherwise keep one coalescer per pod it ever answered."""
        pusher = self._pushers.get(queue)
        if pusher is not None and pusher.idle:
            del self._pushers[queue]

    async def push_job(self, queue: str, job: Job, priority: int | None = None) -> None:
        """Push an encoded job now, coalesced where the broker takes batches."""
        self._check_open()
        if self._batch_finalize is not None:
            await self._pusher(queue).submit((job, priority))
        else:
            await self._broker.push_on(queue, job, priority=priority)

    def finisher(self, queue: str) -> Coalescer[tuple[Lease, Job], bool]:
        """Results pushed with their tasks' acknowledgements: one broker call per batch."""
        finisher = self._finishers.get(queue)
        if finisher is None:
            broker = self._batch_finalize
            assert broker is not None
            results = self._names.results

            async def finish(items: list[tuple[Lease, Job]]) -> list[bool]:
                return await broker.push_and_complete_many(
                    results, [job for _, job in items], queue, [lease for lease, _ in items]
                )

            finisher = self._finishers[queue] = Coalescer(finish)
        return finisher

    def completer(self, queue: str) -> Coalescer[Lease, bool]:
        completer = self._completers.get(queue)
        if completer is None:
            broker = self._batch_finalize
            assert broker is not None

            async def complete_many(leases: list[Lease]) -> list[bool]:
                return await broker.complete_many(queue, leases)

            completer = self._completers[queue] = Coalescer(complete_many)
        return completer

    async def push_tasks(self, routed: Sequence[tuple[str, Any]]) -> list[str]:
        """Push many ``(queue, task)`` task jobs in as few broker calls as the broker allows
        (one per queue on Redis and SQLite).

        Returns:
            The job ids, in order.
        """
        self._check_open()
        by_queue: dict[str, list[tuple[Job, int | None]]] = {}
        ids = []
        for queue, task in routed:
            job = self.new_job(JobKind.TASK, task, task.priority)
            by_queue.setdefault(queue, []).append((job, task.priority))
            ids.append(job.id)
        broker, many = self._broker, self._many
        for queue, items in by_queue.items():
            if many is not None:
                await many.push_many(queue, [j for j, _ in items], [p for _, p in items])
            else:
                for job, priority in items:
                    await broker.push_on(queue, job, priority=priority)
        return ids
