"""Claims popped ahead of a free slot (``SupportsClaimAhead``, brokers/_contract.py) on every
broker (parametrized in conftest.py): a claim that never started is taken back by the sweep
(T9 of docs/spec.md) at once but uncounted, and its stall history says so.

Durations are short and real on brokers whose clock is a server's; on the memory broker the
same tests run under a virtual clock (``contract_clock``, as in test_broker_contract.py).
"""

from __future__ import annotations

from typing import Any

import trio

from durable_trio.brokers import Job, SupportsClaimAhead

Q = "t:tasks:ahead"


def job(n: int | str) -> Job:
    return Job(f"job-{n}", f'{{"n":"{n}"}}'.encode())


async def test_every_broker_can_claim_ahead(broker: Any, contract_clock: object) -> None:
    assert isinstance(broker, SupportsClaimAhead)


async def test_pop_ahead_claims_count_plus_ahead_in_pop_order(
    broker: Any, contract_clock: object
) -> None:
    for n in range(5):
        await broker.push_on(Q, job(n))
    claimed = await broker.pop_ahead(Q, 1, 2, worker="w")
    assert [c.id for c in claimed] == ["job-0", "job-1", "job-2"]
    assert [c.id for c in await broker.pop_ahead(Q, 1, 5, worker="w")] == ["job-3", "job-4"]
    assert await broker.pop_ahead(Q, 1, 1) == []


async def test_a_claim_that_never_started_comes_back_uncounted(
    broker: Any, contract_clock: object
) -> None:
    """The started claim counts its stall (and is exceeded at max_stalled 0); the two popped
    ahead come back to ready at once, their count unchanged, their stall recorded as not
    counted, under the holder's plain worker name."""
    for n in range(3):
        await broker.push_on(Q, job(n))
    started, *ahead = await broker.pop_ahead(Q, 1, 2, worker="w-dead")
    await trio.sleep(0.3)
    recovery = await broker.recover_stalled_jobs(Q, 0.2, 0)
    assert recovery.recovered == 2
    (poison,) = recovery.exceeded
    assert poison.id == started.id
    assert poison.stalled_count == 1
    assert [(s.worker, s.counted) for s in poison.stalls] == [("w-dead", True)]
    for lost in ahead:
        assert await broker.complete_job(lost.lease, Q) is False  # the old lease is dead
    back = await broker.pop_many(Q, 5, worker="w2")
    assert [b.id for b in back] == [a.id for a in ahead]  # (each kept its place)
    for b in back:
        assert b.stalled_count == 0
        assert [(s.worker, s.counted) for s in b.stalls] == [("w-dead", False)]
    # the evidence survives a fail: the failed set keeps the flag
    assert await broker.fail_job(back[0].lease, Q, "set aside") is True
    (failed,) = await broker.failed_jobs(Q)
    assert failed.stalled_count == 0
    assert [(s.worker, s.counted) for s in failed.stalls] == [("w-dead", False)]


async def test_a_claim_marked_started_counts_its_stall(broker: Any, contract_clock: object) -> None:
    for n in range(2):
        await broker.push_on(Q, job(n))
    first, second = await broker.pop_ahead(Q, 0, 2, worker="w")
    assert await broker.mark_started(Q, [second.lease]) == [True]
    await trio.sleep(0.3)
    recovery = await broker.recover_stalled_jobs(Q, 0.2, 5)
    assert recovery.recovered == 2
    back = {b.id: b for b in await broker.pop_many(Q, 5)}
    assert back[first.id].stalled_count == 0
    assert [s.counted for s in back[first.id].stalls] == [False]
    assert back[second.id].stalled_count == 1
    assert [s.counted for s in back[second.id].stalls] == [True]
    # a lost lease cannot be marked
    assert await broker.mark_started(Q, [first.lease, second.lease]) == [False, False]


async def test_mark_started_renews_the_claim(broker: Any, contract_clock: object) -> None:
    await broker.push_on(Q, job("x"))
    (claim,) = await broker.pop_ahead(Q, 0, 1)
    await trio.sleep(0.3)
    assert await broker.mark_started(Q, [claim.lease]) == [True]
    recovery = await broker.recover_stalled_jobs(Q, 0.2, 5)
    assert (recovery.recovered, recovery.exceeded) == (0, ())
    assert await broker.complete_job(claim.lease, Q) is True


async def test_plain_pops_are_started_by_definition(broker: Any, contract_clock: object) -> None:
    """The default path (``pop_from``/``pop_many``) stores nothing more: every claim counts."""
    for n in range(2):
        await broker.push_on(Q, job(n))
    one = await broker.pop_from(Q, worker="a")
    (two,) = await broker.pop_many(Q, 1, worker="b")
    await trio.sleep(0.3)
    assert (await broker.recover_stalled_jobs(Q, 0.2, 5)).recovered == 2
    back = {b.id: b for b in await broker.pop_many(Q, 5)}
    assert [(s.worker, s.counted) for s in back[one.id].stalls] == [("a", True)]
    assert [(s.worker, s.counted) for s in back[two.id].stalls] == [("b", True)]
    assert all(b.stalled_count == 1 for b in back.values())


async def test_a_suspect_is_handed_over_not_started_by_every_pop(
    broker: Any, contract_clock: object
) -> None:
    """A job that stalled before while its handler ran (a suspect) comes back from a plain pop
    with ``started=False``: should its worker die before it marks it started (it waits to run
    alone), the stall is not counted; once marked, it is."""
    await broker.push_on(Q, job("suspect"))
    first = await broker.pop_from(Q, worker="w-ran")
    assert first is not None
    assert first.started
    await trio.sleep(0.3)
    assert (await broker.recover_stalled_jobs(Q, 0.2, 5)).recovered == 1
    for pop in ("pop_from", "pop_many", "pop_ahead"):
        if pop == "pop_from":
            claim = await broker.pop_from(Q, worker="w-waited")
        elif pop == "pop_many":
            (claim,) = await broker.pop_many(Q, 1, worker="w-waited")
        else:
            (claim,) = await broker.pop_ahead(Q, 1, 0, worker="w-waited")
        assert claim is not None
        assert (claim.stalled_count, claim.started) == (1, False), pop
        await trio.sleep(0.3)
        assert (await broker.recover_stalled_jobs(Q, 0.2, 5)).recovered == 1
    claim = await broker.pop_from(Q, worker="w-alone")
    assert claim is not None
    assert (claim.stalled_count, claim.started) == (1, False)
    assert await broker.mark_started(Q, [claim.lease]) == [True]
    await trio.sleep(0.3)
    assert (await broker.recover_stalled_jobs(Q, 0.2, 5)).recovered == 1
    (back,) = await broker.pop_many(Q, 1)
    assert back.stalled_count == 2
    assert [(s.worker, s.counted) for s in back.stalls] == [
        ("w-ran", True),
        ("w-waited", False),
        ("w-waited", False),
        ("w-waited", False),
        ("w-alone", True),
    ]


async def test_an_uncounted_stall_never_makes_a_job_exceed(
    broker: Any, contract_clock: object
) -> None:
    """A job popped ahead and dropped by one dead worker after another is never poison."""
    await broker.push_on(Q, job("innocent"))
    for round_ in range(4):
        (claim,) = await broker.pop_ahead(Q, 0, 1, worker=f"w{round_}")
        assert claim.stalled_count == 0
        await trio.sleep(0.3)
        recovery = await broker.recover_stalled_jobs(Q, 0.2, 1)
        assert (recovery.recovered, recovery.exceeded) == (1, ())
    (back,) = await broker.pop_many(Q, 1)
    assert back.stalled_count == 0
    assert [s.counted for s in back.stalls] == [False] * 4


def test_stored_stall_histories_read_the_counted_flag_and_refuse_junk() -> None:
    """Damaged stored data: the stored forms of an uncounted stall read back as such, an old
    history (no flag) reads as counted, and a flag of any other shape makes the history
    unreadable (the claim is then flagged damaged and set aside, as before)."""
    from durable_trio.brokers.redis._replies import read_stalls
    from durable_trio.brokers.sqlite._rows import parse_stalls as _parse_stalls
    from durable_trio.brokers.sqlite._rows import stalls_json as _stalls_json

    assert [(s.worker, s.counted) for s in read_stalls(b'[[1.5,"a"],[2.5,"b",0]]') or ()] == [
        ("a", True),
        ("b", False),
    ]
    for junk in (b'[[1.5,"a",1]]', b'[[1.5,"a",false]]', b'[[1.5,"a",0,0]]'):
        assert read_stalls(junk) is None
    history = _parse_stalls(
        '[{"at": 1.5, "worker": "a"}, {"at": 2.5, "worker": "b", "counted": false}]'
    )
    assert history is not None
    assert [(s.worker, s.counted) for s in history] == [("a", True), ("b", False)]
    assert _parse_stalls(_stalls_json(history)) == history
    assert _parse_stalls('[{"at": 1.5, "worker": "a", "counted": 0}]') is None
