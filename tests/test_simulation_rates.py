"""Rate limits (issue 33, item 3) in the simulation harness: a step with ``rate_limit`` served
by several workers on the memory broker through an hour of faults. The invariants: no window of
``per`` seconds holds more starts than the rate (over the executions no fault casts doubt on),
and every run still served. The harness is shown to catch a rate broken."""

from __future__ import annotations

import random
from typing import Any

import pytest

import durable_trio as dt
from durable_trio.testing import InvariantViolation, Simulation
from durable_trio.testing._sample import WORK_RETRY
from test_simulation_limits import STORM

RATE = dt.Rate(5, per=10.0)


def rated_app(name: str = "simrates", *, rate: dt.Rate | None = RATE) -> dt.App:
    app = dt.App(name)

    @app.step("api", retry=WORK_RETRY, rate_limit=rate)
    async def api(x: int) -> int:
        import trio

        info = dt.step_info()
        seed = f"{info.run_id}:{info.step_id}:{info.attempt}"
        await trio.sleep(random.Random(seed).uniform(0.1, 3.0))
        return x * 2

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, n: int) -> list[Any]:
        return list(await ctx.gather(*(ctx.step("api", n + i) for i in range(3))))

    return app


def workload(rng: random.Random, index: int) -> tuple[str, Any]:
    return "order", rng.randrange(0, 100)


def expected(workflow: str, n: int) -> list[Any]:
    return [2 * n, 2 * (n + 1), 2 * (n + 2)]


@pytest.mark.parametrize("seed", [3, 17])
def test_a_rate_holds_through_an_hour_of_faults_and_every_run_is_served(seed: int) -> None:
    report = Simulation(
        rated_app(),
        workload,
        seed=seed,
        runs=60,
        duration=3600,
        workers=4,
        concurrency=8,
        faults=STORM,
        expected_output=expected,
    ).run_sync()
    assert report.runs_completed == report.runs_started == 60
    assert report.faults["kill"] > 0
    assert report.rate_peaks == {"api": RATE.count}  # reached, never passed


def test_the_harness_catches_a_rate_the_broker_does_not_hold() -> None:
    served = rated_app(rate=None)

    class Unenforced(Simulation):
        def _reset(self) -> None:
            super()._reset()
            self._workers.app = served  # (the broker never hears of the rate checked)

    simulation = Unenforced(
        rated_app(), workload, seed=3, runs=20, duration=1800, expected_output=expected
    )
    with pytest.raises(InvariantViolation, match=r"starts of api within 10 s .*rate_limit 5"):
        simulation.run_sync()


def parity(x: int) -> str:
    return "even" if x % 2 == 0 else "odd"


KEYED = dt.Rate(3, per=10.0, key=parity)


def test_a_per_key_rate_holds_per_key_through_faults() -> None:
    """Per-key rates: no window holds more than the rate's starts of one key value (the
    ledger groups the starts per key), every run served, and both keys reach their rate."""
    report = Simulation(
        rated_app("simkeyrates", rate=KEYED),
        workload,
        seed=5,
        runs=40,
        duration=1800,
        workers=3,
        concurrency=8,
        faults=STORM,
        expected_output=expected,
    ).run_sync()
    assert report.runs_completed == report.runs_started == 40
    assert report.rate_peaks == {"api[even]": 3, "api[odd]": 3}


def test_the_harness_catches_a_per_key_rate_not_held() -> None:
    served = rated_app("simkeyrates", rate=dt.Rate(1000, per=10.0, key=parity))  # (too loose)

    class Unenforced(Simulation):
        def _reset(self) -> None:
            super()._reset()
            self._workers.app = served

    simulation = Unenforced(
        rated_app("simkeyrates", rate=KEYED),
        workload,
        seed=3,
        runs=20,
        duration=1800,
        expected_output=expected,
    )
    with pytest.raises(InvariantViolation, match=r"starts of api\[(even|odd)\] within 10 s"):
        simulation.run_sync()
