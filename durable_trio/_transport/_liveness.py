"""Worker liveness (T11), group health (T12) and worker descriptors (T13) in the key store
(the ids are sections of docs/spec.md)."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import orjson
import trio
from trio_util import AsyncBool

from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._codec import from_wire, to_wire
from .._errors import BrokerError, DurableTrioError, PayloadError
from .._periodic import fixed_rate
from .._wire import WorkerStatus
from ._claims import Level

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence

    from .._naming import QueueNames
    from ._adaptive import ConcurrencyController
    from ._ports import KeyEntry, KeyStore

__all__ = [
    "GroupHealth",
    "LiveWorker",
    "Liveness",
    "Vitals",
    "WorkerDescriptor",
    "read_group_health",
    "read_last_status",
]

#: How long a worker's last liveness snapshot outlives it (poison evidence).
LAST_STATUS_TTL = 24 * 3600.0

#: A liveness key lives at least this long (or three beats) unless written again.
MIN_HEARTBEAT_TTL = 35.0


@attrs.frozen(repr=False, eq=False)
class LiveWorker:
    """One live worker of a group, from its liveness key."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    instance: str
    last_beat_at: float
    """Unix time of its last beat."""
    status: WorkerStatus | None = None

    @property
    def headroom(self) -> int | None:
        """Free slots (limit - in-flight): the capacity signal an autoscaler can use."""
        if self.status is None:
            return None
        return max(0, self.status.limit - self.status.in_flight)


@attrs.frozen(repr=False, eq=False)
class GroupHealth:
    """T12: how one routing group is doing."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    group: str
    depth: int
    """Jobs waiting on the group's task queue (0 on a broker that cannot count)."""
    live_workers: tuple[LiveWorker, ...] = ()

    @property
    def headroom(self) -> int:
        """Free slots across the live workers that report a status."""
        return sum(w.headroom or 0 for w in self.live_workers)


@attrs.frozen(repr=False, eq=False)
class WorkerDescriptor:
    """T13: what one worker instance serves."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    instance: str
    tokens: tuple[str, ...]
    steps: tuple[str, ...]
    started_at: float


def _beat_value(status: WorkerStatus) -> bytes:
    return orjson.dumps({"ts": time.time(), "status": to_wire(status)})


def parse_beat(value: bytes) -> tuple[float, WorkerStatus | None]:
    """``{ts, status?}`` -> (last beat, status). A beat without a status reads as liveness only.

    Raises:
        PayloadError: not a beat.
    """
    try:
        raw = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise PayloadError(f"liveness value is not JSON: {exc}") from exc
    if type(raw) is not dict or type(raw.get("ts")) not in (int, float):
        raise PayloadError("liveness value has no numeric ts")
    status = raw.get("status")
    return float(raw["ts"]), (from_wire(status, WorkerStatus) if type(status) is dict else None)


def live_workers_of(entries: Sequence[KeyEntry], marker: str) -> tuple[LiveWorker, ...]:
    workers = []
    for entry in entries:
        if not entry.key.startswith(marker):
            continue
        try:
            beat_at, status = parse_beat(entry.value)
        except PayloadError:
            continue  # somebody else's garbage under our prefix: not a live worker of ours
        workers.append(LiveWorker(entry.key[len(marker) :], beat_at, status))
    return tuple(workers)


async def read_last_status(
    keys: KeyStore, names: QueueNames, instance: str
) -> dict[str, Any] | None:
    """A worker's last liveness snapshot as plain JSON (``{lastBeatAt, status?}``), if kept."""
    key = names.worker_last_status(instance)
    for entry in await keys.entries(key):
        if entry.key == key:
            try:
                beat_at, status = parse_beat(entry.value)
            except PayloadError:
                return None
            return {"lastBeatAt": beat_at, **({"status": to_wire(status)} if status else {})}
    return None


async def read_group_health(
    keys: KeyStore, names: QueueNames, token: str, depth: int
) -> GroupHealth:
    marker = names.worker_heartbeat(token, "")
    return GroupHealth(token, depth, live_workers_of(await keys.entries(marker), marker))


class Liveness:
    """Beats a liveness key per served token (T11), plus this worker's descriptor (T13) and its
    last status (kept a day, for poison evidence), all in ONE key-store write per beat.

    A first beat the moment a token starts being served, then every ``interval``; the keys live
    ``max(35 s, 3 x interval)``. One write at a time: a beat due while the last one is still in
    flight is skipped (a key store slower than the interval never piles up writes), except that
    a token served meanwhile gets its first beat as soon as that write lands. On close, the
    timer stops, the write in flight lands, then the keys are removed at once.
    """

    def __init__(
        self,
        keys: KeyStore,
        names: QueueNames,
        instance_id: str,
        *,
        interval: float,
        status: Callable[[], WorkerStatus],
        descriptor: Callable[[], dict[str, Any]],
        report: Callable[[BaseException], None],
    ) -> None:
        self._keys = keys
        self._names = names
        self._instance = instance_id
        self.interval = interval
        self.ttl = max(MIN_HEARTBEAT_TTL, 3 * interval)
        self._status = status
        self._descriptor = descriptor
        self._report = report
        self.tokens: list[str] = []
        self._writing = AsyncBool(False)
        self._owed = False  # a token was served while a write was in flight
        self._writes: trio.Nursery | None = None
        self._stopped = False
        self.skipped = 0
        """Beats skipped because the previous write had not landed."""

    def _key(self, token: str) -> str:
        return self._names.worker_heartbeat(token, self._instance)

    def _descriptor_key(self) -> str:
        return self._names.worker_descriptor(self._instance)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The timer (and the nursery of the writes)."""
        async with trio.open_nursery() as writes:
            self._writes = writes
            if self.tokens:  # served before the timer ran: beat them now
                self._beat()
            task_status.started()
            async for _ in fixed_rate(self.interval):
                if self.tokens:
                    self._beat()

    def serve(self, token: str) -> None:
        """Start beating for ``token`` (at once, or as soon as the write in flight lands)."""
        if self._stopped or token in self.tokens:
            return
        self.tokens.append(token)
        if self._writing.value:
            self._owed = True
        else:
            self._beat()

    def _beat(self) -> None:
        if self._writes is None or self._stopped:
            return  # not running yet: run() beats every served token when it starts
        if self._writing.value:
            self.skipped += 1
            return
        self._writing.value = True
        self._writes.start_soon(self._write)

    async def _write(self) -> None:
        try:
            status = _beat_value(self._status())
            items = [(self._key(token), status, self.ttl) for token in self.tokens]
            descriptor = orjson.dumps({**self._descriptor(), "tokens": self.tokens})
            items.append((self._descriptor_key(), descriptor, self.ttl))
            # The last words: outlive the worker, for the evidence of a poison job.
            items.append((self._names.worker_last_status(self._instance), status, LAST_STATUS_TTL))
            await self._keys.put_many(items)
        except (BrokerError, DurableTrioError) as exc:
            self._report(exc)  # best-effort: the keys simply expire
        finally:
            self._writing.value = False
            if self._owed:
                self._owed = False
                self._beat()

    async def withdraw(self, bound: float) -> None:
        """Close phase 2: stop beating, let the write in flight land, remove the keys
        (bounded)."""
        self._stopped = True
        with trio.move_on_after(bound, shield=True) as scope:
            await self._writing.wait_value(False)
            if self.tokens:
                keys = [self._key(t) for t in self.tokens]
                try:
                    await self._keys.remove([*keys, self._descriptor_key()])
                except (BrokerError, DurableTrioError) as exc:
                    self._report(exc)
        if scope.cancelled_caught:
            self._report(BrokerError("close: withdrawing the liveness keys timed out"))
        if self._writes is not None:
            self._writes.cancel_scope.cancel()


class Vitals:
    """The vitals level of the tree: the concurrency controller's task and this instance's
    liveness (its timer, its keys). ``liveness`` may come late (a store-less tenant pod adopts
    one, :meth:`adopt`). Leaving :meth:`beating` is close phase 2 (T24): liveness withdraws
    its keys (bounded by ``cleanup_timeout`` in its own shielded scope), then the controller
    and the timer stop."""

    def __init__(
        self,
        controller: ConcurrencyController,
        liveness: Liveness | None,
        *,
        cleanup_timeout: float,
    ) -> None:
        self.level = Level("vitals")
        self._controller = controller
        self.liveness = liveness
        """This instance's liveness, or ``None`` (no key store)."""
        self._cleanup_timeout = cleanup_timeout

    def adopt(self, liveness: Liveness) -> None:
        """Start ``liveness`` in the running level (a tenant pod's, written through the
        control plane)."""
        self.liveness = liveness
        self.level.nursery.start_soon(liveness.run)

    @asynccontextmanager
    async def beating(self) -> AsyncIterator[None]:
        async with trio.open_nursery() as vitals:
            self.level.nursery = vitals
            await vitals.start(self._controller.run)
            if self.liveness is not None:
                await vitals.start(self.liveness.run)
            try:
                yield
            finally:
                if self.liveness is not None:
                    await self.liveness.withdraw(self._cleanup_timeout)
                vitals.cancel_scope.cancel()
