"""Signals in a simulation (issue 18): each run's signals sent at seeded times through a live
engine (again through the next one if that engine dies), and the invariant that each stored
signal is consumed at most once, in order per name, by the run's ``wait_signal`` checkpoints."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import trio

from .._engine import RunNotSignalable, StepKind, StepState
from ._sim_generations import run_history

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._engine import Engine
    from ._sim_engines import Engines, RecordingStore
    from ._sim_ledger import Ledger

__all__ = ["SignalPlan", "check_signals", "send_signals"]

if TYPE_CHECKING:
    SignalPlan = Callable[[random.Random, str, Any], list[tuple[float, str, Any]]]
    """``(rng, workflow, input) -> [(delay after the start, name, payload), ...]``."""


async def send_signals(
    plan: SignalPlan,
    seed: int,
    run_id: str,
    workflow: str,
    value: Any,
    engines: Engines,
    ledger: Ledger,
) -> None:
    """Send ``run_id``'s planned signals at their times. A send whose engine died is sent
    again through the next one only if the store does not hold it yet (exactly one copy)."""
    rng = random.Random(f"{seed}:signals:{run_id}")
    start = trio.current_time()
    sent: dict[str, int] = {}
    for delay, name, payload in sorted(plan(rng, workflow, value), key=lambda s: s[0]):
        await trio.sleep_until(start + delay)
        target = sent.get(name, 0) + 1

        async def send(
            engine: Engine, name: str = name, target: int = target, payload: Any = payload
        ) -> None:
            if await engine.store.read_signal(run_id, name, target) is None:
                await engine.signal(run_id, name, payload)

        try:
            await engines.call(send)
        except RunNotSignalable:
            ledger.violation(f"{run_id}: ended before its signal {name!r} #{target}")
        sent[name] = target
        ledger.event("signal", run=run_id, name=name, seq=target)


async def check_signals(store: RecordingStore, run_ids: list[str], ledger: Ledger) -> None:
    """Each run's completed ``wait_signal`` checkpoints of a name hold seq 1, 2, ... in step
    order, each the payload stored under that seq: each signal consumed once, in order."""
    for run_id in run_ids:
        consumed: dict[str, int] = {}
        for step in await run_history(store, run_id):  # every generation (continue-as-new)
            if step.kind is not StepKind.SIGNAL or step.status is not StepState.COMPLETED:
                continue
            seq = step.input.get("seq") if isinstance(step.input, dict) else None
            expected = consumed.get(step.name, 0) + 1
            if seq != expected:
                ledger.violation(
                    f"{run_id}: wait_signal({step.name!r}) at step {step.step_id} consumed "
                    f"#{seq}, expected #{expected} (each once, in order)"
                )
            consumed[step.name] = expected
            text = await store.read_signal(run_id, step.name, seq if isinstance(seq, int) else 0)
            if text is None or store_value(text) != step.output:
                ledger.violation(
                    f"{run_id}: step {step.step_id} holds {step.output!r}, signal "
                    f"{step.name!r} #{seq} is {text!r}"
                )


def store_value(text: str) -> Any:
    """A stored payload's value."""
    import orjson

    return orjson.loads(text)
