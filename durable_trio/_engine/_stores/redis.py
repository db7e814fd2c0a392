"""The Redis run store, on the project's Trio-native Redis client.

Key layout (``T`` = ``{dt-runs:NAMESPACE}``: one hash tag, so a namespace's runs live in one
Redis Cluster slot and every script touches one slot only):

=========================  ======  ===============================================================
``T:seq``                  string  ``INCR`` counter: run creation order (damaged: rebuilt from
                                   ``T:all``'s highest score, see ``_CREATE_RUN``)
``T:run:ID``               hash    workflow, status, input, output, error, owner, lease, created,
                                   updated, seq, timeout (JSON values stored as JSON text, never
                                   decoded in Lua: cjson would turn ``[]`` into ``{}``)
``T:all``                  zset    every run, score = seq (``list_runs``, newest first)
``T:status:STATUS``        zset    runs of one status, score = seq
``T:leases``               zset    unfinished runs, score = lease expiry (0 = unowned): an
                                   orphan claim is ``ZRANGEBYSCORE -inf (now``, never a scan
``T:leases-rebuild``       string  while a lost ``T:leases`` is rebuilt by the claims: where the
                                   walk of the status indexes stands (``STATUS SEQ``)
``T:owned:OWNER``          set     unfinished runs an engine owns (an engine restarted under the
                                   same id takes its runs back at once)
``T:steps:N:ID``           zset    the run's step ids, score = position (N = len(ID), so no run id
                                   can forge another run's keys)
``T:step:N:ID:STEP``       hash    one checkpoint (its attempt log in field ``attempts``, JSON)
``T:tag:KEY:VALUE``        zset    runs tagged KEY=VALUE, score = seq (issue 34; a key has no ``:``)
``T:schedules``            hash    schedule name -> its definition (JSON text); shard 0's ``T``
``T:schedule-ticks``       hash    schedule name -> its last tick handled (same slot)
``T:ended:WF`` ...         zset    retention's indexes of the finished runs (issue 34): see
                                   ``_redis_retention.py``
``T:schedule-state``       hash    schedule name -> its overlap state (JSON text; same slot)
=========================  ======  ===============================================================

Every change is one Lua script (atomic on the server). Times are the client's ``time.time()``
(durable timers are computed by the engine from :meth:`RedisRunStore.now`): keep the machines'
clocks in sync (NTP); a run lease (30 s by default) dwarfs ordinary skew.
"""

from __future__ import annotations

import time
import zlib
from typing import TYPE_CHECKING, Any, Final

import attrs
import orjson
import trio

from ..._backoff import Backoff
from ..._errors import BrokerError, ConfigError, TransportClosed
from ..._logs import get_logger
from ..._redis import is_cluster_client
from .._records import (
    CANCEL_STEP_ID,
    Applied,
    DamagedRun,
    RunDataError,
    RunPage,
    RunRecord,
    RunStatus,
    StepRecord,
)
from .._tags import check_tags, tags_json
from ._paging import MAX_PAGE, check_page, decode_cursor, encode_cursor, skip_damaged
from ._redis_retention import RedisPruner
from ._redis_rows import fields as _fields
from ._redis_rows import number as _number
from ._redis_rows import read_listed as _read_listed
from ._redis_rows import read_run as _run
from ._redis_rows import read_step as _step
from ._redis_rows import tag_index as _tag_index
from ._redis_scripts import (
    _APPEND_SIGNAL,
    _BEGIN_STEP,
    _BEGIN_STEP_UNLESS_FINISHED,
    _CLAIM,
    _CREATE_RUN,
    _CREATE_RUN_FUNCTION,
    _DELETE_SCHEDULE,
    _FINISH,
    _MARK_DISPATCHED,
    _MARK_TICK,
    _PAGE,
    _PUT_SCHEDULE_STATE,
    _RELEASE,
    _RENEW,
    _REOPEN,
    _UPDATE_STEP,
    PAGE_BUDGET,
)
from ._redis_starts import RedisStarts
from ._shard_paging import DONE, ShardPage, decode_bounds, encode_bounds, merge_shards
from ._wakes import RunWakes

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from ..._redis import RedisClient, RedisClusterClient, Script

__all__ = ["MAX_SHARDS", "RedisRunStore"]

#: Waits between two subscriptions to the wakes channel after a failure: 0.1 s doubling to 2 s.
_RESUBSCRIBE_BACKOFF = Backoff(initial=0.1, maximum=2.0)

logger = get_logger("durable_trio.redis")

#: Run shards a store may have at most (a page asks each one).
MAX_SHARDS: Final = 256

async def _claim_in(
    claim: Script, args: tuple[str, str, str, int], wanted: int, now: Callable[[], float]
) -> list[str]:
    """One shard's claim (``args``: its prefix, the owner, the lease, include-own) of at most
    ``wanted`` runs: the script called again while it rebuilds a lost ``:leases`` (it answers
    ``more``) and claimed fewer than ``wanted`` (docs/deployment.md)."""
    ids: list[str] = []
    more = 1
    while more and len(ids) < wanted:
        claimed, more = await claim(
            (f"{args[0]}:leases",), (*args, wanted - len(ids), _num(now()))
        )
        ids += [i.decode() for i in claimed]
    return ids


def _dumps(value: Any) -> bytes:
    return orjson.dumps(value)


def _optional_dumps(value: Any) -> bytes:
    return b"" if value is None else orjson.dumps(value)


def _num(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def _index(prefix: str, status: RunStatus | None) -> str:
    """A shard's index of every run, or of the runs of one status."""
    return f"{prefix}:all" if status is None else f"{prefix}:status:{status}"


def _page_index(
    prefix: str, status: RunStatus | None, tags: dict[str, str] | None
) -> tuple[str, tuple[str, ...]]:
    """The index a page walks in shard ``prefix`` and the page script's extra arguments:
    untagged, the status's (or every run's); tagged, the first tag's (keys in sorted order),
    then the status to check ('' = any) and the other tags' index keys."""
    if not tags:
        return _index(prefix, status), ()
    first, *others = (_tag_index(prefix, k, v) for k, v in sorted(tags.items()))
    return first, ("" if status is None else status.value, *others)


def _following(reply: list[Any]) -> int | None:
    """Where a page script's scan stopped (``None``: at the end of its index)."""
    raw = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0] or "")
    return int(float(raw)) if raw else None


#: Seconds of silence on the wakes subscription before a ``PING`` checks it is alive.
_WAKES_PING_AFTER: Final = 30.0
#: Seconds that ``PING`` may take before the subscription counts as dead (subscribe again).
_WAKES_PING_TIMEOUT: Final = 5.0


class RedisRunStore:
    """A :class:`~durable_trio.RunStore` on Redis (runs of one ``namespace``).

    Args:
        client: an entered :class:`~durable_trio._redis.RedisClient` (not closed by the store).
        namespace: whose runs (part of the hash tag).
    """

    def __init__(
        self, client: RedisClient | RedisClusterClient, namespace: str, *, shards: int = 1
    ) -> None:
        if "{" in namespace or "}" in namespace:
            raise ValueError(f"a run store namespace has no braces: {namespace!r}")
        if not 1 <= shards <= MAX_SHARDS:
            raise ConfigError(f"shards is 1 to {MAX_SHARDS}, not {shards!r}")
        self._client = client
        self._clock: Callable[[], float] = time.time
        self.trio_clock = False
        """Whether :meth:`now` is trio's clock (see :meth:`follow_trio_clock`)."""
        # One shard: today's layout, ``{dt-runs:NS}`` (what a single server has always held).
        # More: ``{dt-runs:NS:K}``, a run in shard crc32(run id) % shards (see the module docs).
        self._prefixes = (
            (f"{{dt-runs:{namespace}}}",)
            if shards == 1
            else tuple(f"{{dt-runs:{namespace}:{k}}}" for k in range(shards))
        )
        self._next_claim = 0  # the shard the next claim starts from (each gets its turn)
        self._create: Script = client.script(_CREATE_RUN)
        self._claim: Script = client.script(_CLAIM)
        self._renew: Script = client.script(_RENEW)
        self._release: Script = client.script(_RELEASE)
        self._finish: Script = client.script(_FINISH)
        self._begin: Script = client.script(_BEGIN_STEP)
        self._begin_unless_finished: Script = client.script(_BEGIN_STEP_UNLESS_FINISHED)
        self._append_signal: Script = client.script(_APPEND_SIGNAL)
        self._update: Script = client.script(_UPDATE_STEP)
        self._mark: Script = client.script(_MARK_DISPATCHED)
        self._page: Script = client.script(_PAGE)
        self._reopen: Script = client.script(_REOPEN)
        self._mark_tick: Script = client.script(_MARK_TICK)
        self._delete_schedule: Script = client.script(_DELETE_SCHEDULE)
        self._pruner = RedisPruner(client, self._prefixes, self._prefix_of)
        self._put_schedule_state: Script = client.script(_PUT_SCHEDULE_STATE)
        self._starts = RedisStarts(client, self._prefixes, self._shard_of, _CREATE_RUN_FUNCTION)
        self._channel = f"{{dt-runs:{namespace}}}:wakes"
        self._nursery: trio.Nursery | None = None
        self._listening = False
        self.wakes = RunWakes(listen=self._listen)
        """Its waiters in this process; other processes' rings reach them by ``PUBLISH``
        (``SPUBLISH`` on a Cluster) on ``{dt-runs:NS}:wakes``, subscribed once a waiter
        watches (see ``_wakes.py``)."""
        self.subscriptions = 0
        """Times the wakes channel was (re)subscribed (statistics)."""

    # -- wakes (issue 18) -------------------------------------------------------------------

    def serve_wakes(self, nursery: trio.Nursery) -> None:
        """Where the wakes listener runs once a waiter watches (the opener's nursery: without
        one, waiters only poll)."""
        self._nursery = nursery

    def _listen(self) -> None:
        if not self._listening and self._nursery is not None:
            self._listening = True
            self._nursery.start_soon(self._listen_forever)

    async def _listen_forever(self) -> None:
        """Subscribe to the wakes channel and wake the waiters of every key a message names;
        a (re)subscription wakes every waiter (rings may have been lost meanwhile)."""
        client = self._client
        failures = 0
        while True:
            try:
                if is_cluster_client(client):
                    async with client.ssubscribe(self._channel) as sharded:
                        sharded.on_resubscribed = self._subscribed
                        self._subscribed()
                        failures = 0
                        async for _, message in sharded:
                            self.wakes.wake((bytes(message).decode("utf-8", "replace"),))
                    return  # the subscription was closed under us: the client is closing
                async with client.subscribe(self._channel) as sub:
                    self._subscribed()
                    failures = 0
                    while True:
                        with trio.move_on_after(_WAKES_PING_AFTER):
                            _, message = await sub.receive()
                            self.wakes.wake((bytes(message).decode("utf-8", "replace"),))
                            continue
                        await sub.ping(reply_timeout=_WAKES_PING_TIMEOUT)
            except BrokerError:
                pass  # the waiters poll meanwhile; subscribe again after a backoff
            except TransportClosed:
                return
            failures += 1
            await trio.sleep(_RESUBSCRIBE_BACKOFF.delay(failures))

    def _subscribed(self) -> None:
        self.subscriptions += 1
        self.wakes.wake(None)

    async def ring(self, key: str) -> None:
        """Wake the waiters of ``key`` here, and publish it to every other process
        (best-effort: a ring the server did not take is covered by the waiters' poll)."""
        self.wakes.wake((key,))
        client = self._client
        try:
            if is_cluster_client(client):
                await client.spublish(self._channel, key)
            else:
                await client.execute("PUBLISH", self._channel, key)
        except BrokerError:
            pass

    def now(self) -> float:
        """The client's wall clock (``time.time()``); after :meth:`follow_trio_clock`,
        trio's."""
        return self._clock()

    def follow_trio_clock(self) -> None:
        """Read trio's clock instead of the wall clock, for tests under a virtual clock that
        run every engine in one process (as the memory store does): timers then wake at
        their exact virtual time. Call it before an engine opens on the store."""
        self._clock = trio.current_time
        self.trio_clock = True

    # -- keys -------------------------------------------------------------------------------

    def _shard_of(self, run_id: str) -> int:
        count = len(self._prefixes)
        return 0 if count == 1 else zlib.crc32(run_id.encode()) % count

    def _prefix_of(self, run_id: str) -> str:
        return self._prefixes[self._shard_of(run_id)]

    def _run_key(self, run_id: str) -> str:
        return f"{self._prefix_of(run_id)}:run:{run_id}"

    def _steps_key(self, run_id: str) -> str:
        return f"{self._prefix_of(run_id)}:steps:{len(run_id)}:{run_id}"

    def _step_key(self, run_id: str, step_id: str) -> str:
        return f"{self._prefix_of(run_id)}:step:{len(run_id)}:{run_id}:{step_id}"

    def _by_shard(self, run_ids: Sequence[str]) -> dict[int, list[str]]:
        grouped: dict[int, list[str]] = {}
        for run_id in run_ids:
            grouped.setdefault(self._shard_of(run_id), []).append(run_id)
        return grouped

    # -- runs -------------------------------------------------------------------------------

    async def create_run(self, run: RunRecord) -> tuple[RunRecord, bool]:
        now = self.now()
        prefix = self._prefix_of(run.run_id)
        reply = await self._create(
            (self._run_key(run.run_id), f"{prefix}:seq", f"{prefix}:all"),
            (prefix, run.run_id, run.workflow, run.status.value, _dumps(run.input),
             _dumps(run.output), _dumps(run.error), run.owner or "", _num(run.lease_until),
             _num(now), _num(run.timeout), _optional_dumps(run.trace), run.parent or "",
             run.depth, tags_json(run.tags) or "", *self._tag_keys(run)),
        )  # fmt: skip
        if reply[0] == 1 and len(reply) > 1:  # (reported once: the counter is whole again)
            logger.warning("Redis run store: %s", reply[1].decode(errors="replace"))
        if reply[0] == 1:  # created as given: no need to read it back
            return attrs.evolve(run, created_at=now, updated_at=now), True
        return _run(run.run_id, _fields(reply[1])), False

    async def get_run(self, run_id: str) -> RunRecord | None:
        reply = await self._client.execute("HGETALL", self._run_key(run_id))
        return _run(run_id, _fields(reply)) if reply else None

    async def _get_runs(self, run_ids: Sequence[str]) -> list[RunRecord]:
        if not run_ids:
            await trio.lowlevel.checkpoint()
            return []
        replies = await self._client.pipeline(
            [("HGETALL", self._run_key(run_id)) for run_id in run_ids]
        )
        pairs = zip(run_ids, replies, strict=True)
        runs, damaged = _read_listed((run_id, _fields(reply)) for run_id, reply in pairs if reply)
        return skip_damaged(runs, damaged)

    async def list_runs(
        self,
        *,
        status: RunStatus | None = None,
        workflow: str | None = None,
        limit: int = 100,
    ) -> list[RunRecord]:
        if len(self._prefixes) > 1:
            return await self._list_sharded(status, workflow, limit)
        index = _index(self._prefixes[0], status)
        found: list[RunRecord] = []
        start = 0
        batch = max(limit, 16)
        while len(found) < limit:
            ids = await self._client.execute("ZREVRANGE", index, start, start + batch - 1)
            if not ids:
                break
            start += len(ids)
            for record in await self._get_runs([i.decode() for i in ids]):
                if workflow is None or record.workflow == workflow:
                    found.append(record)
        return found[:limit]

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
        filters = (workflow or "", "" if tenant is None else tenant + "/", _num(since), _num(until))
        if len(self._prefixes) > 1:
            return await self._page_sharded(status, filters, limit, cursor, wanted)
        below = decode_cursor(cursor)
        prefix = self._prefixes[0]
        index, more = _page_index(prefix, status, wanted)
        reply = await self._page(
            (index,),
            (prefix, "+inf" if below is None else f"({below}", limit, max(PAGE_BUDGET, limit + 1),
             *filters, *more),
        )  # fmt: skip
        following = _following(reply)
        runs, damaged = _read_listed(
            (reply[i].decode(), _fields(reply[i + 1])) for i in range(1, len(reply), 2)
        )
        return RunPage(runs, None if following is None else encode_cursor(following), damaged)

    async def _page_sharded(
        self,
        status: RunStatus | None,
        filters: tuple[str, ...],
        limit: int,
        cursor: str | None,
        tags: dict[str, str] | None = None,
    ) -> RunPage:
        """One page over every shard: one page script per shard not done, in one pipeline
        (per node, the nodes concurrently), merged by creation time (see
        :func:`~._shard_paging.merge_shards`)."""
        bounds = decode_bounds(cursor, len(self._prefixes))
        asked = [shard for shard, bound in enumerate(bounds) if bound != DONE]
        indexes = {shard: _page_index(self._prefixes[shard], status, tags) for shard in asked}
        commands = [
            self._page.command(
                (indexes[shard][0],),
                (
                    self._prefixes[shard],
                    "+inf" if bounds[shard] is None else f"({bounds[shard]}",
                    limit,
                    max(PAGE_BUDGET, limit + 1),
                    *filters,
                    *indexes[shard][1],
                ),
            )
            for shard in asked
        ]
        replies = await self._client.pipeline(commands) if commands else []
        pages = {}
        for shard, reply in zip(asked, replies, strict=True):
            runs: list[tuple[float, int, RunRecord | DamagedRun]] = []
            for i in range(1, len(reply), 2):
                run_id, fields = reply[i].decode(), _fields(reply[i + 1])
                record: RunRecord | DamagedRun
                try:
                    record = _run(run_id, fields)
                    created = record.created_at
                except RunDataError as exc:  # (named, in its place as far as it can be read)
                    record, created = DamagedRun(run_id, str(exc)), _number(fields, b"created")
                runs.append((created, int(_number(fields, b"seq")), record))
            pages[shard] = ShardPage(runs, _following(reply))
        taken, following = merge_shards(pages, bounds, limit)
        return RunPage(
            [r for r in taken if isinstance(r, RunRecord)],
            encode_bounds(following),
            [r for r in taken if isinstance(r, DamagedRun)],
        )

    async def _list_sharded(
        self, status: RunStatus | None, workflow: str | None, limit: int
    ) -> list[RunRecord]:
        found: list[RunRecord] = []
        cursor = None
        while len(found) < limit:
            page = await self.page_runs(
                status=status, workflow=workflow, limit=min(limit - len(found), MAX_PAGE),
                cursor=cursor,
            )  # fmt: skip
            found += skip_damaged(page.runs, page.damaged)
            cursor = page.next_cursor
            if cursor is None:
                break
        return found

    async def count_runs(self) -> dict[RunStatus, int]:
        statuses = list(RunStatus)
        replies = await self._client.pipeline(
            [("ZCARD", _index(prefix, status)) for prefix in self._prefixes for status in statuses]
        )
        counts = dict.fromkeys(statuses, 0)
        for at, n in enumerate(replies):
            counts[statuses[at % len(statuses)]] += int(n)
        return {s: n for s, n in counts.items() if n}

    async def reopen_run(
        self, run_id: str, steps: Sequence[StepRecord], *, run_timeout: float | None
    ) -> bool:
        args: list[Any] = [
            self._prefix_of(run_id), run_id, _num(run_timeout), _num(self.now()), CANCEL_STEP_ID
        ]  # fmt: skip
        for step in steps:
            args += [step.status.value, step.attempt, _dumps(step.error), _dumps(step.retry),
                     _num(step.wake_at), "1" if step.dispatched else "0",
                     _dumps(step.attempts)]  # fmt: skip
        done = await self._reopen(
            (self._run_key(run_id), self._step_key(run_id, CANCEL_STEP_ID),
             self._steps_key(run_id), *(self._step_key(run_id, s.step_id) for s in steps)),
            tuple(args),
        )  # fmt: skip
        return bool(done == 1)

    async def claim_runs(
        self, owner: str, lease: float, *, include_own: bool = False, limit: int = 100
    ) -> list[RunRecord]:
        # Shard after shard (each shard's claim is one script), the first shard taking turns so
        # no shard's orphans wait behind another's, until ``limit`` runs are claimed.
        count = len(self._prefixes)
        start, self._next_claim = self._next_claim, (self._next_claim + 1) % count
        ids: list[str] = []
        for k in range(count):
            prefix = self._prefixes[(start + k) % count]
            args = (prefix, owner, repr(float(lease)), int(include_own))
            ids += await _claim_in(self._claim, args, limit - len(ids), self.now)
            if len(ids) >= limit:
                break
        if not ids:
            await trio.lowlevel.checkpoint()
            return []
        replies = await self._client.pipeline([("HGETALL", self._run_key(i)) for i in ids])
        runs: list[RunRecord] = []
        for run_id, reply in zip(ids, replies, strict=True):
            if not reply:
                continue
            try:
                runs.append(_run(run_id, _fields(reply)))
            except RunDataError as exc:
                # Set aside, failed, never driven: one damaged hash must not stop the claims
                # of the runs beside it (as the SQL stores do).
                logger.warning("%s: the run is set aside (failed)", exc)
                error = {"type": type(exc).__name__, "message": str(exc)}
                await self.finish_run(run_id, RunStatus.FAILED, error=error)
        return runs

    async def renew_runs(self, owner: str, run_ids: Sequence[str], lease: float) -> set[str]:
        if not run_ids:
            await trio.lowlevel.checkpoint()
            return set()
        now = _num(self.now())
        replies = await self._client.pipeline(
            [
                self._renew.command(
                    (f"{self._prefixes[shard]}:leases",),
                    (self._prefixes[shard], owner, repr(float(lease)), now, *ids),
                )
                for shard, ids in self._by_shard(run_ids).items()
            ]
        )
        return {i.decode() for kept in replies for i in kept}

    async def release_runs(self, owner: str, run_ids: Sequence[str]) -> None:
        if not run_ids:
            await trio.lowlevel.checkpoint()
            return
        now = _num(self.now())
        await self._client.pipeline(
            [
                self._release.command(
                    (f"{self._prefixes[shard]}:leases",), (self._prefixes[shard], owner, now, *ids)
                )
                for shard, ids in self._by_shard(run_ids).items()
            ]
        )

    async def finish_run(
        self,
        run_id: str,
        status: RunStatus,
        *,
        output: object = None,
        error: object = None,
    ) -> bool:
        done = await self._finish(
            (self._run_key(run_id), self._step_key(run_id, CANCEL_STEP_ID),
             self._steps_key(run_id)),
            (self._prefix_of(run_id), run_id, status.value, _dumps(output), _dumps(error),
             _num(self.now()), CANCEL_STEP_ID),
        )  # fmt: skip
        return bool(done == 1)

    # -- steps ------------------------------------------------------------------------------

    async def get_steps(self, run_id: str) -> list[StepRecord]:
        reply = await self._client.execute("ZRANGE", self._steps_key(run_id), 0, -1)
        ids = [i.decode() for i in reply]
        found = await self.get_steps_many([(run_id, step_id) for step_id in ids])
        return [step for step in found if step is not None]

    async def get_step(self, run_id: str, step_id: str) -> StepRecord | None:
        reply = await self._client.execute("HGETALL", self._step_key(run_id, step_id))
        return _step(run_id, step_id, _fields(reply)) if reply else None

    async def get_steps_many(self, keys: Sequence[tuple[str, str]]) -> list[StepRecord | None]:
        if not keys:
            await trio.lowlevel.checkpoint()
            return []
        replies = await self._client.pipeline(
            [("HGETALL", self._step_key(run_id, step_id)) for run_id, step_id in keys]
        )
        return [
            _step(run_id, step_id, _fields(reply)) if reply else None
            for (run_id, step_id), reply in zip(keys, replies, strict=True)
        ]

    async def begin_step(self, step: StepRecord) -> StepRecord:
        stored = await self._begin_step(step, guarded=False)
        assert stored is not None  # unguarded: always an answer
        return stored

    async def begin_step_unless_finished(self, step: StepRecord) -> StepRecord | None:
        return await self._begin_step(step, guarded=True)

    async def _begin_step(self, step: StepRecord, *, guarded: bool) -> StepRecord | None:
        position = int(step.step_id) if step.step_id.isdigit() else 0
        now = self.now()
        keys: tuple[str, ...] = (
            self._step_key(step.run_id, step.step_id),
            self._steps_key(step.run_id),
        )
        script = self._begin
        if guarded:
            keys, script = (*keys, self._run_key(step.run_id)), self._begin_unless_finished
        reply = await script(
            keys,
            (step.step_id, position, step.kind.value, step.name, step.status.value, step.attempt,
             _dumps(step.input), _dumps(step.output), _dumps(step.error), _dumps(step.retry),
             _num(step.wake_at), "1" if step.dispatched else "0",
             "" if step.priority is None else str(step.priority), _num(now),
             _num(step.heartbeat_timeout), _optional_dumps(step.heartbeat),
             _dumps(step.attempts)),
        )  # fmt: skip
        if reply[0] == 2:  # guarded, and the run is unknown or finished: nothing written
            return None
        if reply[0] == 1:  # inserted as given: no need to read it back
            return attrs.evolve(step, created_at=now, updated_at=now)
        return _step(step.run_id, step.step_id, _fields(reply[1]))

    async def update_step(self, step: StepRecord, *, expect_attempt: int) -> Applied:
        verdict = await self._update(
            (self._step_key(step.run_id, step.step_id), self._run_key(step.run_id)),
            (expect_attempt, step.status.value, step.attempt, _dumps(step.output),
             _dumps(step.error), _num(step.wake_at), "1" if step.dispatched else "0",
             _num(self.now()), _optional_dumps(step.heartbeat), _dumps(step.attempts)),
        )  # fmt: skip
        return Applied(verdict.decode())

    async def mark_dispatched(self, run_id: str, step_id: str, attempt: int) -> bool:
        done = await self._mark((self._step_key(run_id, step_id),), (attempt,))
        return bool(done == 1)

    # -- schedules (shard 0's hash tag: both keys in one slot) --------------------------------

    def _schedule_keys(self) -> tuple[str, str]:
        prefix = self._prefixes[0]
        return f"{prefix}:schedules", f"{prefix}:schedule-ticks"

    async def put_schedule(self, name: str, spec: str, *, replace: bool) -> bool:
        schedules, _ = self._schedule_keys()
        command = "HSET" if replace else "HSETNX"
        reply = await self._client.execute(command, schedules, name, spec)
        return replace or reply == 1

    async def get_schedules(self) -> list[tuple[str, str, float | None]]:
        schedules, ticks = self._schedule_keys()
        specs = _fields(await self._client.execute("HGETALL", schedules))
        lasts = _fields(await self._client.execute("HGETALL", ticks))
        found: list[tuple[str, str, float | None]] = []
        for name, spec in sorted(specs.items()):
            raw = lasts.get(name)
            try:
                last = None if raw is None else float(raw)
            except ValueError:
                last = None  # a damaged tick: the schedule counts from its creation
            found.append((name.decode(), spec.decode("utf-8", "replace"), last))
        return found

    async def delete_schedule(self, name: str) -> bool:
        schedules, ticks = self._schedule_keys()
        keys = (schedules, ticks, self._schedule_state_key())
        reply = await self._delete_schedule(keys, (name,))
        return bool(reply == 1)

    async def mark_schedule_tick(self, name: str, tick: float) -> None:
        await self._mark_tick(self._schedule_keys(), (name, repr(float(tick))))

    def _schedule_state_key(self) -> str:
        return f"{self._prefixes[0]}:schedule-state"

    async def get_schedule_states(self) -> dict[str, str]:
        raw = _fields(await self._client.execute("HGETALL", self._schedule_state_key()))
        return {name.decode(): state.decode("utf-8", "replace") for name, state in raw.items()}

    async def put_schedule_state(self, name: str, state: str) -> None:
        schedules, _ = self._schedule_keys()
        await self._put_schedule_state((schedules, self._schedule_state_key()), (name, state))

    # -- signals and events (issue 18) ----------------------------------------------------

    def _signal_key(self, run_id: str, name: str) -> str:
        return f"{self._prefix_of(run_id)}:signal:{len(run_id)}:{run_id}:{name}"

    def _events_key(self, run_id: str) -> str:
        return f"{self._prefix_of(run_id)}:events:{len(run_id)}:{run_id}"

    async def append_signal(self, run_id: str, name: str, payload: str) -> int | None:
        seq = await self._append_signal(
            (self._run_key(run_id), self._signal_key(run_id, name),
             f"{self._prefix_of(run_id)}:signals:{len(run_id)}:{run_id}"),
            (payload, name),
        )  # fmt: skip
        if int(seq):
            await self.ring(run_id)
        return int(seq) or None

    async def read_signal(self, run_id: str, name: str, seq: int) -> str | None:
        if seq < 1:
            await trio.lowlevel.checkpoint()
            return None
        reply = await self._client.execute("LINDEX", self._signal_key(run_id, name), seq - 1)
        return None if reply is None else bytes(reply).decode("utf-8", "replace")

    async def put_event(self, run_id: str, key: str, value: str) -> None:
        await self._client.execute("HSET", self._events_key(run_id), key, value)
        await self.ring(run_id)

    async def get_events(self, run_id: str) -> dict[str, str]:
        reply = await self._client.execute("HGETALL", self._events_key(run_id))
        return {k.decode(): v.decode("utf-8", "replace") for k, v in _fields(reply).items()}

    async def aclose(self) -> None:
        """Nothing to release (the client is the caller's). Idempotent."""
        await trio.lowlevel.checkpoint()

    # -- dedup and debounce keys (issue 33, item 4: _redis_starts.py) -----------------------

    async def create_run_deduped(self, run: RunRecord, key: str) -> tuple[RunRecord, bool]:
        return await self._starts.create_run_deduped(run, key, self.now())

    async def debounce_run(
        self, key: str, run: RunRecord, *, delay: float, max_wait: float | None
    ) -> str:
        return await self._starts.debounce_run(key, run, self.now(), delay, max_wait)

    async def start_debounced(self, limit: int = 100) -> tuple[list[RunRecord], float | None]:
        return await self._starts.start_debounced(limit, self.now())

    async def debounced_due(self, run_id: str) -> float | None:
        return await self._starts.debounced_due(run_id)

    # -- run tags (issue 34) ----------------------------------------------------------------

    def _tag_keys(self, run: RunRecord) -> list[str]:
        """The tag index keys ``run`` is in (its shard's): what removes a run must ``ZREM``
        its id from each (as from its status index)."""
        prefix = self._prefix_of(run.run_id)
        return [_tag_index(prefix, key, value) for key, value in run.tags.items()]

    # -- retention (issue 34: ``_redis_retention.py``) -----------------------------------------

    async def prune_finished(
        self, ended_before: float, *, workflow: str | None = None, limit: int = 100
    ) -> list[str]:
        return await self._pruner.prune_finished(ended_before, workflow, limit, self.now())

    async def count_finished(self, ended_before: float, *, workflow: str | None = None) -> int:
        return await self._pruner.count_finished(ended_before, workflow)

    async def finished_workflows(self) -> list[str]:
        return await self._pruner.finished_workflows()
