"""The in-memory run store: one process, trio's clock (tests run under a virtual clock).

Values are kept JSON-encoded, as the persistent stores keep them: what a caller reads is a
fresh copy, so mutating a returned output never changes the history.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import attrs
import orjson
import trio

from .._records import (
    CANCEL_STEP_ID,
    Applied,
    RunPage,
    RunRecord,
    RunStatus,
    StepKind,
    StepRecord,
    StepState,
    read_trace,
    step_position,
)
from .._tags import check_tags
from ._paging import check_page, decode_cursor, encode_cursor
from ._wakes import RunWakes

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

__all__ = ["MemoryRunStore"]

_ACTIVE = (RunStatus.PENDING, RunStatus.RUNNING)

_dumps = orjson.dumps
_loads = orjson.loads


@attrs.define(eq=False)
class _Run:
    run_id: str
    workflow: str
    status: RunStatus
    seq: int
    input: bytes
    created_at: float
    updated_at: float
    output: bytes = b"null"
    error: bytes = b"null"
    owner: str | None = None
    lease_until: float | None = None
    timeout: float | None = None
    trace: bytes = b""
    parent: str | None = None
    depth: int = 0
    tags: dict[str, str] = attrs.Factory(dict)
    steps: dict[str, _Step] = attrs.Factory(dict)
    signals: dict[str, list[str]] = attrs.Factory(dict)
    events: dict[str, str] = attrs.Factory(dict)
    generations: dict[int, dict[str, _Step]] = attrs.Factory(dict)
    """Its previous generations' histories (continue-as-new: ``_generations.py``)."""
    generation_ends: dict[int, float] = attrs.Factory(dict)
    """When each previous generation ended (retention of generations)."""

    def out(self) -> RunRecord:
        return RunRecord(
            run_id=self.run_id,
            workflow=self.workflow,
            input=_loads(self.input),
            status=self.status,
            created_at=self.created_at,
            updated_at=self.updated_at,
            output=_loads(self.output),
            error=_loads(self.error),
            owner=self.owner,
            lease_until=self.lease_until,
            timeout=self.timeout,
            trace=read_trace(self.trace),
            parent=self.parent,
            depth=self.depth,
            tags=dict(self.tags),
        )


@attrs.define(eq=False)
class _Step:
    run_id: str
    step_id: str
    kind: StepKind
    name: str
    status: StepState
    attempt: int
    input: bytes
    output: bytes
    error: bytes
    retry: bytes
    wake_at: float | None
    dispatched: bool
    priority: int | None
    created_at: float
    updated_at: float
    heartbeat_timeout: float | None = None
    heartbeat: bytes = b"null"
    attempts: bytes = b"[]"

    def out(self) -> StepRecord:
        return StepRecord(
            run_id=self.run_id,
            step_id=self.step_id,
            kind=self.kind,
            name=self.name,
            status=self.status,
            attempt=self.attempt,
            input=_loads(self.input),
            output=_loads(self.output),
            error=_loads(self.error),
            retry=_loads(self.retry),
            wake_at=self.wake_at,
            dispatched=self.dispatched,
            priority=self.priority,
            created_at=self.created_at,
            updated_at=self.updated_at,
            heartbeat_timeout=self.heartbeat_timeout,
            heartbeat=_loads(self.heartbeat),
            attempts=tuple(_loads(self.attempts)),
        )


@attrs.define(eq=False)
class _Pending:
    """A debounced start not yet started (issue 33, item 4)."""

    run: RunRecord
    due_at: float
    deadline: float | None


class MemoryRunStore:
    """A :class:`~durable_trio.RunStore` in process memory (lost with the process).

    Every operation is a cancellation point and runs without yielding to other tasks, so it is
    atomic.
    """

    trio_clock = True
    """Its :meth:`now` is trio's clock: the engine sleeps until a timer's exact ``wake_at``."""

    def __init__(self) -> None:
        self._runs: dict[str, _Run] = {}
        self._seq = itertools.count(1)
        self._closed = False
        self._schedules: dict[str, tuple[str, float | None]] = {}
        self._schedule_states: dict[str, str] = {}
        self._dedup: dict[str, str] = {}  # dedup key -> the run last created under it
        self._dedup_key_of: dict[str, str] = {}  # run -> its dedup key (deleted with it)
        self._pending: dict[str, _Pending] = {}  # debounce key -> its start not yet started
        self._tagged: dict[tuple[str, str], dict[str, None]] = {}
        """(key, value) -> the ids of the runs tagged so, in creation order (issue 34)."""
        self.wakes = RunWakes()
        """Its waiters (every engine of a ``memory://`` backend shares the store)."""

    async def ring(self, key: str) -> None:
        """Wake the waiters of ``key`` (in this process: the only one the store is in)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self.wakes.wake((key,))

    def now(self) -> float:
        """trio's clock (virtual under ``autojump_clock``)."""
        return trio.current_time()

    # -- runs -------------------------------------------------------------------------------

    async def create_run(self, run: RunRecord) -> tuple[RunRecord, bool]:
        await trio.lowlevel.checkpoint_if_cancelled()
        return self._create(run)

    def _create(self, run: RunRecord) -> tuple[RunRecord, bool]:
        existing = self._runs.get(run.run_id)
        if existing is not None:
            return existing.out(), False
        now = self.now()
        stored = self._runs[run.run_id] = _Run(
            run_id=run.run_id,
            workflow=run.workflow,
            status=run.status,
            seq=next(self._seq),
            input=_dumps(run.input),
            created_at=now,
            updated_at=now,
            output=_dumps(run.output),
            error=_dumps(run.error),
            owner=run.owner,
            lease_until=run.lease_until,
            timeout=run.timeout,
            trace=b"" if run.trace is None else _dumps(run.trace),
            parent=run.parent,
            depth=run.depth,
            tags=dict(run.tags),
        )
        for tag in run.tags.items():  # the tag index (issue 34): run ids, creation order
            self._tagged.setdefault(tag, {})[run.run_id] = None
        return stored.out(), True

    async def get_run(self, run_id: str) -> RunRecord | None:
        await trio.lowlevel.checkpoint_if_cancelled()
        run = self._runs.get(run_id)
        return None if run is None else run.out()

    async def list_runs(
        self,
        *,
        status: RunStatus | None = None,
        workflow: str | None = None,
        limit: int = 100,
    ) -> list[RunRecord]:
        await trio.lowlevel.checkpoint_if_cancelled()
        found: list[RunRecord] = []
        for run in reversed(self._runs.values()):  # insertion order is creation order
            if len(found) >= limit:
                break
            if status is not None and run.status is not status:
                continue
            if workflow is not None and run.workflow != workflow:
                continue
            found.append(run.out())
        return found

    async def page_runs(
        self,
        *,
        status: RunStatus | None = None,
        workflow: str | None = None,
        tenant: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int = 50,
        cursor: str | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> RunPage:
        check_page(limit, since, until, tenant)
        wanted = check_tags(tags, "page_runs: tags")
        below = decode_cursor(cursor)
        await trio.lowlevel.checkpoint_if_cancelled()
        prefix = None if tenant is None else tenant + "/"
        found: list[_Run] = []
        for run in self._walk(wanted):
            if below is not None and run.seq >= below:
                continue
            if any(run.tags.get(k) != v for k, v in wanted.items()):
                continue
            if status is not None and run.status is not status:
                continue
            if workflow is not None and run.workflow != workflow:
                continue
            if prefix is not None and not run.run_id.startswith(prefix):
                continue
            if since is not None and run.created_at < since:
                continue
            if until is not None and run.created_at >= until:
                continue
            if len(found) == limit:  # one more exists: this page is not the last
                return RunPage([r.out() for r in found], encode_cursor(found[-1].seq))
            found.append(run)
        return RunPage([r.out() for r in found], None)

    def _walk(self, tags: dict[str, str]) -> Iterable[_Run]:
        """Runs newest first: every run, or those of the most selective tag's index (the
        other tags are checked on each)."""
        if not tags:
            return reversed(self._runs.values())  # insertion order is creation order
        ids = min((self._tagged.get(tag, {}) for tag in tags.items()), key=len)
        return (self._runs[run_id] for run_id in reversed(ids))

    async def count_runs(self) -> dict[RunStatus, int]:
        await trio.lowlevel.checkpoint_if_cancelled()
        counts: dict[RunStatus, int] = {}
        for run in self._runs.values():
            counts[run.status] = counts.get(run.status, 0) + 1
        return counts

    async def reopen_run(
        self, run_id: str, steps: Sequence[StepRecord], *, run_timeout: float | None
    ) -> bool:
        await trio.lowlevel.checkpoint_if_cancelled()
        run = self._runs.get(run_id)
        if run is None or run.status not in (RunStatus.FAILED, RunStatus.BLOCKED):
            return False
        if run.status is RunStatus.FAILED:
            run.steps.pop(CANCEL_STEP_ID, None)  # a stale mark of its previous life
        now = self.now()
        run.status, run.updated_at = RunStatus.PENDING, now
        run.output = run.error = b"null"
        run.owner = run.lease_until = None
        run.timeout = run_timeout
        for step in steps:
            stored = run.steps.get(step.step_id)
            if stored is None:
                continue
            stored.status, stored.attempt = step.status, step.attempt
            stored.error, stored.retry = _dumps(step.error), _dumps(step.retry)
            stored.wake_at, stored.dispatched = step.wake_at, step.dispatched
            stored.attempts = _dumps(step.attempts)
            stored.updated_at = now
        return True

    async def claim_runs(
        self, owner: str, lease: float, *, include_own: bool = False, limit: int = 100
    ) -> list[RunRecord]:
        await trio.lowlevel.checkpoint_if_cancelled()
        now = self.now()
        claimed: list[RunRecord] = []
        for run in self._runs.values():
            if len(claimed) >= limit:
                break
            if run.status not in _ACTIVE:
                continue
            orphan = (
                run.owner is None
                or run.lease_until is None
                or run.lease_until < now
                or (include_own and run.owner == owner)
            )
            if not orphan:
                continue
            run.owner, run.lease_until = owner, now + lease
            run.status, run.updated_at = RunStatus.RUNNING, now
            claimed.append(run.out())
        return claimed

    def _owned(self, owner: str, run_id: str) -> _Run | None:
        run = self._runs.get(run_id)
        if run is None or run.owner != owner or run.status not in _ACTIVE:
            return None
        return run

    async def renew_runs(self, owner: str, run_ids: Sequence[str], lease: float) -> set[str]:
        await trio.lowlevel.checkpoint_if_cancelled()
        until = self.now() + lease
        kept: set[str] = set()
        for run_id in run_ids:
            run = self._owned(owner, run_id)
            if run is not None:
                run.lease_until = until
                kept.add(run_id)
        return kept

    async def release_runs(self, owner: str, run_ids: Sequence[str]) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        now = self.now()
        for run_id in run_ids:
            run = self._owned(owner, run_id)
            if run is not None:
                run.owner = run.lease_until = None
                run.status, run.updated_at = RunStatus.PENDING, now

    async def finish_run(
        self,
        run_id: str,
        status: RunStatus,
        *,
        output: object = None,
        error: object = None,
    ) -> bool:
        await trio.lowlevel.checkpoint_if_cancelled()
        run = self._runs.get(run_id)
        if run is None or run.status.terminal:
            return False
        run.output, run.error = _dumps(output), _dumps(error)
        run.status, run.updated_at = status, self.now()
        run.owner = run.lease_until = None
        if status in (RunStatus.COMPLETED, RunStatus.FAILED):
            run.steps.pop(CANCEL_STEP_ID, None)  # ended before the cancel reached it
        return True

    # -- steps ------------------------------------------------------------------------------

    async def get_steps(self, run_id: str) -> list[StepRecord]:
        await trio.lowlevel.checkpoint_if_cancelled()
        run = self._runs.get(run_id)
        if run is None:
            return []
        steps = sorted(run.steps.values(), key=lambda s: step_position(s.step_id))
        return [step.out() for step in steps]

    def _find(self, run_id: str, step_id: str) -> _Step | None:
        run = self._runs.get(run_id)
        return None if run is None else run.steps.get(step_id)

    async def get_step(self, run_id: str, step_id: str) -> StepRecord | None:
        await trio.lowlevel.checkpoint_if_cancelled()
        step = self._find(run_id, step_id)
        return None if step is None else step.out()

    async def get_steps_many(self, keys: Sequence[tuple[str, str]]) -> list[StepRecord | None]:
        await trio.lowlevel.checkpoint_if_cancelled()
        found = [self._find(run_id, step_id) for run_id, step_id in keys]
        return [None if step is None else step.out() for step in found]

    async def begin_step(self, step: StepRecord) -> StepRecord:
        await trio.lowlevel.checkpoint_if_cancelled()
        run = self._runs.get(step.run_id)
        if run is None:
            # A store keeps no checkpoint of an unknown run; the caller's run was deleted.
            return step
        stored = run.steps.get(step.step_id)
        if stored is None:
            now = self.now()
            stored = run.steps[step.step_id] = _Step(
                run_id=step.run_id,
                step_id=step.step_id,
                kind=step.kind,
                name=step.name,
                status=step.status,
                attempt=step.attempt,
                input=_dumps(step.input),
                output=_dumps(step.output),
                error=_dumps(step.error),
                retry=_dumps(step.retry),
                wake_at=step.wake_at,
                dispatched=step.dispatched,
                priority=step.priority,
                created_at=now,
                updated_at=now,
                heartbeat_timeout=step.heartbeat_timeout,
                heartbeat=_dumps(step.heartbeat),
                attempts=_dumps(step.attempts),
            )
        return stored.out()

    async def begin_step_unless_finished(self, step: StepRecord) -> StepRecord | None:
        await trio.lowlevel.checkpoint_if_cancelled()
        run = self._runs.get(step.run_id)
        if run is None or run.status.terminal:
            return None
        return await self.begin_step(step)  # no checkpoint before it writes: one atomic step

    def _check(self, run_id: str, step_id: str, attempt: int) -> tuple[Applied, _Step | None]:
        run = self._runs.get(run_id)
        stored = None if run is None else run.steps.get(step_id)
        if run is None or stored is None:
            return Applied.MISSING, None
        if run.status.terminal:
            return Applied.RUN_FINISHED, None
        if stored.status is not StepState.PENDING:
            return Applied.DUPLICATE, None
        if stored.attempt != attempt:
            return Applied.STALE, None
        return Applied.APPLIED, stored

    async def update_step(self, step: StepRecord, *, expect_attempt: int) -> Applied:
        await trio.lowlevel.checkpoint_if_cancelled()
        verdict, stored = self._check(step.run_id, step.step_id, expect_attempt)
        if stored is None:
            return verdict
        stored.output, stored.error = _dumps(step.output), _dumps(step.error)
        stored.status, stored.attempt = step.status, step.attempt
        stored.wake_at, stored.dispatched = step.wake_at, step.dispatched
        stored.attempts = _dumps(step.attempts)
        if step.heartbeat is not None:  # a change made without it keeps the last beat
            stored.heartbeat = _dumps(step.heartbeat)
        stored.updated_at = self.now()
        return Applied.APPLIED

    async def mark_dispatched(self, run_id: str, step_id: str, attempt: int) -> bool:
        await trio.lowlevel.checkpoint_if_cancelled()
        _, stored = self._check(run_id, step_id, attempt)
        if stored is None:
            return False
        stored.dispatched = True
        return True

    # -- schedules --------------------------------------------------------------------------

    async def put_schedule(self, name: str, spec: str, *, replace: bool) -> bool:
        await trio.lowlevel.checkpoint_if_cancelled()
        current = self._schedules.get(name)
        if current is not None and not replace:
            return False
        self._schedules[name] = (spec, None if current is None else current[1])
        return True

    async def get_schedules(self) -> list[tuple[str, str, float | None]]:
        await trio.lowlevel.checkpoint_if_cancelled()
        return [(name, spec, last) for name, (spec, last) in self._schedules.items()]

    async def delete_schedule(self, name: str) -> bool:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._schedule_states.pop(name, None)
        return self._schedules.pop(name, None) is not None

    async def mark_schedule_tick(self, name: str, tick: float) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        current = self._schedules.get(name)
        if current is not None and (current[1] is None or tick > current[1]):
            self._schedules[name] = (current[0], tick)

    async def get_schedule_states(self) -> dict[str, str]:
        await trio.lowlevel.checkpoint_if_cancelled()
        return dict(self._schedule_states)

    async def put_schedule_state(self, name: str, state: str) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if name in self._schedules:
            self._schedule_states[name] = state

    async def aclose(self) -> None:
        self._closed = True
        await trio.lowlevel.checkpoint()

    # -- signals and events (issue 18) ----------------------------------------------------

    async def append_signal(self, run_id: str, name: str, payload: str) -> int | None:
        await trio.lowlevel.checkpoint_if_cancelled()
        run = self._runs.get(run_id)
        if run is None or run.status.terminal:
            return None
        log = run.signals.setdefault(name, [])
        log.append(payload)
        self.wakes.wake((run_id,))
        return len(log)

    async def read_signal(self, run_id: str, name: str, seq: int) -> str | None:
        await trio.lowlevel.checkpoint_if_cancelled()
        run = self._runs.get(run_id)
        log = run.signals.get(name, []) if run is not None else []
        return log[seq - 1] if 0 < seq <= len(log) else None

    async def put_event(self, run_id: str, key: str, value: str) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        run = self._runs.get(run_id)
        if run is not None:
            run.events[key] = value
            self.wakes.wake((run_id,))

    async def get_events(self, run_id: str) -> dict[str, str]:
        await trio.lowlevel.checkpoint_if_cancelled()
        run = self._runs.get(run_id)
        return dict(run.events) if run is not None else {}

    # -- dedup and debounce keys (issue 33, item 4) -----------------------------------------

    async def create_run_deduped(self, run: RunRecord, key: str) -> tuple[RunRecord, bool]:
        await trio.lowlevel.checkpoint_if_cancelled()
        last = self._runs.get(self._dedup.get(key, ""))
        if last is not None and not last.status.terminal:
            return last.out(), False
        stored, created = self._create(run)
        if created:
            self._dedup[key] = stored.run_id
            self._dedup_key_of[stored.run_id] = key
        return stored, created

    async def debounce_run(
        self, key: str, run: RunRecord, *, delay: float, max_wait: float | None
    ) -> str:
        await trio.lowlevel.checkpoint_if_cancelled()
        now = self.now()
        pending = self._pending.get(key)
        if pending is None:
            deadline = None if max_wait is None else now + max_wait
            self._pending[key] = _Pending(run, now + delay, deadline)
            return run.run_id
        pending.run = attrs.evolve(
            pending.run, input=run.input, timeout=run.timeout, trace=run.trace, tags=run.tags
        )
        due = now + delay
        pending.due_at = due if pending.deadline is None else min(due, pending.deadline)
        return pending.run.run_id

    async def start_debounced(self, limit: int = 100) -> tuple[list[RunRecord], float | None]:
        await trio.lowlevel.checkpoint_if_cancelled()
        now = self.now()
        due = sorted(
            (p for p in self._pending.items() if p[1].due_at <= now), key=lambda p: p[1].due_at
        )[:limit]
        created: list[RunRecord] = []
        for key, pending in due:
            del self._pending[key]
            stored, fresh = self._create(pending.run)
            if fresh:
                created.append(stored)
        nexts = [p.due_at for p in self._pending.values()]
        return created, min(nexts) if nexts else None

    async def debounced_due(self, run_id: str) -> float | None:
        await trio.lowlevel.checkpoint_if_cancelled()
        for pending in self._pending.values():
            if pending.run.run_id == run_id:
                return pending.due_at
        return None
    # -- retention (issue 34) ---------------------------------------------------------------

    def _prunable(self, ended_before: float, workflow: str | None) -> list[_Run]:
        """The finished runs (of ``workflow``) that ended before ``ended_before``, oldest end
        first, but a child whose parent exists unfinished."""
        found: list[_Run] = []
        for run in self._runs.values():
            if not run.status.terminal or run.updated_at >= ended_before:
                continue
            if workflow is not None and run.workflow != workflow:
                continue
            parent = None if run.parent is None else self._runs.get(run.parent)
            if parent is not None and not parent.status.terminal:
                continue  # the parent may not have recorded the child's end yet
            found.append(run)
        found.sort(key=lambda run: (run.updated_at, run.seq))
        return found

    async def prune_finished(
        self, ended_before: float, *, workflow: str | None = None, limit: int = 100
    ) -> list[str]:
        await trio.lowlevel.checkpoint_if_cancelled()
        pruned = [run.run_id for run in self._prunable(ended_before, workflow)[:limit]]
        for run_id in pruned:  # no checkpoint in between: atomic
            gone = self._runs.pop(run_id)
            key = self._dedup_key_of.pop(run_id, None)  # its dedup key, if still its own
            if key is not None and self._dedup.get(key) == run_id:
                del self._dedup[key]
            for tag in gone.tags.items():  # its tag index entries (issue 34)
                ids = self._tagged.get(tag)
                if ids is not None:
                    ids.pop(run_id, None)
                    if not ids:
                        del self._tagged[tag]
        return pruned

    async def count_finished(self, ended_before: float, *, workflow: str | None = None) -> int:
        await trio.lowlevel.checkpoint_if_cancelled()
        return len(self._prunable(ended_before, workflow))

    async def finished_workflows(self) -> list[str]:
        await trio.lowlevel.checkpoint_if_cancelled()
        return sorted({run.workflow for run in self._runs.values() if run.status.terminal})
