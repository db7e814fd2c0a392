"""The coalescer: alone at once when idle, batched while a call is in flight."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio._coalesce import Coalescer


async def test_an_idle_item_goes_out_at_once_and_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    calls: list[list[int]] = []

    async def call(items: list[int]) -> list[int]:
        calls.append(list(items))
        await trio.sleep(1)
        return [i * 10 for i in items]

    coalescer: Coalescer[int, int] = Coalescer(call)
    assert await coalescer.submit(1) == 10
    assert trio.current_time() == 1.0
    assert calls == [[1]]


async def test_items_during_a_call_share_the_next_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    calls: list[list[int]] = []

    async def call(items: list[int]) -> list[int]:
        calls.append(list(items))
        await trio.sleep(1)
        return [i * 10 for i in items]

    coalescer: Coalescer[int, int] = Coalescer(call)
    got: dict[int, tuple[int, float]] = {}

    async def submit(n: int) -> None:
        got[n] = (await coalescer.submit(n), trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(submit, 0)
        await trio.sleep(0.5)
        for n in range(1, 5):
            nursery.start_soon(submit, n)
        await trio.sleep(1.0)
        nursery.start_soon(submit, 5)
    assert [sorted(c) for c in calls] == [[0], [1, 2, 3, 4], [5]]  # (in scheduling order)
    assert got == {
        0: (0, 1.0),
        1: (10, 2.0),
        2: (20, 2.0),
        3: (30, 2.0),
        4: (40, 2.0),
        5: (50, 3.0),
    }


async def test_a_failed_call_fails_every_member(autojump_clock: trio.testing.MockClock) -> None:
    attempts = 0

    async def call(items: list[int]) -> list[int]:
        nonlocal attempts
        attempts += 1
        await trio.sleep(1)
        if attempts == 2:
            raise dt.BrokerUnavailable("down")
        return items

    coalescer: Coalescer[int, int] = Coalescer(call)
    errors: list[BaseException] = []

    async def submit(n: int) -> None:
        try:
            await coalescer.submit(n)
        except dt.BrokerError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(submit, 0)
        await trio.sleep(0.1)
        nursery.start_soon(submit, 1)
        nursery.start_soon(submit, 2)
    assert len(errors) == 2
    assert await coalescer.submit(7) == 7  # and it recovers


async def test_a_cancelled_leader_fails_its_batch_but_not_the_next(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def call(items: list[int]) -> list[int]:
        await trio.sleep(1)
        return items

    coalescer: Coalescer[int, int] = Coalescer(call)
    with trio.move_on_after(0.5):
        await coalescer.submit(1)
    assert await coalescer.submit(2) == 2
    with pytest.raises(trio.TooSlowError):
        with trio.fail_after(0.1):
            await coalescer.submit(3)
    assert await coalescer.submit(4) == 4
