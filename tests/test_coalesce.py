"""The coalescer: alone at once when idle, batched while a call is in flight."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio._coalesce import Coalescer

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable


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
    # Unreachable for each of them (the broker was): their callers try again, as the leader's
    # would (issue 36: a follower's plain BrokerError left a finished job to the sweep).
    assert all(type(exc) is dt.BrokerUnavailable for exc in errors), errors
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


def _recorded(
    calls: list[tuple[float, list[int]]],
) -> Callable[[list[int]], Awaitable[list[int]]]:
    """A broker call of 1 s that records when it began and its items (sorted)."""

    async def call(items: list[int]) -> list[int]:
        calls.append((trio.current_time(), sorted(items)))
        await trio.sleep(1)
        return items

    return call


async def test_with_most_a_full_batch_goes_while_a_call_is_in_flight(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two halves: a batch holds at most ``most()`` items; a full one leaves at once while
    one call is in flight (two at most); one not full waits until the broker is idle, or the
    process: here at 1.25, when the call of 1-3 landed and nothing else was left to run."""
    calls: list[tuple[float, list[int]]] = []
    coalescer: Coalescer[int, int] = Coalescer(_recorded(calls), most=lambda: 3)
    done: dict[int, float] = {}

    async def submit(n: int) -> None:
        assert await coalescer.submit(n) == n
        done[n] = trio.current_time()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(submit, 0)  # alone, at 0
        await trio.sleep(0.25)
        for n in range(1, 9):  # 1-3 full: out at once; 4-6 full, but two are in flight
            nursery.start_soon(submit, n)
        await trio.sleep(0.25)
    # (which items share a batch follows the order the tasks were scheduled in)
    assert [(at, len(items)) for at, items in calls] == [
        (0.0, 1),
        (0.25, 3),  # full, beside the call in flight
        (1.0, 3),  # full: out as soon as one call of the two landed
        (1.25, 2),  # not full: out once the process was idle, beside the call of 4-6
    ]
    assert sorted(n for _, items in calls for n in items) == list(range(9))
    assert sorted(done.values()) == [1.0] + [1.25] * 3 + [2.0] * 3 + [2.25] * 2
    assert coalescer.idle


async def test_with_most_the_member_that_fills_a_batch_leads_it_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A batch filled beside the call in flight goes in the filling member's own turn, led by
    it (the first member is not scheduled first: one pass sooner, which is what keeps the two
    halves apart under load); the first member waits for its answer as any other, shielded as
    it was to lead, so a cancel meanwhile does not take its answer away (nor the filler's, which
    leads shielded). A failed call: the filler gets the error itself, the first member one of
    its kind naming it."""
    leaders: list[tuple[str, list[int]]] = []
    fail = False

    async def call(items: list[int]) -> list[int]:
        leaders.append((trio.lowlevel.current_task().name, list(items)))
        await trio.sleep(1)
        if fail and len(items) == 2:
            raise dt.BrokerUnavailable("down")
        return [i * 10 for i in items]

    coalescer: Coalescer[int, int] = Coalescer(call, most=lambda: 2)
    got: dict[int, object] = {}

    async def submit(n: int, cancel_at: float | None = None) -> None:
        with trio.CancelScope() as scope:
            if cancel_at is not None:
                scope.deadline = cancel_at
            try:
                got[n] = await coalescer.submit(n)
            except dt.BrokerUnavailable as exc:
                got[n] = str(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(submit, 0, name="0")
        await trio.sleep(0.25)
        for n in (1, 2):  # (Trio runs the two in either order)
            nursery.start_soon(submit, n, 0.5, name=str(n))  # cancelled while their call flies
    (alone, (leader, items)) = leaders
    assert alone == ("0", [0])
    assert sorted(items) == [1, 2]
    assert leader == str(items[-1])  # the one that filled it
    assert got == {0: 0, 1: 10, 2: 20}
    assert trio.current_time() == 1.25
    assert coalescer.idle

    fail, got, leaders = True, {}, []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(submit, 3, name="3")
        await trio.sleep(0.25)
        for n in (4, 5):
            nursery.start_soon(submit, n, name=str(n))
    first, filler = leaders[1][1]
    assert got == {3: 30, first: "a coalesced broker call failed: down", filler: "down"}
    assert coalescer.idle


async def test_with_most_a_batch_not_full_waits_while_the_process_has_work(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A batch not full goes beside the call in flight only once the process runs out of work:
    items submitted while other tasks still run join it (here 1, then 2, while a task runs
    for 100 scheduler passes at 0.25), and it leaves when they are done, at the same instant
    (without the idle release it would wait for the broker, until 1.0)."""
    calls: list[tuple[float, list[int]]] = []
    coalescer: Coalescer[int, int] = Coalescer(_recorded(calls), most=lambda: 3)

    async def busy(nursery: trio.Nursery) -> None:
        for n in range(100):
            if n in (10, 50):
                nursery.start_soon(coalescer.submit, n // 40 + 1)
            await trio.lowlevel.checkpoint()
        calls.append((trio.current_time(), []))  # (the work done, before the batch left)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(coalescer.submit, 0)
        await trio.sleep(0.25)
        nursery.start_soon(busy, nursery)
    assert calls == [(0.0, [0]), (0.25, []), (0.25, [1, 2])]
    assert trio.current_time() == 1.25


async def test_with_most_the_work_settles_into_two_alternating_halves(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Ten workers, each a 0.3 s job then a 1 s finalize: from the first batches (one alone,
    then the rest) the work splits into batches of at most five, one at the broker while the
    others' jobs run (and, the process idle meanwhile, a batch not full beside it), and the
    last call leaves at 29.6 s; without ``most`` it stays one job, then the other nine, and
    the last call leaves at 39.3 s."""

    async def settle(most: int | None) -> list[tuple[float, int]]:
        sizes: list[tuple[float, int]] = []
        began = trio.current_time()

        async def call(items: list[int]) -> list[int]:
            sizes.append((round(trio.current_time() - began, 1), len(items)))
            await trio.sleep(1)
            return items

        coalescer: Coalescer[int, int] = Coalescer(
            call, most=None if most is None else (lambda: most)
        )

        async def worker(n: int) -> None:
            for _ in range(20):
                await trio.sleep(0.3)
                await coalescer.submit(n)

        async with trio.open_nursery() as nursery:
            for n in range(10):
                nursery.start_soon(worker, n)
        return sizes

    halves = await settle(5)
    # (the same over 300 runs, whatever order Trio runs the tasks woken together in)
    assert max(size for _, size in halves) == 5, halves
    assert halves[-1][0] == 29.6, halves
    assert await settle(None) == [(0.3, 1), (1.3, 9)] + [(n + 0.3, 1 if n % 2 == 0 else 9)
                                                        for n in range(2, 40)]


@pytest.mark.parametrize("seed", range(8))
async def test_with_most_every_item_gets_its_own_answer_under_a_random_load(
    autojump_clock: trio.testing.MockClock, seed: int
) -> None:
    """Calls of random lengths, items at random moments: every item gets its own answer, no
    batch holds more than ``most()`` items, never more than two calls fly, and no item joins a
    batch already on its way (a batch released while the one before it still waited for its
    leader once took items after it was sent: an IndexError in the S1 bench)."""
    rng = random.Random(seed)
    flying = most_flying = 0
    sizes: list[int] = []

    async def call(items: list[int]) -> list[int]:
        nonlocal flying, most_flying
        sent = list(items)
        flying += 1
        most_flying = max(most_flying, flying)
        sizes.append(len(items))
        await trio.sleep(rng.choice([0.0, 0.1, 0.5, 1.0]))
        flying -= 1
        assert items == sent  # nothing joined it on its way
        return [i * 10 for i in items]

    coalescer: Coalescer[int, int] = Coalescer(call, most=lambda: 3)

    async def worker(first: int) -> None:
        for n in range(first, first + 30):
            await trio.sleep(rng.choice([0.0, 0.0, 0.05, 0.3]))
            assert await coalescer.submit(n) == n * 10

    async with trio.open_nursery() as nursery:
        for w in range(10):
            nursery.start_soon(worker, w * 100)
    assert sum(sizes) == 300
    assert max(sizes) <= 3
    assert most_flying == 2
    assert coalescer.idle
