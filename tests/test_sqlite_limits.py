"""The SQLite broker's fleet-wide limits beyond the contract (tests/test_broker_limits.py):
an older file gains the key column and the limits table on open, and two processes' brokers
on one file share one limit, a freed slot waking the other's waiter."""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING

import trio

from durable_trio.brokers import Job
from durable_trio.brokers.sqlite import SqliteBroker

if TYPE_CHECKING:
    from pathlib import Path

Q = "t:tasks:sqlite-limits"


def job(n: int | str, key: str | None = None) -> Job:
    return Job(f"job-{n}", f'{{"n":"{n}"}}'.encode(), key)


def _columns(path: Path) -> list[str]:
    db = sqlite3.connect(path, isolation_level=None)
    try:
        return [str(row[1]) for row in db.execute("PRAGMA table_info(dt_jobs)")]
    finally:
        db.close()


async def test_a_file_from_before_limits_gets_its_key_column_and_limits_table(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.db"
    async with await SqliteBroker.open(path) as broker:
        await broker.push_on(Q, job("old"))

    def back_to_the_old_schema() -> None:
        db = sqlite3.connect(path, isolation_level=None)
        try:
            db.execute("DROP INDEX dt_jobs_active_key")
            db.execute("ALTER TABLE dt_jobs DROP COLUMN ckey")
            db.execute("DROP TABLE dt_limits")
        finally:
            db.close()

    await trio.to_thread.run_sync(back_to_the_old_schema)
    assert "ckey" not in _columns(path)
    async with await SqliteBroker.open(path) as broker, await SqliteBroker.open(path):
        assert _columns(path).count("ckey") == 1
        await broker.set_queue_limit(Q, 1, per_key=True)
        await broker.push_on(Q, job("new", None))  # the old job and this one: key ""
        await broker.push_on(Q, job("keyed", "k"))
        claims = await broker.pop_many(Q, 5)
        assert [c.id for c in claims] == ["job-old", "job-keyed"]
        assert await broker.complete_job(claims[0].lease, Q)
        assert [c.id for c in await broker.pop_many(Q, 5)] == ["job-new"]


async def test_two_brokers_on_one_file_share_the_limit_and_wake_on_a_freed_slot(
    tmp_path: Path,
) -> None:
    path = tmp_path / "shared.db"
    async with (
        await SqliteBroker.open(path, wakeup_interval=0.05, doorbell=False) as one,
        await SqliteBroker.open(path, wakeup_interval=0.05, doorbell=False) as two,
    ):
        await one.set_queue_limit(Q, 2)
        for n in range(4):
            await two.push_on(Q, job(n))
        held = await one.pop_many(Q, 1) + await two.pop_many(Q, 4)
        assert [c.id for c in held] == ["job-0", "job-1"]
        assert await two.pop_many(Q, 4) == []
        stats = await two.queue_stats(Q)
        assert (stats.limit, stats.claimed, stats.ready) == (2, 2, 2)
        woke: list[float] = []

        async def waiter() -> None:
            await two.wait_for_work(Q)
            woke.append(trio.current_time())

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                await trio.sleep(0.3)
                assert woke == []  # at the limit: it waits
                freed = trio.current_time()
                assert await one.complete_job(held[0].lease, Q)
        assert woke[0] - freed < 0.5  # the other broker's tick saw the commit
        assert [c.id for c in await two.pop_many(Q, 4)] == ["job-2"]
