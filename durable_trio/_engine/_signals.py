"""Signals and events (issue 18, items 1 and 2): what ``ctx.wait_signal`` / ``ctx.set_event``
do in the engine, and what ``engine.signal`` / ``engine.get_event`` do.

Signals are appended durably to a per-run, per-name log in the run store (``append_signal``
returns their sequence number, 1, 2, ...). The k-th ``wait_signal(name)`` of a run that
completes consumes the k-th signal of that name: the wait is a checkpoint of kind
:attr:`StepKind.SIGNAL` whose input holds ``{"seq": k, "deadline": ...}`` and whose output
holds the payload, so replay returns it without reading the log again. A timeout is a durable
deadline (checkpointed like ``ctx.sleep``'s wake time) and fails the checkpoint with
:class:`SignalTimeout`, which consumes nothing.

Waking: a signal sent through the engine that drives the run rings that driver's bell at once;
a signal stored by any process rings the store's wakes (``_stores/_wakes.py``: in-process on
memory, a datagram on SQLite, a publish on Redis), which wake the waiting driver within about a
millisecond; the driver's store poll (every ``SIGNAL_POLL`` seconds) stays as the safety net
for a lost ring, and is all a store without wakes has.

Events: ``ctx.set_event(key, value)`` writes ``key -> value`` (latest wins) to the run store,
then checkpoints an :attr:`StepKind.EVENT` step, so replay does not write again.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import orjson
import trio

from .._arguments import check_name
from .._errors import ConfigError, PayloadError
from .._json_values import check_json
from ._context import STREAM_EVENT, check_unreserved
from ._errors import (
    EventTimeout,
    RunNotFound,
    RunNotSignalable,
    SignalDataError,
    SignalTimeout,
    StreamError,
)
from ._records import Applied, StepKind, StepRecord, StepState
from ._stores._wakes import RunWakes, SupportsRunWakes, first_of
from ._stream import append_entry

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from ._records import RunRecord
    from ._replay import History
    from ._services import DriverServices
    from ._stores import RunStore


class SignalDriver(Protocol):
    """What the signal helpers use of a local run's driver (``_runtime.RunDriver``): named
    here, so the helpers need not import the driver that calls them."""

    services: DriverServices
    run: RunRecord
    history: History
    scope: trio.CancelScope


__all__ = [
    "SIGNAL_POLL",
    "EventTimeout",
    "RunNotSignalable",
    "SignalDataError",
    "SignalDriver",
    "SignalTimeout",
    "decode_stored",
    "encode_payload",
    "set_event",
    "wait_signal",
]

SIGNAL_POLL = 1.0
"""Seconds between two store reads of a driver waiting on a signal sent elsewhere."""


def encode_payload(value: Any, what: str) -> str:
    """``value`` as the JSON text stored.

    Raises:
        PayloadError: ``value`` is not a JSON value.
    """
    check_json(value, what)
    return orjson.dumps(value).decode()


def decode_stored(text: str, what: str) -> Any:
    """Stored JSON text back to its value.

    Raises:
        SignalDataError: the stored text is not JSON.
    """
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise SignalDataError(f"{what} is damaged in the run store (not JSON: {exc})") from None


def _error(exc: Exception) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc)}


async def wait_signal(
    driver: SignalDriver,
    step_id: str,
    name: str,
    seq: int,
    timeout: float | None,  # noqa: ASYNC109 (a durable deadline, not a trio one)
) -> Any:
    """The driver's side of ``ctx.wait_signal``: return the ``seq``-th signal ``name``."""
    services = driver.services
    store = services.store
    run_id = driver.run.run_id
    record = driver.history.take(step_id, StepKind.SIGNAL, name)
    if record is None:
        deadline = None if timeout is None else store.now() + timeout
        fresh = StepRecord(
            run_id=run_id,
            step_id=step_id,
            kind=StepKind.SIGNAL,
            name=name,
            status=StepState.PENDING,
            input={"seq": seq, "timeout": timeout},
            wake_at=deadline,
        )
        record = await services.guard(lambda: store.begin_step(fresh), "checkpointing")
        driver.history.check(record, StepKind.SIGNAL, name)
    settled = await settle_signal(services, driver, record)
    if settled is None:  # the run was settled elsewhere (cancelled): stop driving it
        driver.scope.cancel()
        await trio.lowlevel.checkpoint()
        raise AssertionError("unreachable")  # pragma: no cover
    return _outcome(settled, name)


async def settle_signal(
    services: DriverServices, owner: object, record: StepRecord
) -> StepRecord | None:
    """Wait until the pending signal checkpoint ``record`` settles (its signal stored, or its
    deadline passed), checkpoint that, and return it settled; ``None``: the run has finished.
    ``owner`` is the run's driver, whose bell ``engine.signal`` rings."""
    store = services.store
    run_id = record.run_id
    wakes = store.wakes if isinstance(store, SupportsRunWakes) else None
    while record.status is StepState.PENDING:
        if driver_bell(owner).is_set():  # rung: a fresh bell BEFORE reading the store
            owner.signal_bell = trio.Event()  # type: ignore[attr-defined]
        with _watching(wakes, run_id) as stored:  # taken before the read, as the bell
            following = await _settled(services, record)
            if following is None:
                # The store's ring (a signal stored by any process), the engine's bell, the
                # deadline, or the poll (the safety net: a lost ring), whichever comes first.
                with trio.move_on_after(SIGNAL_POLL):
                    async with trio.open_nursery() as nursery:
                        if record.wake_at is not None:

                            async def deadline(
                                at: float = record.wake_at,
                                scope: trio.CancelScope = nursery.cancel_scope,
                            ) -> None:
                                await services.sleep_until(at)
                                scope.cancel()

                            nursery.start_soon(deadline)
                        await first_of(driver_bell(owner), stored)
                        nursery.cancel_scope.cancel()
                continue
        verdict = await services.guard(
            partial(store.update_step, following, expect_attempt=record.attempt), "checkpointing"
        )
        if verdict is Applied.RUN_FINISHED:
            return None
        if verdict is Applied.APPLIED:
            return following
        found = await services.guard(partial(store.get_step, run_id, record.step_id), "reading")
        if found is None:
            return None
        record = found  # moved on elsewhere (another engine): follow the store
    return record


async def _settled(services: DriverServices, record: StepRecord) -> StepRecord | None:
    """The pending signal checkpoint ``record`` settled by what the store holds now (its
    signal, or its deadline passed), or ``None`` (still waiting)."""
    store = services.store
    run_id, name = record.run_id, record.name
    seq = int(record.input["seq"]) if isinstance(record.input, dict) else 0
    text = await services.guard(partial(store.read_signal, run_id, name, seq), "reading")
    if text is not None:
        try:
            payload = decode_stored(text, f"signal {name!r} #{seq} of run {run_id!r}")
        except SignalDataError as exc:
            return attrs.evolve(record, status=StepState.FAILED, error=_error(exc))
        return attrs.evolve(record, status=StepState.COMPLETED, output=payload)
    if record.wake_at is not None and store.now() >= record.wake_at:
        message = (
            f"no signal {name!r} reached run {run_id!r} within "
            f"{record.input.get('timeout') if isinstance(record.input, dict) else '?'} s"
        )
        return attrs.evolve(
            record,
            status=StepState.FAILED,
            error={"type": "SignalTimeout", "message": message, "retryable": False},
        )
    return None


@contextmanager
def _watching(wakes: RunWakes | None, key: str) -> Iterator[trio.Event]:
    """``wakes.watching(key)``, or an event never set (a store without wakes: the poll)."""
    if wakes is None:
        yield trio.Event()
        return
    with wakes.watching(key) as event:
        yield event


def outcome(record: StepRecord) -> Any:
    """A settled signal checkpoint's payload (or its error raised)."""
    return _outcome(record, record.name)


def _outcome(record: StepRecord, name: str) -> Any:
    if record.status is StepState.COMPLETED:
        return record.output
    error = record.error if isinstance(record.error, dict) else {}
    message = str(error.get("message", f"wait_signal({name!r}) failed"))
    if error.get("type") == "SignalTimeout":
        timeout = record.input.get("timeout") if isinstance(record.input, dict) else None
        raise SignalTimeout(message, name=name, timeout=timeout)
    raise SignalDataError(message)


def driver_bell(driver: Any) -> trio.Event:
    """The event ``engine.signal`` sets to wake ``driver`` (made on first use)."""
    bell: trio.Event | None = getattr(driver, "signal_bell", None)
    if bell is None:
        bell = driver.signal_bell = trio.Event()
    return bell


async def set_event(driver: SignalDriver, step_id: str, key: str, value: Any) -> None:
    """The driver's side of ``ctx.set_event``."""
    services = driver.services
    store = services.store
    run_id = driver.run.run_id
    record = driver.history.take(step_id, StepKind.EVENT, key)
    if record is not None and record.status is StepState.COMPLETED:
        return
    if key == STREAM_EVENT:  # ctx.emit: appended to the run's stream, keyed by its place
        await services.guard(
            partial(append_entry, store, run_id, f"w:{step_id}", value), "appending to a stream"
        )
    else:
        text = encode_payload(value, f"the value of event {key!r}")
        await services.guard(lambda: store.put_event(run_id, key, text), "writing an event")
    fresh = StepRecord(
        run_id=run_id,
        step_id=step_id,
        kind=StepKind.EVENT,
        name=key,
        status=StepState.COMPLETED,
        input=value,
    )
    stored = await services.guard(lambda: store.begin_step(fresh), "checkpointing")
    driver.history.check(stored, StepKind.EVENT, key)


async def apply_command(
    services: DriverServices, run: RunRecord, command: dict[str, Any], step_id: str
) -> bool:
    """Checkpoint a remote workflow's ``signal`` or ``event`` command (its turn asked for a
    wait or wrote an event). Returns ``False`` when the stored history holds another call."""
    store = services.store
    if command.get("type") == "event":
        key = command.get("key")
        if not isinstance(key, str) or not key:
            raise PayloadError(f"an event command needs a key, got {key!r}")
        value = command.get("value")
        text = encode_payload(value, f"the value of event {key!r}")
        fresh = StepRecord(
            run_id=run.run_id,
            step_id=step_id,
            kind=StepKind.EVENT,
            name=key,
            status=StepState.COMPLETED,
            input=value,
        )
        existing = await services.guard(partial(store.get_step, run.run_id, step_id), "reading")
        if existing is None and key == STREAM_EVENT:  # ctx.emit (see set_event)
            entry = f"w:{step_id}"
            try:
                await services.guard(
                    partial(append_entry, store, run.run_id, entry, value), "appending"
                )
            except StreamError:  # full, too large: a remote turn cannot see it, dropped
                services.count("stream_values_dropped")
        elif existing is None:
            await services.guard(partial(store.put_event, run.run_id, key, text), "writing")
        stored = await services.guard(partial(store.begin_step, fresh), "checkpointing")
        return (stored.kind, stored.name) == (StepKind.EVENT, key)
    name, seq, timeout = command.get("name"), command.get("seq"), command.get("timeout")
    if not isinstance(name, str) or not name or not isinstance(seq, int) or seq < 1:
        raise PayloadError(f"a signal command needs a name and a seq >= 1, got {command!r}")
    if timeout is not None and (not isinstance(timeout, int | float) or timeout < 0):
        raise PayloadError(f"a signal command's timeout is {timeout!r}")
    fresh = StepRecord(
        run_id=run.run_id,
        step_id=step_id,
        kind=StepKind.SIGNAL,
        name=name,
        status=StepState.PENDING,
        input={"seq": seq, "timeout": timeout},
        wake_at=None if timeout is None else store.now() + float(timeout),
    )
    stored = await services.guard(partial(store.begin_step, fresh), "checkpointing")
    return (stored.kind, stored.name) == (StepKind.SIGNAL, name)


async def wait_event(store: RunStore, run_id: str, key: str, timeout: float | None) -> Any:  # noqa: ASYNC109 (a durable deadline, not a trio one)
    """:meth:`Engine.get_event` of an existing run: its latest value of event ``key``; if it is
    not set yet, wait up to ``timeout`` seconds for it (the store's ring, else its poll).

    Raises:
        EventTimeout: ``key`` was not set within ``timeout`` (or at once, without one).
        SignalDataError: the stored event is damaged (not JSON).
        ConfigError: ``timeout`` is not a number of seconds >= 0 (NaN waited forever).
    """
    if timeout is not None and not (isinstance(timeout, int | float) and timeout >= 0):
        raise ConfigError(f"engine.get_event: timeout must be seconds >= 0, got {timeout!r}")
    deadline = None if timeout is None else trio.current_time() + timeout
    wakes = store.wakes if isinstance(store, SupportsRunWakes) else None
    while True:
        with ExitStack() as watch:
            # Taken before the read: the store's ring of an event set by any process.
            rung = watch.enter_context(wakes.watching(run_id)) if wakes else None
            stored = await store.get_events(run_id)
            if key in stored:
                return decode_stored(stored[key], f"event {key!r} of run {run_id!r}")
            now = trio.current_time()
            if deadline is None or now >= deadline:
                raise EventTimeout(
                    f"run {run_id!r} has not set event {key!r}"
                    + ("" if timeout is None else f" within {timeout:g} s")
                )
            # The ring, else the poll (a store without wakes, or a lost ring).
            poll = SIGNAL_POLL if rung is not None else SIGNAL_POLL / 10
            with trio.move_on_after(min(poll, deadline - now)):
                if rung is not None:
                    await rung.wait()
                else:
                    await trio.sleep_forever()


async def send_signal(
    store: RunStore,
    driver_of: Callable[[str], object | None],
    run_id: str,
    name: str,
    payload: Any,
) -> int:
    """:meth:`Engine.signal`: store the signal, then ring the bell of the run's driver here
    (``driver_of(run_id)``, if any).

    Raises:
        RunNotFound: no such run.
        RunNotSignalable: the run has finished.
        PayloadError: ``payload`` is not a JSON value.
    """
    check_name(run_id, "engine.signal", "run_id")
    check_unreserved(name, "a signal name")
    text = encode_payload(payload, f"the payload of signal {name!r}")
    seq = await store.append_signal(run_id, name, text)
    if seq is None:
        run = await store.get_run(run_id)
        if run is None:
            raise RunNotFound(run_id)
        raise RunNotSignalable(f"run {run_id!r} is {run.status.value}: it takes no more signals")
    driver = driver_of(run_id)
    if driver is not None:
        driver_bell(driver).set()
    return seq
