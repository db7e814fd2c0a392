"""The fixtures plugin under hypothesis and with schedules (issue 30, items 5 and 6): each
``@given`` example on its own virtual clock and backend, schedules on the fixtures' clock.

The plugin's wiring is checked as users get it: ``pytest_plugins`` in a test module of an
inner pytest session (pytester, a subprocess, with and without ``trio_mode``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

import durable_trio as dt
from durable_trio.testing.fixtures import run_given

if TYPE_CHECKING:
    from durable_trio.testing.fixtures import EngineFactory, WorkersFactory

_INNER = """
import pytest
import trio
from hypothesis import HealthCheck, given, settings, strategies as st

import durable_trio as dt

pytest_plugins = ["durable_trio.testing.fixtures"]

app = dt.App("inner")


@app.step("double")
async def double(x):
    return 2 * x


@app.workflow("remind")
async def remind(ctx, x):
    await ctx.sleep(3600)  # an hour of durable sleep
    return await ctx.step("double", x)


started = []


@app.workflow("report")
async def report(ctx, _):
    started.append(trio.current_time())
    return await ctx.step("double", 1)


app.schedule("minutely", "report", every=60)

EXAMPLES = []
SEEN_CLOCKS = []


@settings(max_examples=4, deadline=None)
@given(x=st.integers(min_value=-(2**31), max_value=2**31))  # (2x stays a JSON integer)
async def test_each_example_on_a_fresh_clock_and_backend(engine_for, workers_for, x):
    EXAMPLES.append(x)
    assert trio.current_time() == 0  # a fresh virtual clock
    async with workers_for(app), engine_for(app, reconcile=False) as engine:
        # The same run id in every example: a backend shared with an earlier example would
        # return that example's result.
        run_id = await engine.start("remind", x, run_id="r")
        assert await engine.result(run_id) == 2 * x
        assert trio.current_time() == 3600  # exact: the hour took no wall time


def test_several_examples_ran():
    assert len(EXAMPLES) >= 3


@settings(max_examples=3, deadline=None)
@given(n=st.integers(min_value=0, max_value=1000))
async def test_a_named_clock_is_fresh_too(autojump_clock, memory_backend, n):
    assert trio.lowlevel.current_clock() is autojump_clock  # the example's fresh copy
    assert trio.current_time() == 0
    SEEN_CLOCKS.append(autojump_clock)
    await trio.sleep(3600 * n)
    assert trio.current_time() == 3600 * n
    async with dt.open_queue_transport(memory_backend):
        pass


def test_each_example_had_its_own_clock():
    assert len({id(clock) for clock in SEEN_CLOCKS}) == len(SEEN_CLOCKS) >= 2


@settings(max_examples=2, deadline=None)
@given(n=st.integers())
async def test_another_function_scoped_fixture_keeps_the_health_check(engine_for, tmp_path, n):
    pass


async def test_schedules_fire_on_the_fixtures_clock(engine_for, workers_for):
    async with workers_for(app), engine_for(app):
        await trio.sleep_until(330)
    assert started == [60, 120, 180, 240, 300]
"""


@pytest.mark.parametrize("trio_mode", [True, False])
def test_the_plugin_runs_each_hypothesis_example_on_its_own_clock_and_backend(
    pytester: pytest.Pytester, trio_mode: bool
) -> None:
    body = _INNER
    if trio_mode:
        pytester.makeini("[pytest]\ntrio_mode = true\n")
    else:
        body = body.replace("\nasync def", "\n@pytest.mark.trio\nasync def")
    pytester.makepyfile(test_inner=body)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", timeout=100)
    result.assert_outcomes(passed=5, failed=1)
    # The health check stays for a fixture the plugin does not reset per example.
    result.stdout.fnmatch_lines(["*test_another_function_scoped_fixture_keeps_the_health*"])
    result.stdout.fnmatch_lines(["*FailedHealthCheck*uses a function-scoped fixture*"])


# -- run_given, in this process -------------------------------------------------------------

_app = dt.App("given")


@_app.workflow("nap")
async def _nap(ctx: dt.WorkflowContext, minutes: int) -> float:
    await ctx.sleep(minutes * 60)
    return trio.current_time()


_seen: list[tuple[int, float]] = []


@settings(max_examples=5, deadline=None, database=None)
@given(minutes=st.integers(min_value=1, max_value=60))
async def _property(engine_for: EngineFactory, workers_for: WorkersFactory, minutes: int) -> None:
    async with workers_for(_app), engine_for(_app) as engine:
        run_id = await engine.start("nap", minutes, run_id="same")
        assert await engine.result(run_id) == minutes * 60
    _seen.append((minutes, trio.current_time()))


def test_run_given_runs_each_example_on_a_fresh_clock_and_backend() -> None:
    run_given(_property)
    assert len(_seen) >= 3
    assert all(now == minutes * 60 for minutes, now in _seen)


def test_run_given_refuses_a_test_that_is_not_an_async_given_test() -> None:
    def plain() -> None: ...

    @given(st.integers())
    def sync(n: int) -> None: ...

    for test in (plain, sync):
        with pytest.raises(TypeError, match="not a @given test of an async function"):
            run_given(test)


def test_a_trio_fixture_the_examples_cannot_renew_is_refused() -> None:
    from durable_trio.testing.fixtures import examples_on_virtual_clock

    class TrioFixture:  # what pytest-trio passes for an async fixture
        pass

    async def body(nursery: Any) -> None: ...

    with pytest.raises(pytest.UsageError, match="'nursery' is a trio fixture"):
        examples_on_virtual_clock(body)(nursery=TrioFixture())
