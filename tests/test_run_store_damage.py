"""Damaged rows in the run stores (SQLite, PostgreSQL, and a Redis run hash) and the
PostgreSQL key store: set aside or reported, and no loop dies (issue 32, item 6 "Failure").

The damage is written with raw SQL on a connection of the test's own, as an operator's mistake
or a bad restore would leave it. A run whose row cannot be read (a column that is not JSON) is
set aside when an engine claims it: failed with :class:`~durable_trio.RunDataError`, never
driven, and the runs claimed beside it are driven; a run with a damaged checkpoint is failed
the same way when it is adopted (and the error reported). The key store's values are opaque to
it: their readers treat a value they cannot read as absent.
"""

from __future__ import annotations

import sqlite3
import uuid
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from _every_store import STORED_KINDS, stored_url
from _pg_fault_process import NAMESPACE, app, expected
from durable_trio._engine import open_engine, open_worker
from durable_trio._postgres import open_pool
from helpers import Errors

if TYPE_CHECKING:
    from pathlib import Path

GOOD = 5


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgres":
        return f"{request.getfixturevalue('postgres_url')}?schema=d_{uuid.uuid4().hex[:12]}"
    return "sqlite:///" + str(tmp_path / "runs.db")


async def _sql(url: str, statement: str, *params: Any) -> list[tuple[Any, ...]]:
    """One statement (``$1`` parameters) on a connection of the test's own; ``{runs}`` and
    ``{steps}`` name the run store's tables."""
    if url.startswith("sqlite:"):
        statement = statement.format(
            runs="dt_runs", steps="dt_steps", debounced="dt_debounced"
        ).replace("$", "?")
        db = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        try:
            return db.execute(statement, params).fetchall()
        finally:
            db.close()
    base, schema = url.split("?schema=")
    statement = statement.format(
        runs=f'"{schema}".runs',
        steps=f'"{schema}".run_steps',
        debounced=f'"{schema}".run_debounced',
    )
    async with open_pool(base, size=1) as pool:
        return await pool.fetch(statement, *params)


@pytest.mark.parametrize(
    "checkpoint_damage",
    [
        pytest.param("output = '{{garbage'", id="output-not-json"),
        # (attempts count from 1: below, every result was stale and the run waited for ever)
        pytest.param("attempt = 0", id="attempt-zero"),
        # (SQLite keeps the text; PostgreSQL's double precision reads it as NaN: no number)
        pytest.param("created_at = 'NaN'", id="created-nan"),
    ],
)
async def test_a_damaged_run_or_checkpoint_is_set_aside_and_the_others_run(
    store_url: str, checkpoint_damage: str
) -> None:
    url = store_url
    errors = Errors()
    async with dt.open_backend(url) as backend:
        # A run that went through its steps, whose engine then died (an orphan mid-run).
        async with open_worker(app, backend, namespace=NAMESPACE), open_engine(
            app, backend, namespace=NAMESPACE
        ) as engine:  # fmt: skip
            assert await engine.result(await engine.start("chain", 1, run_id="bad-step")) == 4
        # Runs started and not yet taken by any engine.
        async with open_engine(app, backend, namespace=NAMESPACE, reconcile=False) as caller:
            for n in range(GOOD):
                await caller.start("chain", n, run_id=f"good-{n}", detach=True)
            await caller.start("chain", 9, run_id="bad-input", detach=True)
    await _sql(url, f"UPDATE {{steps}} SET {checkpoint_damage} WHERE run_id = 'bad-step'")
    await _sql(
        url,
        "UPDATE {runs} SET status = 'running', owner = NULL, lease_until = NULL, "
        "output = 'null' WHERE run_id = 'bad-step'",
    )
    await _sql(url, "UPDATE {runs} SET input = '[1, 2' WHERE run_id = 'bad-input'")
    async with dt.open_backend(url) as backend:
        async with open_worker(app, backend, namespace=NAMESPACE), open_engine(
            app, backend, namespace=NAMESPACE, on_error=errors, reconcile_interval=0.5
        ) as engine:  # fmt: skip
            with trio.fail_after(30):
                outputs = {n: await engine.result(f"good-{n}") for n in range(GOOD)}
                assert outputs == {n: expected(n) for n in range(GOOD)}
                # The loops live on: a run started now completes.
                assert await engine.result(await engine.start("chain", 50)) == expected(50)
            with pytest.raises(dt.RunFailed, match=r"checkpoint .* cannot be read"):
                await engine.result("bad-step")
            # Its row cannot be read: a clear error, a BrokerError (loops report and go on).
            with pytest.raises(dt.RunDataError, match="run 'bad-input'"):
                await engine.result("bad-input")
    ((status, error),) = await _sql(
        url, "SELECT status, error FROM {runs} WHERE run_id = 'bad-input'"
    )
    assert status == "failed"
    assert "RunDataError" in error
    assert any(isinstance(e, dt.RunDataError) for e in errors.seen), errors.messages()


@pytest.fixture(params=STORED_KINDS)
def debounce_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return stored_url(request, tmp_path, "d_")


async def _damage_debounced(url: str, run_id: str) -> None:
    """The stored input of the debounced start that is to create ``run_id``: not JSON."""
    if not url.startswith("redis"):
        await _sql(url, "UPDATE {debounced} SET input = '{{garbage' WHERE run_id = $1", run_id)
        return
    from durable_trio._redis import open_redis

    async with open_redis(url) as client:
        keys = [k for k in await client.execute("KEYS", "*:debounce:*") if b"-" not in k[-4:]]
        rows = [k for k in keys if await client.execute("HGET", k, "run_id") == run_id.encode()]
        assert len(rows) == 1, keys
        assert await client.execute("HSET", rows[0], "input", b"{garbage") == 0


async def test_a_damaged_debounced_start_is_set_aside_and_the_engine_goes_on(
    debounce_url: str,
) -> None:
    """A debounced start whose stored input is not JSON, when it falls due: its run is made
    and set aside (failed with :class:`~durable_trio.RunDataError`) when claimed, as any
    damaged row; the starts due beside it run. On SQLite and PostgreSQL the engine's start
    loop read the input with a bare ``orjson.loads``: the JSONDecodeError ended the engine."""
    url, errors = debounce_url, Errors()
    async with dt.open_backend(url) as backend:
        async with open_engine(app, backend, namespace=NAMESPACE, reconcile=False) as caller:
            ids = {
                n: await caller.start("chain", n, debounce=dt.Debounce(key=f"k{n}", delay=2))
                for n in range(GOOD + 1)
            }
    bad = ids.pop(GOOD)
    await _damage_debounced(url, bad)
    async with dt.open_backend(url) as backend:
        async with open_worker(app, backend, namespace=NAMESPACE), open_engine(
            app, backend, namespace=NAMESPACE, on_error=errors, reconcile_interval=0.5
        ) as engine:  # fmt: skip
            with trio.fail_after(30):
                outputs = {n: await engine.result(run_id) for n, run_id in ids.items()}
                assert outputs == {n: expected(n) for n in range(GOOD)}
                with pytest.raises(dt.RunDataError, match=f"run '{bad}'"):
                    await engine.result(bad)
                # The loops live on: a debounced start made now runs.
                later = await engine.start("chain", 50, debounce=dt.Debounce(key="x", delay=0.1))
                assert await engine.result(later) == expected(50)
            assert (await engine.get(later)).status is dt.RunStatus.COMPLETED


async def test_damaged_tags_stop_no_prune_and_leave_no_tag_behind(store_url: str) -> None:
    """A finished run whose stored tags are damaged (not JSON, not an object, a ``\\u0000``
    PostgreSQL's jsonb refuses) is pruned with the others: one such row once failed every
    prune on PostgreSQL. A tag index row it leaves names its old incarnation only: the id
    started again without tags is not listed under the old tag."""
    damage = ["not json", "[1, 2]", '{"k": "a\\u0000b"}', '"text"']
    async with dt.open_backend(url := store_url) as backend:
        async with open_worker(app, backend, namespace=NAMESPACE), open_engine(
            app, backend, namespace=NAMESPACE
        ) as engine:  # fmt: skip
            for n in range(GOOD + len(damage)):
                run_id = await engine.start("chain", n, run_id=f"t{n}", tags={"k": f"v{n}"})
                await engine.result(run_id)
    for n, stored in enumerate(damage, start=GOOD):
        await _sql(url, f"UPDATE {{runs}} SET tags = $1 WHERE run_id = 't{n}'", stored)
    await trio.sleep(0.05)
    async with dt.open_backend(url) as backend:
        async with dt.open_operations(backend, namespace=NAMESPACE) as ops:
            report = await ops.prune_runs(0.01)
            assert report.count == GOOD + len(damage)
            assert (await ops.list_runs()).runs == []
            async with open_worker(app, backend, namespace=NAMESPACE), open_engine(
                app, backend, namespace=NAMESPACE
            ) as engine:  # fmt: skip
                again = f"t{GOOD}"
                assert await engine.result(await engine.start("chain", 1, run_id=again)) == 4
            for n in range(GOOD + len(damage)):
                assert (await ops.list_runs(tags={"k": f"v{n}"})).runs == [], n
            assert [r.run_id for r in (await ops.list_runs()).runs] == [again]


@pytest.mark.postgres
async def test_damaged_worker_keys_are_read_as_absent(postgres_url: str) -> None:
    """Every live key copied under a longer name with a value that is no key's and a ``NaN``
    expiry, every live value overwritten with garbage: the copies are expired, and the engine,
    the worker and the operations' reads carry on."""
    schema = f"d_{uuid.uuid4().hex[:12]}"
    url = f"{postgres_url}?schema={schema}"
    errors = Errors()
    async with (
        dt.open_backend(url) as backend,
        open_worker(app, backend, namespace=NAMESPACE, on_error=errors),
        open_engine(app, backend, namespace=NAMESPACE, on_error=errors) as engine,
    ):
        assert await engine.result(await engine.start("chain", 1)) == expected(1)
        async with open_pool(postgres_url, size=1) as pool:
            copied = await pool.fetch(
                f'INSERT INTO "{schema}".worker_keys (key, value, expires_at) '
                "SELECT key || suffix, $1, 'NaN' FROM "
                f"\"{schema}\".worker_keys, unnest(ARRAY['', 'x', ':x']) AS suffix "
                "WHERE suffix <> '' ON CONFLICT DO NOTHING RETURNING key",
                b"\xff\x00{not json",
            )
            await pool.execute(
                f'UPDATE "{schema}".worker_keys SET value = $1 WHERE key NOT LIKE $2',
                b"\xfe garbage",
                "%x",
            )
        assert copied
        # a NaN expiry is expired (PostgreSQL orders NaN above every number): never listed
        assert backend.keys is not None
        listed = {entry.key for entry in await backend.keys.entries("")}
        assert not listed & {key for (key,) in copied}
        with trio.fail_after(30):
            for n in range(5):
                assert await engine.result(await engine.start("chain", n)) == expected(n)
            async with dt.open_operations(backend, namespace=NAMESPACE) as ops:
                # (the live keys read as absent until their owners write them again)
                await ops.workers()
                assert {e.engine_id for e in await ops.engines()} <= {engine.engine_id}


@pytest.mark.redis
async def test_a_damaged_redis_run_hash_is_set_aside_and_the_others_run(redis_url: str) -> None:
    """The Redis run store as the SQL ones: a run hash that cannot be read (its input not
    JSON) is set aside when claimed, failed with :class:`~durable_trio.RunDataError`, and the
    runs claimed beside it are driven; reading it raises that error."""
    from durable_trio._engine import open_run_store
    from durable_trio._engine._stores.redis import RedisRunStore
    from durable_trio._redis import open_redis

    errors = Errors()
    async with dt.open_backend(redis_url) as backend:
        async with open_engine(app, backend, namespace=NAMESPACE, reconcile=False) as caller:
            for n in range(GOOD):
                await caller.start("chain", n, run_id=f"good-{n}", detach=True)
            await caller.start("chain", 9, run_id="bad-input", detach=True)
        async with open_run_store(backend, NAMESPACE) as store:
            assert isinstance(store, RedisRunStore)
            key = store._run_key("bad-input")
    async with open_redis(redis_url) as client:
        assert await client.execute("HSET", key, "input", b"[1, 2") == 0
    async with dt.open_backend(redis_url) as backend:
        async with open_worker(app, backend, namespace=NAMESPACE), open_engine(
            app, backend, namespace=NAMESPACE, on_error=errors, reconcile_interval=0.5
        ) as engine:  # fmt: skip
            with trio.fail_after(30):
                outputs = {n: await engine.result(f"good-{n}") for n in range(GOOD)}
                assert outputs == {n: expected(n) for n in range(GOOD)}
                assert await engine.result(await engine.start("chain", 50)) == expected(50)
            with pytest.raises(dt.RunDataError, match="run 'bad-input'"):
                await engine.result("bad-input")
        async with open_redis(redis_url) as client:
            assert await client.execute("HGET", key, "status") == b"failed"
            error = await client.execute("HGET", key, "error")
            assert b"RunDataError" in error


async def test_a_redis_run_with_damaged_tags_is_pruned_and_not_listed_under_them(
    redis_url: str,
) -> None:
    """The Redis run store as the SQL ones: a finished run whose tags field is damaged is
    pruned, and the id started again without tags is not listed under its old tag (the tag
    index entry the prune could not find names the earlier run's seq)."""
    from durable_trio._engine import open_run_store
    from durable_trio._redis import open_redis

    async with dt.open_backend(redis_url) as backend:
        async with open_worker(app, backend, namespace=NAMESPACE), open_engine(
            app, backend, namespace=NAMESPACE
        ) as engine:  # fmt: skip
            await engine.result(await engine.start("chain", 1, run_id="t", tags={"k": "v"}))
        async with open_run_store(backend, NAMESPACE) as store:
            key = store._run_key("t")  # type: ignore[attr-defined]
    async with open_redis(redis_url) as client:
        assert await client.execute("HSET", key, "tags", b"not json") == 0
    await trio.sleep(0.05)
    async with dt.open_backend(redis_url) as backend:
        async with dt.open_operations(backend, namespace=NAMESPACE) as ops:
            assert (await ops.prune_runs(0.01)).count == 1
            async with open_worker(app, backend, namespace=NAMESPACE), open_engine(
                app, backend, namespace=NAMESPACE
            ) as engine:  # fmt: skip
                assert await engine.result(await engine.start("chain", 1, run_id="t")) == 4
            assert (await ops.list_runs(tags={"k": "v"})).runs == []
            assert [r.run_id for r in (await ops.list_runs()).runs] == ["t"]


@pytest.mark.redis
@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        pytest.param("attempt", "0", "attempt 0 is below 1", id="attempt-zero"),
        pytest.param("created", "nan", "'nan' is not a number", id="created-nan"),
        pytest.param("wake_at", "nan", "'nan' is not a number", id="wake-at-nan"),
    ],
)
async def test_a_redis_checkpoint_whose_attempt_or_time_is_no_such_thing_cannot_be_read(
    redis_url: str, field: str, value: str, said: str
) -> None:
    """A step hash whose ``attempt`` is below 1 (attempts count from 1), or whose time is
    ``nan`` (which ``float`` reads), is a :class:`~durable_trio.RunDataError` naming it, as on
    the SQL stores (whose engine test is above), so an engine adopting its run sets the run
    aside: before, it took every result for the attempt as stale (the run waited for ever),
    or its timer failed the run with Trio's "deadline must not be NaN"."""
    from durable_trio._engine import RunRecord, RunStatus, StepKind, StepRecord, StepState
    from durable_trio._engine._stores.redis import RedisRunStore
    from durable_trio._redis import open_redis

    async with open_redis(redis_url) as client:
        store = RedisRunStore(client, f"att{uuid.uuid4().hex[:8]}")
        await store.create_run(RunRecord("r", "w", None, RunStatus.PENDING, 0, 0))
        step = StepRecord("r", "1", StepKind.REMOTE, "double", StepState.PENDING, input=2)
        await store.begin_step(step)
        assert [step.attempt for step in await store.get_steps("r")] == [1]
        await client.execute("HSET", store._step_key("r", "1"), field, value)
        with pytest.raises(dt.RunDataError, match=rf"checkpoint '1' .*{said}"):
            await store.get_steps("r")
