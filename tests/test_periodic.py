"""The shared fixed-rate timer (``durable_trio._periodic.fixed_rate``), in virtual time."""

from __future__ import annotations

import trio
import trio.testing

from durable_trio._periodic import fixed_rate


async def test_the_first_tick_is_one_period_after_the_call_then_steady(
    autojump_clock: trio.testing.MockClock,
) -> None:
    await trio.sleep(3)
    seen: list[tuple[int, float]] = []
    async for tick in fixed_rate(2.0):
        seen.append((tick, trio.current_time()))
        if tick == 4:
            break
    assert seen == [(1, 5.0), (2, 7.0), (3, 9.0), (4, 11.0)]


async def test_the_grid_is_where_the_ticks_fall_not_where_the_body_ended(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen: list[float] = []
    async for tick in fixed_rate(10.0):
        seen.append(trio.current_time())
        await trio.sleep(3)  # a body shorter than the period does not push the grid
        if tick == 3:
            break
    assert seen == [10.0, 20.0, 30.0]


async def test_a_body_that_overran_skips_the_ticks_it_overran(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen: list[tuple[int, float]] = []
    async for tick in fixed_rate(10.0):
        seen.append((tick, trio.current_time()))
        if tick == 1:
            await trio.sleep(25)  # ends at 35: 20 and 30 were overrun
        if tick == 5:
            break
    assert seen == [(1, 10.0), (4, 40.0), (5, 50.0)]


async def test_a_body_that_ends_exactly_on_a_grid_point_has_overrun_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen: list[tuple[int, float]] = []
    async for tick in fixed_rate(10.0):
        seen.append((tick, trio.current_time()))
        if tick == 1:
            await trio.sleep(10)  # ends at 20, exactly tick 2's time: tick 2 is overrun
        if tick == 3:
            break
    assert seen == [(1, 10.0), (3, 30.0)]


async def test_catch_up_runs_the_overrun_ticks_at_once_then_rejoins_the_grid(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen: list[tuple[int, float]] = []
    async for tick in fixed_rate(10.0, catch_up=True):
        seen.append((tick, trio.current_time()))
        if tick == 1:
            await trio.sleep(25)
        if tick == 5:
            break
    assert seen == [(1, 10.0), (2, 35.0), (3, 35.0), (4, 40.0), (5, 50.0)]


async def test_a_cancelled_loop_just_ends(autojump_clock: trio.testing.MockClock) -> None:
    seen: list[float] = []
    with trio.move_on_after(25):
        async for _ in fixed_rate(10.0):
            seen.append(trio.current_time())
    assert seen == [10.0, 20.0]
    assert trio.current_time() == 25.0
