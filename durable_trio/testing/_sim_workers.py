"""The workers of a simulation: one slot per worker process, its worker killed, restarted and
closed over and over (each generation with its own faulty broker, key store and instance id),
and after each close the checks of its close bound and of its liveness keys."""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .._engine import Worker, open_worker
from .._naming import sanitize_token
from .._transport._liveness import MIN_HEARTBEAT_TTL
from ..backends._backend import Backend
from .faults import BrokerFaults, FaultyKeyStore, Injector, wrap_broker

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._engine import App
    from .._naming import QueueNames
    from ..brokers.memory import MemoryBroker
    from ..keys.memory import MemoryKeyStore
    from ._report import Faults
    from ._sim_ledger import Ledger

__all__ = ["Slot", "WorkerSlots", "close_bound"]

#: Cleanup phases of a transport close bounded by ``cleanup_timeout`` each (docs/close.md):
#: consumers, liveness, cancelled handlers, renewal, handback, inboxes.
_CLEANUP_PHASES = 6


def close_bound(transport_options: dict[str, Any]) -> float:
    """The longest a graceful worker close may take (``close_timeout`` plus a
    ``cleanup_timeout`` per cleanup phase)."""
    close = float(transport_options["close_timeout"])
    return close + _CLEANUP_PHASES * float(transport_options["cleanup_timeout"])


@attrs.define(eq=False)
class Slot:
    """One worker process's place: a killed worker is replaced in its slot."""

    index: int
    worker_id: str = ""
    injector: Injector | None = None
    keys: FaultyKeyStore | None = None
    scope: trio.CancelScope | None = None
    worker: Worker | None = None
    stop: trio.Event = attrs.Factory(trio.Event)
    killed: bool = False
    up: bool = False
    stalled_during_close: bool = False


class WorkerSlots:
    """The simulation's ``count`` worker slots.

    Args:
        app: the app the workers serve (each serves it instrumented by the ledger).
        broker, keys: the broker and key store they share (each generation wraps them in its
            own injector).
        names: the queue names of the namespace (where the liveness keys are).
        ledger: where what they do is recorded.
        seed: the simulation's seed.
        count: worker slots.
        concurrency: steps each worker runs at once.
        faults: the simulation's faults.
        transport_options: the workers' transport keywords.
    """

    def __init__(
        self,
        app: App,
        broker: MemoryBroker,
        keys: MemoryKeyStore,
        names: QueueNames,
        ledger: Ledger,
        *,
        seed: int,
        count: int,
        concurrency: int,
        faults: Faults,
        transport_options: dict[str, Any],
    ) -> None:
        self.app = app
        self.broker = broker
        self.keys = keys
        self.names = names
        self.ledger = ledger
        self.seed = seed
        self.concurrency = concurrency
        self.faults = faults
        self.transport_options = transport_options
        self.slots = [Slot(i) for i in range(count)]
        self.closes: list[float] = []
        """How long each graceful close took."""
        self.lost_leases = 0
        """Claims the workers found re-delivered while they ran them."""
        self._stopping = False
        self._healed = False

    @property
    def close_bound(self) -> float:
        return close_bound(self.transport_options)

    @property
    def key_ttl(self) -> float:
        """The TTL of a worker's liveness keys."""
        interval = float(self.transport_options["worker_heartbeat_interval"])
        return max(MIN_HEARTBEAT_TTL, 3 * interval)

    async def run(self, checks: trio.Nursery, done: trio.Event) -> None:
        """Run every slot until :meth:`stop`, then set ``done`` (the key checks of the last
        closes are left running in ``checks``)."""
        async with trio.open_nursery() as slots:
            for slot in self.slots:
                slots.start_soon(self._run_slot, slot, checks)
        done.set()

    async def _run_slot(self, slot: Slot, checks: trio.Nursery) -> None:
        generation = 0
        while not self._stopping:
            worker_id = f"w{slot.index}-{generation}"
            generation += 1
            await self._serve(slot, worker_id, checks)
            if slot.killed:
                slot.stop = trio.Event()  # set by the final shutdown: no restart then
                if self._stopping:
                    return
                with trio.move_on_after(self.faults.restart_delay):
                    await slot.stop.wait()

    async def _serve(self, slot: Slot, worker_id: str, checks: trio.Nursery) -> None:
        ledger = self.ledger
        injector = Injector(
            worker_id,
            random.Random(f"{self.seed}:{worker_id}"),
            BrokerFaults() if self._healed else self.faults.broker,
            ledger.fault_recorder(worker_id),
        )
        keys = FaultyKeyStore(self.keys, injector)
        backend = Backend(url="memory://", broker=wrap_broker(self.broker, injector), keys=keys)
        options: dict[str, Any] = {**self.transport_options, "instance_id": worker_id}
        options.setdefault("on_error", ledger.error_hook(worker_id))
        slot.worker_id, slot.injector, slot.keys = worker_id, injector, keys
        slot.stop, slot.killed, slot.stalled_during_close = trio.Event(), False, False
        closing_at = 0.0
        with trio.CancelScope() as scope:
            slot.scope = scope
            async with open_worker(
                ledger.instrumented(
                    self.app, worker_id, injector, poison=self._poison(slot.index)
                ),
                backend,
                concurrency=self.concurrency,
                **options,
            ) as worker:
                slot.worker, slot.up = worker, True
                ledger.event("worker-up", worker=worker_id)
                await slot.stop.wait()
                closing_at = trio.current_time()
                slot.stalled_during_close = injector.stalled
        slot.up = False
        assert slot.worker is not None
        self.lost_leases += slot.worker.transport.statistics().duplicates
        if slot.killed:
            ledger.event("worker-gone", worker=worker_id)
            # Nobody removes a killed worker's keys: they must expire by their TTL.
            checks.start_soon(self._check_keys_later, worker_id, ledger.now() + self.key_ttl)
            return
        took = trio.current_time() - closing_at
        self.closes.append(took)
        # A close hands back what did not finish within close_timeout (a step whose result
        # push was still in flight too): a redelivery it explains.
        ledger.window(worker_id, closing_at - ledger.t0, ledger.now())
        ledger.event("worker-closed", worker=worker_id, took=took)
        if took > self.close_bound:
            ledger.violation(
                f"worker {worker_id}'s graceful close took {took:.3f} s (bound "
                f"{self.close_bound:.3f} s)"
            )
        if keys.failed_removals or slot.stalled_during_close or injector.stalled:
            # The injector kept the keys from being removed: they must still expire.
            checks.start_soon(self._check_keys_later, worker_id, ledger.now() + self.key_ttl)
        else:
            leftover = await self._liveness_keys(worker_id)
            if leftover:
                ledger.violation(
                    f"worker {worker_id} closed gracefully at {ledger.now():.3f} but its "
                    f"liveness keys remain: {leftover}"
                )

    async def _liveness_keys(self, worker_id: str) -> list[str]:
        suffix = f":{sanitize_token(worker_id)}"
        last_status = self.names.worker_last_status(worker_id)
        return [
            entry.key
            for entry in await self.keys.entries(f"{self.names.prefix}-")
            if entry.key.endswith(suffix) and entry.key != last_status
        ]

    async def _check_keys_later(self, worker_id: str, at: float) -> None:
        await trio.sleep_until(self.ledger.t0 + at + 1e-6)
        leftover = await self._liveness_keys(worker_id)
        if leftover:
            self.ledger.violation(
                f"worker {worker_id}'s liveness keys outlived their TTL ({self.key_ttl:g} s): "
                f"{leftover}"
            )

    # ------------------------------------------------------------------ scheduled faults

    def strike(self, index: int, kind: str, seconds: float) -> None:
        """Strike slot ``index``'s worker with a scheduled fault (``kill``, ``restart``,
        ``pause-renewal`` or ``stall`` for ``seconds``), unless it is down already."""
        slot = self.slots[index]
        injector = slot.injector
        if not slot.up or injector is None or slot.stop.is_set():
            return  # down already (killed, restarting): nothing to strike
        ledger = self.ledger
        worker_id = slot.worker_id
        now = ledger.now()
        ledger.fault_counts[kind] += 1
        ledger.event("fault", kind=kind, process=worker_id, seconds=seconds)
        if kind in ("kill", "poison-kill"):
            ledger.window(worker_id, now, math.inf)
            slot.killed = True
            injector.kill()
            assert slot.scope is not None
            slot.scope.cancel()
            slot.stop.set()
        elif kind == "restart":
            slot.stop.set()
        elif kind == "pause-renewal":
            ledger.window(worker_id, now, now + seconds)
            injector.pause_renewal(seconds)
        else:
            ledger.window(worker_id, now, now + seconds)
            injector.stall(seconds)

    def _poison(self, index: int) -> Callable[[str, str], bool] | None:
        """For slot ``index``'s worker: whether a step is poison, and if so it kills the worker
        running it (``None``: no step is)."""
        chance = self.faults.poison_probability
        if chance <= 0:
            return None

        def poison(run_id: str, step_id: str) -> bool:
            if random.Random(f"{self.seed}:poison:{run_id}:{step_id}").random() >= chance:
                return False
            self.strike(index, "poison-kill", 0.0)
            return True

        return poison

    def heal(self) -> None:
        """No more per-call faults, for the workers up and every replacement."""
        self._healed = True
        for slot in self.slots:
            if slot.injector is not None:
                slot.injector.quiet_down()

    def stop(self) -> None:
        """Close every worker, with no replacement (:meth:`run` returns once they are)."""
        self._stopping = True
        for slot in self.slots:
            slot.stop.set()
