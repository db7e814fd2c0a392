"""Fleet-wide limits (issue 33) in the simulation harness: steps with ``max_concurrency`` (one
per key with ``concurrency_key``) served by several workers on the memory broker through a day
of faults. The invariants: never more than N attempts at once per step (or per key), counted
over the executions no fault casts doubt on, and every run still served (no slot leaked by a
killed or stalled worker). The harness is shown to catch a limit broken."""

from __future__ import annotations

import random
from typing import Any

import attrs
import pytest

import durable_trio as dt
from durable_trio.testing import InvariantViolation, Simulation
from durable_trio.testing._sample import CHAOS, WORK_RETRY

API_LIMIT = 3
ACCOUNTS = 3


async def _take(seconds_seed: str) -> None:
    """0.5-20 s of virtual time, the same for one attempt in every replay."""
    import trio

    await trio.sleep(random.Random(seconds_seed).uniform(0.5, 20.0))


def limited_app(name: str = "simlimits", *, api_limit: int | None = API_LIMIT) -> dt.App:
    app = dt.App(name)

    @app.step("api", retry=WORK_RETRY, max_concurrency=api_limit)
    async def api(x: int) -> int:
        info = dt.step_info()
        await _take(f"{info.run_id}:{info.step_id}:{info.attempt}")
        return x * 2

    @app.step(
        "charge",
        retry=WORK_RETRY,
        max_concurrency=1,
        concurrency_key=lambda order: str(order["account"]),
    )
    async def charge(order: dict[str, Any]) -> str:
        info = dt.step_info()
        await _take(f"{info.run_id}:{info.step_id}:{info.attempt}")
        return str(order["account"])

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, n: int) -> list[Any]:
        doubled = await ctx.gather(*(ctx.step("api", n + i) for i in range(3)))
        account = await ctx.step("charge", {"account": f"acct-{n % ACCOUNTS}"})
        return [*doubled, account]

    return app


def workload(rng: random.Random, index: int) -> tuple[str, Any]:
    return "order", rng.randrange(0, 100)


def expected(workflow: str, n: int) -> list[Any]:
    return [2 * n, 2 * (n + 1), 2 * (n + 2), f"acct-{n % ACCOUNTS}"]


#: Every fault kind, workers killed often: slots held by a dead worker must come back.
STORM = attrs.evolve(
    CHAOS,
    kills_per_hour=8.0,
    restarts_per_hour=4.0,
    renewal_pauses_per_hour=4.0,
    stalls_per_hour=4.0,
)


@pytest.mark.parametrize("seed", [3, 17])
def test_limits_hold_through_an_hour_of_faults_and_every_run_is_served(seed: int) -> None:
    report = Simulation(
        limited_app(),
        workload,
        seed=seed,
        runs=120,
        duration=3600,
        workers=4,
        concurrency=8,
        faults=STORM,
        expected_output=expected,
    ).run_sync()
    assert report.runs_completed == report.runs_started == 120
    assert report.runs_unfinished == 0
    assert report.faults["kill"] > 0
    # The limits were reached (32 slots in the fleet, 3 for "api", 1 per account), never passed.
    assert report.concurrency_peaks["api"] == API_LIMIT
    assert {report.concurrency_peaks[f"charge[acct-{n}]"] for n in range(ACCOUNTS)} == {1}
    assert "most at once (max_concurrency): api 3" in report.summary()


def test_the_same_seed_with_limits_gives_the_same_history() -> None:
    def run() -> str:
        return (
            Simulation(limited_app(), workload, seed=5, runs=30, duration=1800, faults=CHAOS)
            .run_sync()
            .digest
        )

    assert run() == run()


def test_the_harness_catches_a_limit_the_broker_does_not_hold() -> None:
    """The workers serve "api" without a limit while the ledger checks the app's limit of 3:
    the fleet runs more at once, and the invariant names the step."""
    served = limited_app(api_limit=None)

    class Unenforced(Simulation):
        def _reset(self) -> None:
            super()._reset()
            self._workers.app = served  # (the broker never hears of the limit checked)

    simulation = Unenforced(
        limited_app(), workload, seed=3, runs=40, duration=1800, expected_output=expected
    )
    with pytest.raises(InvariantViolation, match=r"attempts of api at once at .*max_concurrency 3"):
        simulation.run_sync()


def test_the_limit_check_counts_handovers_and_leaves_out_what_a_fault_explains() -> None:
    from durable_trio.testing._sim_ledger import Execution, Ledger

    app = limited_app()
    ledger = Ledger(transport_options={})
    ledger.end = 100.0

    def ran(n: int, worker: str, start: float, end: float | None, step: str = "api") -> None:
        key = f"acct-{n % 2}" if step == "charge" else None
        execution = Execution(worker, start, end, step=step, key=key)
        ledger.executions[(f"run-{n}", step, 1)] = [execution]

    for n in range(3):
        ran(n, f"w{n}", 0.0, 10.0)
    ran(3, "w3", 10.0, 20.0)  # a slot handed over at t=10: never 4 at once
    ran(4, "w4", 5.0, 8.0)  # its worker stalled meanwhile: its lease may have been taken back
    ledger.window("w4", 6.0, 7.0)
    ran(5, "w5", 0.0, 1.0, "charge")
    ran(6, "w6", 0.5, None, "charge")  # another key; still running at the end
    assert ledger.limit_peaks(app) == {"api": 3, "charge[acct-0]": 1, "charge[acct-1]": 1}
    assert ledger.violations == []
    ran(7, "w7", 9.0, 12.0)  # a fourth beside three, nothing to explain it
    ran(8, "w8", 0.9, 2.0, "charge")  # acct-0 twice at once
    ran(9, "w9", 50.0, 60.0)  # (alone: fine)
    assert ledger.limit_peaks(app) == {"api": 4, "charge[acct-0]": 2, "charge[acct-1]": 1}
    assert ledger.violations == [
        "4 attempts of api at once at 9.000, more than its max_concurrency 3",
        "2 attempts of charge[acct-0] at once at 0.900, more than its max_concurrency 1",
    ]
