"""Fleet-wide concurrency limits (issue 33, items 1 and 2): the ``SupportsQueueLimits`` half of
the broker contract, one suite for every broker (parametrized in conftest.py, as
test_broker_contract.py). A broker that does not keep limits yet is skipped here, by name; the
worker refuses a limit on it (tests/test_fleet_limits.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from durable_trio import ConfigError
from durable_trio.brokers import Job, SupportsQueueLimits

Q = "t:tasks:limits"


def job(n: int | str, key: str | None = None) -> Job:
    return Job(f"job-{n}", f'{{"n":"{n}"}}'.encode(), key)


def limited(broker: Any) -> SupportsQueueLimits:
    if not isinstance(broker, SupportsQueueLimits):
        pytest.skip(f"{type(broker).__name__} keeps no fleet-wide limits (yet)")
    return broker



async def test_a_queue_limit_bounds_every_claim_path(broker: Any, contract_clock: object) -> None:
    await limited(broker).set_queue_limit(Q, 2)
    for n in range(6):
        await broker.push_on(Q, job(n))
    first = await broker.pop_many(Q, 5, worker="w1")
    assert [c.id for c in first] == ["job-0", "job-1"]
    assert await broker.pop_from(Q, worker="w2") is None
    assert await broker.pop_many(Q, 3, worker="w2") == []
    assert await broker.pop_ahead(Q, 1, 3, worker="w2") == []
    stats = await broker.queue_stats(Q)
    assert (stats.limit, stats.per_key, stats.claimed, stats.ready) == (2, False, 2, 4)
    # One lease ends: one slot, whatever path claims it.
    assert await broker.complete_job(first[0].lease, Q)
    done, claims = await broker.finish_and_claim(
        "t:results", [], Q, [first[1].lease], 4, worker="w3"
    )
    assert done == [True]
    assert [c.id for c in claims] == ["job-2", "job-3"]
    assert await broker.pop_from(Q) is None
    ahead = await broker.pop_ahead(Q, 0, 4)
    assert ahead == []
    assert await broker.size_of(Q) == 2


async def test_a_slot_comes_back_however_the_lease_ends(
    broker: Any, contract_clock: object
) -> None:
    """complete, fail, retry, a reclaim of a silent claim: each frees its slot, none leaks."""
    await limited(broker).set_queue_limit(Q, 1)
    for n in range(5):
        await broker.push_on(Q, job(n))
    one = await broker.pop_from(Q)
    assert await broker.pop_from(Q) is None
    assert await broker.fail_job(one.lease, Q, "boom")
    two = await broker.pop_from(Q)
    assert two.id == "job-1"
    assert await broker.pop_from(Q) is None
    assert await broker.retry_job(two.lease, Q)
    three = await broker.pop_from(Q)
    assert three.id == "job-2"  # (the retry went to the back)
    assert await broker.complete_job(three.lease, Q)
    silent = await broker.pop_from(Q, worker="w-dead")
    assert silent.id == "job-3"
    assert await broker.pop_from(Q) is None
    await trio.sleep(0.3)
    assert (await broker.recover_stalled_jobs(Q, 0.2, 3)).recovered == 1
    back = await broker.pop_from(Q, worker="w2")
    assert back.id == "job-3"
    assert back.stalled_count == 1
    assert await broker.pop_from(Q) is None
    assert (await broker.queue_stats(Q)).claimed == 1


async def test_a_per_key_limit_keeps_keys_independent_and_in_order(
    broker: Any, contract_clock: object
) -> None:
    await limited(broker).set_queue_limit(Q, 1, per_key=True)
    for n, key in enumerate(["a", "a", "b", "a", "b", "c", None, None]):
        await broker.push_on(Q, job(n, key))
    first = await broker.pop_many(Q, 10)
    # One per key; the hot key's jobs behind its first never hold back the others.
    assert [c.id for c in first] == ["job-0", "job-2", "job-5", "job-6"]
    assert await broker.pop_many(Q, 10) == []
    stats = await broker.queue_stats(Q)
    assert (stats.limit, stats.per_key, stats.claimed, stats.ready) == (1, True, 4, 4)
    by_id = {c.id: c for c in first}
    assert await broker.complete_job(by_id["job-0"].lease, Q)
    assert await broker.retry_job(by_id["job-6"].lease, Q)
    again = await broker.pop_many(Q, 10)
    assert [c.id for c in again] == ["job-1", "job-7"]  # each key's next, in push order
    assert await broker.complete_job(by_id["job-2"].lease, Q)
    assert [c.id for c in await broker.pop_many(Q, 10)] == ["job-4"]
    assert await broker.size_of(Q) == 2  # job-3 (a) and job-6 (no key) wait


async def test_a_per_key_limit_above_one(broker: Any, contract_clock: object) -> None:
    await limited(broker).set_queue_limit(Q, 2, per_key=True)
    for n, key in enumerate(["a", "a", "a", "b", "a", "b", "b"]):
        await broker.push_on(Q, job(n, key))
    claims = await broker.pop_ahead(Q, 2, 8)
    assert [c.id for c in claims] == ["job-0", "job-1", "job-3", "job-5"]
    assert [c.started for c in claims] == [True, True, False, False]


async def test_a_reclaimed_per_key_claim_frees_its_key(
    broker: Any, contract_clock: object
) -> None:
    await limited(broker).set_queue_limit(Q, 1, per_key=True)
    await broker.push_on(Q, job(1, "a"))
    await broker.push_on(Q, job(2, "a"))
    silent = await broker.pop_from(Q, worker="w-dead")
    assert silent.id == "job-1"
    assert await broker.pop_from(Q) is None
    await trio.sleep(0.3)
    assert (await broker.recover_stalled_jobs(Q, 0.2, 3)).recovered == 1
    back = await broker.pop_from(Q)
    assert back.id == "job-1"
    assert await broker.pop_from(Q) is None
    assert await broker.complete_job(back.lease, Q)
    assert (await broker.pop_from(Q)).id == "job-2"


async def test_a_poison_claim_re_leased_to_the_sweep_holds_its_slot(
    broker: Any, contract_clock: object
) -> None:
    await limited(broker).set_queue_limit(Q, 1)
    await broker.push_on(Q, job(1))
    await broker.push_on(Q, job(2))
    await broker.pop_from(Q, worker="w-dead")
    await trio.sleep(0.3)
    recovery = await broker.recover_stalled_jobs(Q, 0.2, 0)
    assert [c.id for c in recovery.exceeded] == ["job-1"]
    assert await broker.pop_from(Q) is None
    assert await broker.fail_job(recovery.exceeded[0].lease, Q, "poison")
    assert (await broker.pop_from(Q)).id == "job-2"


async def test_changing_or_removing_the_limit(broker: Any, contract_clock: object) -> None:
    b = limited(broker)
    await b.set_queue_limit(Q, 3)
    for n in range(6):
        await broker.push_on(Q, job(n, "k"))
    held = await broker.pop_many(Q, 6)
    assert len(held) == 3
    await b.set_queue_limit(Q, 1)  # lower: the claims held stay held
    assert await broker.complete_job(held[0].lease, Q)
    assert await broker.pop_from(Q) is None
    await b.set_queue_limit(Q, 1, per_key=True)  # one key "k", held twice
    assert await broker.pop_from(Q) is None
    await b.set_queue_limit(Q, None)
    assert [c.id for c in await broker.pop_many(Q, 6)] == ["job-3", "job-4", "job-5"]
    stats = await broker.queue_stats(Q)
    assert (stats.limit, stats.per_key) == (None, False)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
async def test_a_limit_is_none_or_a_positive_int(
    broker: Any, contract_clock: object, bad: object
) -> None:
    with pytest.raises(ConfigError):
        await limited(broker).set_queue_limit(Q, bad)  # type: ignore[arg-type]


async def test_wait_for_work_waits_at_the_limit_and_wakes_when_a_slot_frees(
    broker: Any, contract_clock: object
) -> None:
    await limited(broker).set_queue_limit(Q, 1)
    await broker.push_on(Q, job(1))
    await broker.push_on(Q, job(2))
    held = await broker.pop_from(Q)
    assert await broker.pop_from(Q) is None
    woke_at: list[float] = []

    async def waiter() -> None:
        await broker.wait_for_work(Q)
        woke_at.append(trio.current_time())

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.sleep(0.2)
            assert woke_at == []  # a ready job none of which fits: no spin
            freed_at = trio.current_time()
            assert await broker.complete_job(held.lease, Q)
    assert woke_at[0] - freed_at < 1.5
    assert (await broker.pop_from(Q)).id == "job-2"


async def test_wait_for_work_waits_while_every_ready_key_is_full(
    broker: Any, contract_clock: object
) -> None:
    await limited(broker).set_queue_limit(Q, 1, per_key=True)
    await broker.push_on(Q, job(1, "a"))
    await broker.push_on(Q, job(2, "a"))
    held = await broker.pop_from(Q)
    assert await broker.pop_many(Q, 4) == []
    with trio.move_on_after(0.2) as scope:
        await broker.wait_for_work(Q)
    assert scope.cancelled_caught
    await broker.push_on(Q, job(3, "b"))  # another key: work at once
    with trio.fail_after(2):
        await broker.wait_for_work(Q)
    assert (await broker.pop_from(Q)).id == "job-3"
    assert await broker.complete_job(held.lease, Q)
    assert (await broker.pop_from(Q)).id == "job-2"


async def test_a_requeued_failed_job_keeps_its_key(broker: Any, contract_clock: object) -> None:
    await limited(broker).set_queue_limit(Q, 1, per_key=True)
    await broker.push_on(Q, job(1, "a"))
    await broker.push_on(Q, job(2, "a"))
    one = await broker.pop_from(Q)
    assert await broker.fail_job(one.lease, Q, "boom")
    two = await broker.pop_from(Q)
    assert await broker.requeue_failed(Q, "job-1")
    assert await broker.pop_from(Q) is None  # still key "a": full
    assert await broker.complete_job(two.lease, Q)
    assert (await broker.pop_from(Q)).id == "job-1"
