"""Testing durable_trio applications: the whole system in one ``trio.run``, on a virtual clock.

- :class:`Simulation`: one engine, N workers and a memory broker, a seeded workload and seeded
  faults (kill a worker, pause its renewal, stall it, delay or drop its broker calls, fail its
  key-store writes); after every run it checks the invariants (no run lost, every settled step
  settled once, duplicates only where a fault explains them, close bounds held, no liveness key
  outliving its worker) and raises :class:`InvariantViolation` with the seed and a command that
  replays it. One seed, one history, byte for byte.
- :mod:`durable_trio.testing.faults`: the fault injectors on their own (:func:`wrap_broker`,
  :class:`FaultyKeyStore`), for hand-written tests.
- :mod:`durable_trio.testing.fixtures`: pytest fixtures (``pytest_plugins =
  ["durable_trio.testing.fixtures"]``): ``memory_backend``, ``engine_for``, ``workers_for``,
  on a virtual clock (each hypothesis ``@given`` example on its own clock and backend).
- :mod:`durable_trio.testing.strategies`: hypothesis strategies for every wire message
  (needs ``hypothesis``).

See ``docs/testing.md``.
"""

from __future__ import annotations

from .._engine._wall_clock import virtual_wall_clock
from ._report import Faults, InvariantViolation, SimulationReport
from .faults import BrokerFaults, FaultyBroker, FaultyKeyStore, Injector, wrap_broker
from .simulation import DEFAULT_TRANSPORT_OPTIONS, SEED_VARIABLE, Simulation, Workload

__all__ = [
    "DEFAULT_TRANSPORT_OPTIONS",
    "SEED_VARIABLE",
    "BrokerFaults",
    "Faults",
    "FaultyBroker",
    "FaultyKeyStore",
    "Injector",
    "InvariantViolation",
    "Simulation",
    "SimulationReport",
    "Workload",
    "virtual_wall_clock",
    "wrap_broker",
]
