"""The broker contract (brokers/_contract.py), one suite for every broker (parametrized in
conftest.py); T3 and T9 name sections of docs/spec.md.

Durations are short and real on brokers whose clock is a server's; on the memory broker the same
tests run under a virtual clock (pytest-trio takes the clock from a test's own arguments, hence
``contract_clock`` in every signature).
"""

from __future__ import annotations

from typing import Any

import trio

from durable_trio.brokers import (
    Job,
    Lease,
    SupportsBatchFinalize,
    SupportsBatchPop,
    SupportsFailedJobs,
    SupportsRecovery,
    SupportsRenewal,
    SupportsSize,
    SupportsWakeup,
)

Q = "t:tasks:contract"


def job(n: int | str) -> Job:
    return Job(f"job-{n}", f'{{"n":"{n}"}}'.encode())


async def test_every_capability_is_present(broker: Any, contract_clock: object) -> None:
    for capability in (
        SupportsBatchFinalize,
        SupportsBatchPop,
        SupportsRenewal,
        SupportsRecovery,
        SupportsSize,
        SupportsFailedJobs,
        SupportsWakeup,
    ):
        assert isinstance(broker, capability), capability.__name__


async def test_push_then_pop_claims_the_job_under_a_lease(
    broker: Any, contract_clock: object
) -> None:
    assert await broker.pop_from(Q) is None
    await broker.push_on(Q, job(1))
    claimed = await broker.pop_from(Q, worker="w1")
    assert claimed is not None
    assert claimed.id == "job-1"
    assert claimed.data == b'{"n":"1"}'
    assert claimed.lease.job_id == "job-1"
    assert claimed.attempts == 0
    assert claimed.stalled_count == 0
    assert await broker.pop_from(Q) is None


async def test_fifo_within_one_priority_even_in_the_same_millisecond(
    broker: Any, contract_clock: object
) -> None:
    """T3: a sequence, not a timestamp, orders equal-priority jobs."""
    for n in range(60):
        await broker.push_on(Q, job(n))
    popped = [(await broker.pop_from(Q)).id for _ in range(60)]
    assert popped == [f"job-{n}" for n in range(60)]


async def test_lower_priority_number_first_then_fifo(broker: Any, contract_clock: object) -> None:
    """T3."""
    await broker.push_on(Q, job("a5"), priority=5)
    await broker.push_on(Q, job("b-default"))
    await broker.push_on(Q, job("c1"), priority=1)
    await broker.push_on(Q, job("d5"), priority=5)
    await broker.push_on(Q, job("e1"), priority=1)
    await broker.push_on(Q, job("f-neg"), priority=-3)
    order = [(await broker.pop_from(Q)).id for _ in range(6)]
    assert order == ["job-f-neg", "job-b-default", "job-c1", "job-e1", "job-a5", "job-d5"]


async def test_queues_are_isolated(broker: Any, contract_clock: object) -> None:
    await broker.push_on(Q, job(1))
    assert await broker.pop_from(Q + "-other") is None
    assert await broker.size_of(Q + "-other") == 0
    assert await broker.size_of(Q) == 1


async def test_complete_answers_false_once_the_lease_is_gone(
    broker: Any, contract_clock: object
) -> None:
    await broker.push_on(Q, job(1))
    claimed = await broker.pop_from(Q)
    forged = Lease(claimed.lease.job_id, claimed.lease.token + "x")
    assert await broker.complete_job(forged, Q) is False
    assert await broker.complete_job(claimed.lease, Q) is True
    assert await broker.complete_job(claimed.lease, Q) is False
    assert await broker.retry_job(claimed.lease, Q) is False
    assert await broker.fail_job(claimed.lease, Q, "late") is False
    assert await broker.pop_from(Q) is None


async def test_failed_jobs_are_kept_inspectable(broker: Any, contract_clock: object) -> None:
    await broker.push_on(Q, job(1))
    await broker.push_on(Q, job(2))
    first = await broker.pop_from(Q)
    second = await broker.pop_from(Q)
    assert await broker.fail_job(first.lease, Q, "boom 1") is True
    assert await broker.fail_job(second.lease, Q, "boom 2") is True
    failed = await broker.failed_jobs(Q)
    assert [(f.id, f.error, f.data) for f in failed] == [
        ("job-2", "boom 2", b'{"n":"2"}'),
        ("job-1", "boom 1", b'{"n":"1"}'),
    ]
    assert await broker.failed_jobs(Q, limit=1) == failed[:1]
    assert await broker.pop_from(Q) is None
    assert await broker.size_of(Q) == 0


async def test_retry_counts_an_attempt_and_handback_does_not(
    broker: Any, contract_clock: object
) -> None:
    await broker.push_on(Q, job(1))
    claimed = await broker.pop_from(Q)
    assert await broker.retry_job(claimed.lease, Q) is True
    again = await broker.pop_from(Q)
    assert again.id == "job-1"
    assert again.attempts == 1
    assert again.lease.token != claimed.lease.token
    assert await broker.complete_job(claimed.lease, Q) is False
    assert await broker.retry_job(again.lease, Q, count_attempt=False) is True
    third = await broker.pop_from(Q)
    assert third.attempts == 1
    assert third.stalled_count == 0


async def test_delayed_push_and_delayed_retry_wait_their_turn(
    broker: Any, contract_clock: object
) -> None:
    await broker.push_on(Q, job("later"), delay=0.3)
    assert await broker.pop_from(Q) is None
    assert await broker.size_of(Q) == 1
    await broker.push_on(Q, job("now"))
    claimed = await broker.pop_from(Q)
    assert claimed.id == "job-now"
    assert await broker.retry_job(claimed.lease, Q, delay=0.6) is True
    assert await broker.pop_from(Q) is None
    await trio.sleep(0.4)
    assert (await broker.pop_from(Q)).id == "job-later"
    assert await broker.pop_from(Q) is None
    await trio.sleep(0.3)
    assert (await broker.pop_from(Q)).id == "job-now"


async def test_wait_for_work_returns_at_once_when_work_is_ready(
    broker: Any, contract_clock: object
) -> None:
    await broker.push_on(Q, job(1))
    with trio.fail_after(1):
        await broker.wait_for_work(Q)


async def test_wait_for_work_wakes_on_a_push(broker: Any, contract_clock: object) -> None:
    assert await broker.pop_from(Q) is None
    woke_at: list[float] = []

    async def waiter() -> None:
        await broker.wait_for_work(Q)
        woke_at.append(trio.current_time())

    with trio.fail_after(2):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.sleep(0.1)
            assert woke_at == []
            pushed_at = trio.current_time()
            await broker.push_on(Q, job(1))
    assert woke_at[0] - pushed_at < 0.5


async def test_wait_for_work_wakes_when_a_delayed_job_comes_due(
    broker: Any, contract_clock: object
) -> None:
    await broker.push_on(Q, job(1), delay=0.2)
    start = trio.current_time()
    with trio.fail_after(2):
        await broker.wait_for_work(Q)
    assert trio.current_time() - start >= 0.15
    assert (await broker.pop_from(Q)).id == "job-1"


async def test_renew_keeps_claims_and_names_the_lost_ones(
    broker: Any, contract_clock: object
) -> None:
    await broker.push_on(Q, job(1))
    await broker.push_on(Q, job(2))
    one = await broker.pop_from(Q)
    two = await broker.pop_from(Q)
    assert await broker.complete_job(two.lease, Q)
    outcome = await broker.renew_jobs(Q, [one.lease, two.lease])
    assert outcome.renewed == 1
    assert outcome.lost == (two.lease,)


async def test_recover_takes_back_only_silent_claims(broker: Any, contract_clock: object) -> None:
    """T9 (contract half): old claims go back to pending with stalled_count + 1; a renewed claim
    is left alone; the stale lease is dead."""
    await broker.push_on(Q, job("silent"))
    await broker.push_on(Q, job("renewed"))
    silent = await broker.pop_from(Q, worker="w-silent")
    renewed = await broker.pop_from(Q, worker="w-alive")
    await trio.sleep(0.3)
    assert (await broker.renew_jobs(Q, [renewed.lease])).renewed == 1
    recovery = await broker.recover_stalled_jobs(Q, 0.2, 3)
    assert recovery.recovered == 1
    assert recovery.exceeded == ()
    assert await broker.complete_job(silent.lease, Q) is False
    assert await broker.complete_job(renewed.lease, Q) is True
    back = await broker.pop_from(Q, worker="w2")
    assert back.id == "job-silent"
    assert back.stalled_count == 1
    assert [s.worker for s in back.stalls] == ["w-silent"]
    assert back.attempts == 0


async def test_recover_hands_poison_to_the_caller_past_max_stalled(
    broker: Any, contract_clock: object
) -> None:
    await broker.push_on(Q, job("poison"))
    for stall in range(1, 3):
        claimed = await broker.pop_from(Q, worker=f"w{stall}")
        assert claimed.stalled_count == stall - 1
        if not claimed.started:  # a suspect: it counts once its handler starts
            assert await broker.mark_started(Q, [claimed.lease]) == [True]
        await trio.sleep(0.3)
        recovery = await broker.recover_stalled_jobs(Q, 0.2, 1 if stall == 2 else 5)
        if stall == 1:
            assert recovery.recovered == 1
    assert recovery.recovered == 0
    (poison,) = recovery.exceeded
    assert poison.id == "job-poison"
    assert poison.stalled_count == 2
    assert [s.worker for s in poison.stalls] == ["w1", "w2"]
    assert await broker.pop_from(Q) is None  # still claimed, by the caller
    assert await broker.fail_job(poison.lease, Q, "stalled more than 1 times") is True
    (failed,) = await broker.failed_jobs(Q)
    assert failed.stalled_count == 2
    assert len(failed.stalls) == 2


async def test_a_poison_job_whose_sweep_died_before_failing_it_counts_no_further_stall(
    broker: Any, contract_clock: object
) -> None:
    """A job past the limit is re-leased to the sweep that found it; should that sweep's
    instance die before it fails the job (a kill storm), the next sweep hands it over exceeded
    again with its count and history as they were: the sweep's lease is no delivery, and its
    handler never ran under it."""
    await broker.push_on(Q, job("poison"))
    claimed = await broker.pop_from(Q, worker="w1")
    await trio.sleep(0.3)
    (first,) = (await broker.recover_stalled_jobs(Q, 0.2, 0)).exceeded
    assert (first.stalled_count, [s.worker for s in first.stalls]) == (1, ["w1"])
    await trio.sleep(0.3)  # the sweep died holding it: its lease goes silent
    recovery = await broker.recover_stalled_jobs(Q, 0.2, 0)
    assert recovery.recovered == 0
    (again,) = recovery.exceeded
    assert again.id == "job-poison"
    assert again.stalled_count == 1
    assert [(s.worker, s.counted) for s in again.stalls] == [("w1", True)]
    assert await broker.complete_job(first.lease, Q) is False  # the dead sweep's lease
    assert await broker.complete_job(claimed.lease, Q) is False
    assert await broker.fail_job(again.lease, Q, "stalled more than 0 times") is True
    (failed,) = await broker.failed_jobs(Q)
    assert (failed.stalled_count, len(failed.stalls)) == (1, 1)


async def test_recover_leaves_fresh_claims_alone(broker: Any, contract_clock: object) -> None:
    for n in range(20):
        await broker.push_on(Q, job(n))
    for _ in range(20):
        await broker.pop_from(Q)
    recovery = await broker.recover_stalled_jobs(Q, 30.0, 3)
    assert recovery.recovered == 0
    assert recovery.exceeded == ()


async def test_size_counts_ready_and_delayed_not_claimed(
    broker: Any, contract_clock: object
) -> None:
    await broker.push_on(Q, job(1))
    await broker.push_on(Q, job(2), delay=5)
    await broker.push_on(Q, job(3))
    assert await broker.size_of(Q) == 3
    await broker.pop_from(Q)
    assert await broker.size_of(Q) == 2


async def test_reclaimed_and_handed_back_jobs_keep_their_place(
    broker: Any, contract_clock: object
) -> None:
    """A job taken back from a silent worker, or handed back by a closing one, runs before the
    jobs queued after it (it waited its turn once already); a retry goes to the back."""
    await broker.push_on(Q, job("first"))
    await broker.push_on(Q, job("second"))
    first = await broker.pop_from(Q)
    await broker.push_on(Q, job("third"))
    await trio.sleep(0.3)
    assert (await broker.recover_stalled_jobs(Q, 0.2, 3)).recovered == 1
    assert (await broker.pop_from(Q)).id == "job-first"
    second = await broker.pop_from(Q)
    assert second.id == "job-second"
    assert await broker.retry_job(second.lease, Q, count_attempt=False) is True
    assert (await broker.pop_from(Q)).id == "job-second"
    third = await broker.pop_from(Q)
    assert third.id == "job-third"
    await broker.push_on(Q, job("fourth"))
    assert await broker.retry_job(third.lease, Q) is True  # a counted retry: to the back
    assert [(await broker.pop_from(Q)).id for _ in range(2)] == ["job-fourth", "job-third"]
    assert first is not None


async def test_batch_finalize_matches_one_by_one(broker: Any, contract_clock: object) -> None:
    await broker.push_many(Q, [job(1), job(2), job(3)], [None, 5, -1])
    order = [(await broker.pop_from(Q)) for _ in range(3)]
    assert [j.id for j in order] == ["job-3", "job-1", "job-2"]
    assert await broker.complete_job(order[0].lease, Q) is True
    answers = await broker.complete_many(Q, [j.lease for j in order])
    assert answers == [False, True, True]
    assert await broker.complete_many(Q, []) == []
    assert await broker.pop_from(Q) is None


#: Slack on an age measured on a real clock (the memory broker's virtual clock is exact): the
#: time the calls themselves take, on a loaded machine.
AGE_SLACK = 0.2


async def _age(broker: Any) -> float | None:
    age: float | None = (await broker.queue_stats(Q)).oldest_ready_age
    return age


def _about(age: float | None, expected: float) -> bool:
    return age is not None and expected - 1e-9 <= age < expected + AGE_SLACK


async def test_oldest_ready_age_counts_from_the_push_through_delays_retries_and_stalls(
    broker: Any, contract_clock: object
) -> None:
    """``QueueStats.oldest_ready_age``: seconds since the oldest READY job's push, which a
    delay, a retry or a reclaim does not reset (the memory broker's semantics, on every
    broker); a requeued failed job counts as pushed again."""
    assert await _age(broker) is None
    await broker.push_on(Q, job("a"), delay=0.6)  # t = 0
    assert await _age(broker) is None  # delayed, not ready
    await trio.sleep(0.3)
    await broker.push_on(Q, job("b"))  # t = 0.3
    await trio.sleep(0.1)
    assert _about(await _age(broker), 0.1)
    await trio.sleep(0.3)  # t = 0.7: a is due
    b = await broker.pop_from(Q)  # promotes a, claims b (pushed ready before a came due)
    assert b.id == "job-b"
    # a: since its push 0.7 s ago, not since it came due (0.1 s ago)
    assert _about(await _age(broker), 0.7)
    assert await broker.retry_job(b.lease, Q) is True
    a = await broker.pop_from(Q)
    assert a.id == "job-a"
    # b, retried: its first push (0.4 s ago) still counts
    assert _about(await _age(broker), 0.4)
    await trio.sleep(0.3)  # t = 1.0: a's claim goes silent, and is taken back
    assert (await broker.recover_stalled_jobs(Q, 0.2, 3)).recovered == 1
    assert _about(await _age(broker), 1.0)  # a again, reclaimed: as old as its push
    b = await broker.pop_from(Q)
    a = await broker.pop_from(Q)
    assert {b.id, a.id} == {"job-a", "job-b"}
    assert await broker.fail_job(a.lease, Q, "poison") is True
    assert await broker.complete_job(b.lease, Q) is True
    assert await _age(broker) is None
    await trio.sleep(0.3)
    assert await broker.requeue_failed(Q, a.id) is True
    assert _about(await _age(broker), 0.0)  # requeued: pushed again, now
    await broker.push_many(Q, [job("c")], [None])
    await trio.sleep(0.2)
    stats = await broker.queue_stats(Q)
    assert (stats.ready, stats.delayed, stats.claimed, stats.failed) == (2, 0, 0, 0)
    assert _about(stats.oldest_ready_age, 0.2)
