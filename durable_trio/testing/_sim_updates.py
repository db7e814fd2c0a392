"""Updates in a simulation (issue 34): each run's updates sent at seeded times through a live
engine (again through the next one, with the same ``update_id``, if that engine dies), and the
invariants that each update is applied once: its caller gets the value its handler returned
the one time it ran, and the run's log of outcomes holds each update id once."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import orjson
import trio

from .._engine._context import UPDATE_DONE

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._engine import Engine
    from ._sim_engines import Engines, RecordingStore
    from ._sim_ledger import Ledger

__all__ = ["UpdatePlan", "check_updates", "send_updates"]

if TYPE_CHECKING:
    UpdatePlan = Callable[[random.Random, str, Any], list[tuple[float, str, Any, Any]]]
    """``(rng, workflow, input) -> [(delay after the start, name, payload, expected value),
    ...]``: each update is sent once the one before it returned (so its place in the run's
    log, and the value its handler returns, are known); ``expected value`` is what the caller
    must get back."""


async def send_updates(
    plan: UpdatePlan,
    seed: int,
    run_id: str,
    workflow: str,
    value: Any,
    engines: Engines,
    ledger: Ledger,
) -> None:
    """Send ``run_id``'s planned updates in turn, each at its time or once the one before it
    returned, with an update id of its own: a call whose engine died is made again through
    the next engine with the same id, so the update is applied once whatever the faults."""
    rng = random.Random(f"{seed}:updates:{run_id}")
    start = trio.current_time()
    for n, (delay, name, payload, wanted) in enumerate(plan(rng, workflow, value), 1):
        await trio.sleep_until(max(trio.current_time(), start + delay))
        update_id = f"{run_id}:u{n}"

        async def send(
            engine: Engine, name: str = name, payload: Any = payload, update_id: str = update_id
        ) -> Any:
            return await engine.update(run_id, name, payload, update_id=update_id)

        try:
            got = await engines.call(send)
        except Exception as exc:  # (an update error: the run took no update it should have)
            ledger.violation(f"{run_id}: update {update_id} raised {type(exc).__name__}: {exc}")
            continue
        if got != wanted:
            ledger.violation(f"{run_id}: update {update_id} returned {got!r}, expected {wanted!r}")
        ledger.event("update", run=run_id, name=name, id=update_id)


async def check_updates(store: RecordingStore, run_ids: list[str], ledger: Ledger) -> None:
    """Each run's log of update outcomes holds each update id at most once, each applied
    (``ok``), in the order the updates were sent."""
    for run_id in run_ids:
        seen: list[str] = []
        seq = 1
        while (text := await store.read_signal(run_id, UPDATE_DONE, seq)) is not None:
            seq += 1
            outcome = orjson.loads(text)
            update_id = str(outcome.get("id"))
            if update_id in seen:
                ledger.violation(f"{run_id}: update {update_id} has two outcomes (applied twice)")
            elif outcome.get("status") != "ok":
                ledger.violation(f"{run_id}: update {update_id} ended {outcome.get('status')!r}")
            seen.append(update_id)
        numbers = [int(u.rsplit(":u", 1)[1]) for u in seen if ":u" in u]
        if numbers != sorted(numbers):
            ledger.violation(f"{run_id}: updates applied out of order: {seen}")
