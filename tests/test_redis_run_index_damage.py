"""A Redis run store's index key of the wrong type (damaged data): every script that changes a
run (its start, its reopening, a claim, a renewal, a release, a settle) checks the keys it will
write before its first write, so a failure names the key and leaves the store as it was. Once
the key is deleted, the same call succeeds (before this, a start wrote the run's hash and then
failed, leaving a run pending with no lease entry: never claimed, and its retry answered
"exists"; a settle moved the run's hash on and left it in its old status index, or in none).

The real clock throughout, on a private redis-server.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import pytest

from _redis_server import *  # noqa: F403  (the fixtures; harmless once conftest imports them too)
from durable_trio._engine import RunRecord, RunStatus
from durable_trio._engine._stores._redis_scripts import REBUILD_BATCH
from durable_trio._engine._stores.redis import RedisRunStore
from durable_trio._redis import RedisReplyError, open_redis

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

pytestmark = pytest.mark.redis

_names = itertools.count(1)


async def _snapshot(client: Any, prefix: str) -> dict[bytes, bytes]:
    """Every key of the store's shard and its dump (what a script that failed must not move)."""
    keys = await client.execute("KEYS", f"{prefix}*")
    return {key: await client.execute("DUMP", key) for key in sorted(keys)}


async def _damage(client: Any, key: str) -> None:
    """``key`` made a string (no index is one)."""
    await client.execute("DEL", key)
    await client.execute("SET", key, "junk")


async def _refused_as_found(
    client: Any, prefix: str, key: str, change: Callable[[], Awaitable[object]]
) -> RedisReplyError:
    """``key`` damaged (:func:`_damage`), then ``change()``: it fails with ``WRONGTYPE`` and
    every key of the shard ``prefix`` is as it was before it. Returns the error."""
    await _damage(client, key)
    before = await _snapshot(client, prefix)
    with pytest.raises(RedisReplyError) as caught:
        await change()
    assert caught.value.code == "WRONGTYPE"
    assert await _snapshot(client, prefix) == before
    return caught.value


#: The index keys a start writes, by the part after the shard's prefix.
START_KEYS = [":all", ":status:pending", ":leases"]


@pytest.mark.parametrize("part", START_KEYS)
async def test_a_start_over_a_damaged_index_writes_nothing_and_works_once_it_is_gone(
    redis_url: str, part: str
) -> None:
    ns = f"idx{next(_names)}"
    prefix = f"{{dt-runs:{ns}}}"
    async with open_redis(redis_url) as client:
        store = RedisRunStore(client, ns)
        await store.create_run(RunRecord("old", "w", None, RunStatus.PENDING, 0, 0))
        error = await _refused_as_found(
            client, prefix, prefix + part,
            lambda: store.create_run(RunRecord("new", "w", None, RunStatus.PENDING, 0, 0)),
        )  # fmt: skip
        assert f"{prefix}{part} holds a string, not a zset" in str(error)
        assert "nothing was written" in str(error)
        assert await store.get_run("new") is None  # no hash: a retry creates it afresh

        await client.execute("DEL", prefix + part)
        created, fresh = await store.create_run(
            RunRecord("new", "w", None, RunStatus.PENDING, 0, 0)
        )
        assert fresh
        assert created.status is RunStatus.PENDING
        claimed = await store.claim_runs("owner", lease=10.0, limit=10)
        assert "new" in {run.run_id for run in claimed}


async def test_a_reopening_over_a_damaged_index_writes_nothing_and_works_once_it_is_gone(
    redis_url: str,
) -> None:
    # A failed run reopened (``runs retry``) over a ``:leases`` of the wrong type: before,
    # its hash said pending with no lease entry left for an engine to claim it by.
    ns = f"idx{next(_names)}"
    prefix = f"{{dt-runs:{ns}}}"
    async with open_redis(redis_url) as client:
        store = RedisRunStore(client, ns)
        await store.create_run(RunRecord("r", "w", None, RunStatus.PENDING, 0, 0))
        [claimed] = await store.claim_runs("owner", lease=10.0, limit=10)
        assert await store.finish_run("r", RunStatus.FAILED, error={"message": "boom"})
        error = await _refused_as_found(
            client, prefix, prefix + ":leases", lambda: store.reopen_run("r", [], run_timeout=None)
        )
        assert "holds a string, not a zset" in str(error)

        await client.execute("DEL", prefix + ":leases")
        assert await store.reopen_run("r", [], run_timeout=None)
        [again] = await store.claim_runs("owner", lease=10.0, limit=10)
        assert again.run_id == claimed.run_id == "r"


async def _store_with_claimed_run(client: Any, ns: str) -> RedisRunStore:
    """A store of ``ns`` whose run "r" (workflow "w") an engine "owner" holds."""
    store = RedisRunStore(client, ns)
    await store.create_run(RunRecord("r", "w", None, RunStatus.PENDING, 0, 0))
    [claimed] = await store.claim_runs("owner", lease=10.0, limit=10)
    assert claimed.run_id == "r"
    return store


#: The keys a settle of a running run writes (completed: its end indexed for retention, its
#: cancel mark dropped from its steps), by the part after the shard's prefix, and their kind.
SETTLE_KEYS = [
    (":status:running", "zset"),
    (":status:completed", "zset"),
    (":leases", "zset"),
    (":owned:owner", "set"),
    (":ended:w", "zset"),
    (":ended-workflows", "set"),
    (":steps:r", "zset"),
]


@pytest.mark.parametrize(("part", "kind"), SETTLE_KEYS)
async def test_a_settle_over_a_damaged_index_writes_nothing_and_works_once_it_is_gone(
    redis_url: str, part: str, kind: str
) -> None:
    # Before, the run's hash said completed while a key after it failed: the run stayed in
    # the running index (listed as running for ever), or left out of its end's index (never
    # pruned), as far as the script had come.
    ns = f"idx{next(_names)}"
    prefix = f"{{dt-runs:{ns}}}"
    async with open_redis(redis_url) as client:
        store = await _store_with_claimed_run(client, ns)
        key = prefix + part
        if part == ":steps:r":
            key = store._steps_key("r")
        error = await _refused_as_found(
            client, prefix, key, lambda: store.finish_run("r", RunStatus.COMPLETED, output=1)
        )
        assert f"{key} holds a string, not a {kind}" in str(error)
        run = await store.get_run("r")
        assert run is not None
        assert run.status is RunStatus.RUNNING

        await client.execute("DEL", key)
        assert await store.finish_run("r", RunStatus.COMPLETED, output=1)
        run = await store.get_run("r")
        assert run is not None
        assert run.status is RunStatus.COMPLETED
        assert [r.run_id for r in await store.list_runs(status=RunStatus.COMPLETED)] == ["r"]
        assert await store.list_runs(status=RunStatus.RUNNING) == []


@pytest.mark.parametrize("part", [":status:pending", ":status:running", ":owned:owner"])
async def test_a_claim_over_a_damaged_index_writes_nothing_and_works_once_it_is_gone(
    redis_url: str, part: str
) -> None:
    ns = f"idx{next(_names)}"
    prefix = f"{{dt-runs:{ns}}}"
    async with open_redis(redis_url) as client:
        store = RedisRunStore(client, ns)
        for run_id in ("a", "b"):
            await store.create_run(RunRecord(run_id, "w", None, RunStatus.PENDING, 0, 0))
        error = await _refused_as_found(
            client, prefix, prefix + part,
            lambda: store.claim_runs("owner", lease=10.0, limit=10),
        )  # fmt: skip
        assert "holds a string, not a" in str(error)

        await client.execute("DEL", prefix + part)
        claimed = await store.claim_runs("owner", lease=10.0, limit=10)
        assert sorted(run.run_id for run in claimed) == ["a", "b"]
        running = await store.list_runs(status=RunStatus.RUNNING)
        assert sorted(run.run_id for run in running) == ["a", "b"]


@pytest.mark.parametrize("part", [":status:pending", ":leases", ":owned:owner"])
async def test_a_release_over_a_damaged_index_writes_nothing_and_works_once_it_is_gone(
    redis_url: str, part: str
) -> None:
    ns = f"idx{next(_names)}"
    prefix = f"{{dt-runs:{ns}}}"
    async with open_redis(redis_url) as client:
        store = await _store_with_claimed_run(client, ns)
        error = await _refused_as_found(
            client, prefix, prefix + part, lambda: store.release_runs("owner", ["r"])
        )
        assert "holds a string, not a" in str(error)

        await client.execute("DEL", prefix + part)
        await store.release_runs("owner", ["r"])
        run = await store.get_run("r")
        assert run is not None
        assert run.status is RunStatus.PENDING
        [again] = await store.claim_runs("other", lease=10.0, limit=10)
        assert again.run_id == "r"


async def test_a_renewal_over_a_damaged_lease_index_writes_nothing(redis_url: str) -> None:
    ns = f"idx{next(_names)}"
    prefix = f"{{dt-runs:{ns}}}"
    async with open_redis(redis_url) as client:
        store = await _store_with_claimed_run(client, ns)
        error = await _refused_as_found(
            client, prefix, prefix + ":leases",
            lambda: store.renew_runs("owner", ["r"], lease=30.0),
        )  # fmt: skip
        assert "leases holds a string, not a zset" in str(error)

        await client.execute("DEL", prefix + ":leases")
        assert await store.renew_runs("owner", ["r"], lease=30.0) == {"r"}


async def test_a_lost_lease_index_is_rebuilt_by_the_next_claim(redis_url: str) -> None:
    # Every unfinished run has an entry in ``:leases``, which is all an orphan claim reads:
    # with the key deleted (an operator's mistake, a bad restore), a run whose engine died was
    # never claimed again and waited for ever. The next claim sees fewer entries than
    # unfinished runs and puts each missing one back, with its stored lease.
    ns = f"idx{next(_names)}"
    prefix = f"{{dt-runs:{ns}}}"
    async with open_redis(redis_url) as client:
        store = RedisRunStore(client, ns)
        for run_id in ("dead", "live", "waiting"):
            await store.create_run(RunRecord(run_id, "w", None, RunStatus.PENDING, 0, 0))
        claimed = await store.claim_runs("gone", lease=10.0, limit=2)  # (oldest first)
        assert sorted(run.run_id for run in claimed) == ["dead", "live"]
        assert await store.renew_runs("gone", ["live"], lease=3600.0) == {"live"}
        live_until = float(await client.execute("ZSCORE", f"{prefix}:leases", "live"))
        # "dead"'s lease ends in 10 s and is never renewed; "waiting" is unowned.
        await client.execute("ZADD", f"{prefix}:leases", 0, "dead")  # (its lease has passed)
        await client.execute("HSET", f"{prefix}:run:dead", "lease", "1")

        await client.execute("DEL", f"{prefix}:leases")
        claimed = await store.claim_runs("next", lease=10.0, limit=10)
        assert sorted(run.run_id for run in claimed) == ["dead", "waiting"]
        # The live engine's run is indexed again under its own lease (as its hash keeps it:
        # 14 digits, Lua's), and still its.
        stored = float(await client.execute("HGET", f"{prefix}:run:live", "lease"))
        rebuilt = float(await client.execute("ZSCORE", f"{prefix}:leases", "live"))
        assert rebuilt == stored == pytest.approx(live_until, abs=1e-3)
        live = await store.get_run("live")
        assert live is not None
        assert live.owner == "gone"
        assert await client.execute("ZCARD", f"{prefix}:leases") == 3


async def test_a_stale_status_entry_is_dropped_when_the_lease_index_is_rebuilt(
    redis_url: str,
) -> None:
    # The rebuild makes the counts agree, so the next claims do not scan again: an entry of
    # an unfinished status index whose run is gone, or finished, is dropped; one whose run is
    # unfinished under the other status is moved there.
    ns = f"idx{next(_names)}"
    prefix = f"{{dt-runs:{ns}}}"
    async with open_redis(redis_url) as client:
        store = RedisRunStore(client, ns)
        for run_id in ("ended", "moved", "kept"):
            await store.create_run(RunRecord(run_id, "w", None, RunStatus.PENDING, 0, 0))
        [ended] = await store.claim_runs("gone", lease=10.0, limit=1)
        assert await store.finish_run(ended.run_id, RunStatus.COMPLETED, output=1)
        await client.execute("ZADD", f"{prefix}:status:pending", 1, "ended")  # stale
        await client.execute("ZADD", f"{prefix}:status:pending", 9, "ghost")  # no run at all
        await client.execute("HSET", f"{prefix}:run:moved", "status", "running")
        await client.execute("DEL", f"{prefix}:leases")

        claimed = await store.claim_runs("next", lease=10.0, limit=10)
        assert sorted(run.run_id for run in claimed) == ["kept", "moved"]
        assert await client.execute("ZRANGE", f"{prefix}:status:pending", 0, -1) == []
        assert sorted(await client.execute("ZRANGE", f"{prefix}:status:running", 0, -1)) == [
            b"kept",
            b"moved",
        ]
        assert await client.execute("ZCARD", f"{prefix}:leases") == 2


async def test_a_lost_lease_index_is_rebuilt_a_batch_a_call(redis_url: str) -> None:
    # The walk is bounded (REBUILD_BATCH entries a script call, so the server is never held
    # long), keeps its place in ``:leases-rebuild``, and goes on at the next call: within the
    # same claim while it claimed fewer runs than asked, else at the next claim.
    ns = f"idx{next(_names)}"
    prefix = f"{{dt-runs:{ns}}}"
    total = REBUILD_BATCH + 500
    async with open_redis(redis_url) as client:
        store = RedisRunStore(client, ns)
        for n in range(total):
            await store.create_run(RunRecord(f"r{n}", "w", None, RunStatus.PENDING, 0, 0))
        await client.execute("DEL", f"{prefix}:leases")

        first = await store.claim_runs("next", lease=10.0, limit=10)
        assert len(first) == 10  # claimed from the first batch put back: the walk waits
        assert await client.execute("ZCARD", f"{prefix}:leases") == REBUILD_BATCH
        place = await client.execute("GET", f"{prefix}:leases-rebuild")
        assert place == f"pending {REBUILD_BATCH}".encode()  # (the last seq walked)

        second = await store.claim_runs("next", lease=10.0, limit=total)
        assert len(second) == total - 10
        assert await client.execute("EXISTS", f"{prefix}:leases-rebuild") == 0
        assert await client.execute("ZCARD", f"{prefix}:leases") == total
