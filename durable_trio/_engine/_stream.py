"""Streaming (issue 34, item 7): partial results a step (``await dt.step_info().emit(v)``) or a
workflow (``await ctx.emit(v)``) publishes, read by ``engine.stream(run_id)`` as they come.

The log: a run's stream is the run store's per-run append log of signals, under the reserved
name :data:`STREAM_LOG` (``append_signal`` / ``read_signal``). So it is on every store with
nothing new in any of them: durable (it survives an engine crash), placed with its run (a Redis
Cluster's run shard), rung on the run's wakes (a reader in any process wakes within about a
millisecond), refused once the run has finished, and deleted with its run by retention.

Each entry is ``{"k": key, "v": value}``; the key names the emit, so a delivery repeated is
one value: ``"s:{step_id}:{attempt}:{n}"`` for the ``n``-th emit of a step's attempt (an attempt
redelivered after a worker crash emits the same keys again), ``"w:{step_id}"`` for a workflow's
emit (its call position: a turn replayed emits the same key again, and a replay past the emit's
checkpoint does not append at all). An append is at-least-once; the READER keeps the first
entry of each key and skips the others (an entry repeated does take a place in the log, and
counts toward the bound).

Bounds: at most :data:`MAX_STREAM_ENTRIES` entries per run (an emit past it raises
:class:`StreamFull`, nothing appended; the entries kept are the first ones) and
:data:`MAX_STREAM_VALUE_BYTES` of JSON per value (:class:`StreamValueTooLarge`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator  # noqa: TC003 (Engine.stream's hints resolve)
from contextlib import ExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import orjson
import trio

from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._errors import BrokerError
from .._failures import one_exception, raise_bare
from .._json_values import check_json
from ._errors import RunNotFound, StreamError, StreamFull, StreamValueTooLarge
from ._stores._wakes import SupportsRunWakes

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._stores import RunStore, RunStoreOpener

__all__ = [
    "MAX_STREAM_ENTRIES",
    "MAX_STREAM_VALUE_BYTES",
    "STREAM_LOG",
    "STREAM_POLL",
    "LazyStore",
    "StreamEntry",
    "append_entry",
    "emitter_of",
    "engine_stream",
    "fixed_store",
    "read_stream",
    "serving",
    "store_opener",
]

#: The reserved signal name of a run's stream log (never send a signal of this name).
STREAM_LOG = "durable_trio.stream"

#: Entries a run's stream keeps at most (an emit past it raises :class:`StreamFull`).
MAX_STREAM_ENTRIES = 10_000

#: Bytes of JSON one emitted value may take at most.
MAX_STREAM_VALUE_BYTES = 64 * 1024

#: Seconds between two store reads of a reader that heard no ring (the safety net).
STREAM_POLL = 1.0



class HasStore(Protocol):
    """What :func:`engine_stream` needs of an engine: its run store."""

    @property
    def store(self) -> RunStore: ...


@attrs.frozen(repr=False, eq=False)
class StreamEntry:
    """One value of a run's stream, as :meth:`Engine.stream` yields it."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    seq: int
    """Its place in the run's log (1, 2, ...; increasing, possibly with gaps where a repeated
    delivery was skipped): pass it as ``after=`` to resume after it."""
    value: Any
    """The JSON value emitted."""


async def append_entry(store: RunStore, run_id: str, key: str, value: Any) -> int:
    """Append ``value`` under the emit ``key`` to the run's stream log.

    Returns:
        Its sequence number in the log.

    Raises:
        PayloadError: ``value`` is not a JSON value.
        StreamValueTooLarge: its JSON is too large.
        StreamFull: the stream is full.
        StreamError: the run is unknown or has finished.
    """
    check_json(value, "an emitted value")
    body = orjson.dumps(value)
    if len(body) > MAX_STREAM_VALUE_BYTES:
        raise StreamValueTooLarge(
            f"an emitted value of run {run_id!r} takes {len(body)} bytes of JSON "
            f"(at most {MAX_STREAM_VALUE_BYTES})"
        )
    if await store.read_signal(run_id, STREAM_LOG, MAX_STREAM_ENTRIES) is not None:
        raise StreamFull(
            f"the stream of run {run_id!r} holds {MAX_STREAM_ENTRIES} entries: "
            "no further value is kept"
        )
    text = orjson.dumps({"k": key, "v": orjson.Fragment(body)}).decode()
    seq = await store.append_signal(run_id, STREAM_LOG, text)
    if seq is None:
        raise StreamError(f"run {run_id!r} is unknown or has finished: its stream is closed")
    return seq


def _decode(text: str) -> tuple[str, Any] | None:
    """A stored entry's ``(key, value)``, or ``None`` (not an entry: skipped)."""
    try:
        entry = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("k"), str):
        return None
    return entry["k"], entry.get("v")


def engine_stream(engine: HasStore, run_id: str, *, after: int = 0) -> AsyncIterator[StreamEntry]:
    """``engine.stream(run_id, *, after=0)`` (docs/engine.md, "Streaming"): the run's entries
    after seq ``after``, in order, each value once, as they come (the store's ring, from any
    process); it ends once the run has ended and its stream is read.

    Raises:
        RunNotFound: no such run.
    """
    return read_stream(engine.store, run_id, after=after)


async def read_stream(
    store: RunStore, run_id: str, *, after: int = 0
) -> AsyncIterator[StreamEntry]:
    """:meth:`Engine.stream`: the run's entries after ``after``, in order, each key once; wait
    for more while the run is unfinished; end once it has finished and its log is read (or its
    run was deleted).

    Raises:
        RunNotFound: no such run (when the reading starts).
    """
    if await store.get_run(run_id) is None:
        raise RunNotFound(run_id)
    wakes = store.wakes if isinstance(store, SupportsRunWakes) else None
    seen: set[str] = set()
    seq = 0
    while True:
        batch: list[StreamEntry] = []
        with ExitStack() as watch:  # (never held across a yield: a reader may stop anywhere)
            # Taken before the reads: the store's ring of an entry appended by any process.
            rung = watch.enter_context(wakes.watching(run_id)) if wakes else None
            run = await store.get_run(run_id)  # read BEFORE the log: an end seen here is final
            while seq < MAX_STREAM_ENTRIES:
                text = await store.read_signal(run_id, STREAM_LOG, seq + 1)
                if text is None:
                    break
                seq += 1
                decoded = _decode(text)
                if decoded is None or decoded[0] in seen:
                    continue
                seen.add(decoded[0])
                if seq > after:
                    batch.append(StreamEntry(seq, decoded[1]))
            ended = run is None or run.status.terminal or seq >= MAX_STREAM_ENTRIES
            if not batch and not ended:
                with trio.move_on_after(STREAM_POLL if rung is not None else STREAM_POLL / 10):
                    if rung is not None:
                        await rung.wait()
                    else:
                        await trio.sleep_forever()
        for entry in batch:
            yield entry
        if ended:
            return


class LazyStore:
    """A worker's run store, opened on its first use (a step's first emit) by :meth:`serve`, a
    task started then in the worker's nursery (:func:`serving`), and kept open until the worker
    closes: a worker that never emits never opens it (nor starts the task)."""

    def __init__(self, opener: Callable[[], Any] | None) -> None:
        self._opener = opener
        self._nursery: trio.Nursery | None = None
        self._started = False
        self._ready = trio.Event()
        self._store: RunStore | None = None
        self._error: BaseException | None = None

    async def serve(self) -> None:
        """Open the store; hold it until cancelled (started by the first :meth:`get`)."""
        if self._opener is None:
            self._error = StreamError("this worker has no run store (a tenant pod's): no emit")
            self._ready.set()
            return
        try:
            async with self._opener() as store:
                self._store = store
                self._ready.set()
                await trio.sleep_forever()
        except BrokerError as exc:
            self._error = exc
            self._ready.set()

    async def get(self) -> RunStore:
        """The store (opened now if it is not yet).

        Raises:
            StreamError: the worker has none, or it could not be opened.
        """
        if self._nursery is not None and not self._started:
            self._started = True
            self._nursery.start_soon(self.serve)
        if self._nursery is None and not self._ready.is_set():
            self._error = StreamError("the worker is not serving")
            self._ready.set()
        await self._ready.wait()
        if self._store is None:
            raise StreamError(f"the worker's run store could not be opened: {self._error}")
        return self._store


@asynccontextmanager
async def serving(lazy: LazyStore) -> AsyncIterator[LazyStore]:
    """Run ``lazy``'s :meth:`LazyStore.serve` for the block (its store closed on leaving)."""
    body_error: BaseException | None = None
    background: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            lazy._nursery = nursery  # its first get starts serve here
            try:
                yield lazy
            except BaseException as exc:
                body_error = exc
            finally:
                lazy._nursery = None
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        background = group
    # The block ends with one exception, never a group (see durable_trio._failures).
    error = one_exception(
        body_error, [] if background is None else [background], owner="the worker's run store"
    )
    if error is not None:
        raise_bare(error)


def store_opener(backend: RunStoreOpener, namespace: str) -> Callable[[], Any]:
    """What :class:`LazyStore` opens: ``backend``'s run store of ``namespace``."""
    return lambda: backend.open_run_store(namespace)


async def fixed_store(store: RunStore) -> RunStore:
    """``store`` (what :func:`emitter_of` gets of an engine's local step)."""
    await trio.lowlevel.checkpoint()
    return store


def emitter_of(
    get_store: Callable[[], Awaitable[RunStore]], run_id: str, step_id: str, attempt: int
) -> Callable[[Any], Awaitable[int]]:
    """A step attempt's ``emit``: its ``n``-th call appends under ``"s:{step}:{attempt}:{n}"``."""
    count = 0

    async def emit(value: Any) -> int:
        nonlocal count
        count += 1
        key = f"s:{step_id}:{attempt}:{count}"
        return await append_entry(await get_store(), run_id, key, value)

    return emit
