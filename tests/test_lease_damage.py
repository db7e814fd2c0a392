"""A run's lease that is no time (damaged data), on the stores whose data a test can reach:
SQLite, PostgreSQL and Redis.

A run an engine owns carries the time its lease ends; another engine claims it once that time
has passed (the orphans' sweep). A lease written over by an operator's mistake or a bad restore
with something that is no time was never found by that sweep, so its run waited for ever with
nobody driving it:

* SQLite keeps text in a REAL column, and numbers sort below text (``'x' < now`` is false);
* infinity (SQLite's ``9e999``, PostgreSQL's ``'Infinity'`` and ``'NaN'``, a Redis ``:leases``
  score of ``+inf``) sorts above every time.

Such a lease has now expired: the next claim takes the run and writes a time over it, so the
run is driven again (if the lease was its only damage, as here, it completes).
"""

from __future__ import annotations

import sqlite3
import uuid
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from _every_store import open_store
from durable_trio._engine import App, RunStatus, WorkflowContext, open_engine, open_worker
from durable_trio._postgres import open_pool
from durable_trio._redis import open_redis

if TYPE_CHECKING:
    from pathlib import Path

NAMESPACE = "leases"

#: (store kind, a damaged lease as the store keeps it).
DAMAGED = [
    pytest.param("sqlite", "'x'", id="sqlite-text"),
    pytest.param("sqlite", "x'00'", id="sqlite-blob"),
    pytest.param("sqlite", "9e999", id="sqlite-infinity"),
    pytest.param("postgres", "'Infinity'", id="postgres-infinity", marks=pytest.mark.postgres),
    pytest.param("postgres", "'NaN'", id="postgres-nan", marks=pytest.mark.postgres),
    pytest.param("redis", "+inf", id="redis-infinity", marks=pytest.mark.redis),
    pytest.param("redis", "text-in-hash", id="redis-hash-text", marks=pytest.mark.redis),
]


@pytest.fixture
def url(request: pytest.FixtureRequest, tmp_path: Path, kind: str) -> str:
    if kind == "postgres":
        return f"{request.getfixturevalue('postgres_url')}?schema=l_{uuid.uuid4().hex[:12]}"
    if kind == "redis":
        return str(request.getfixturevalue("redis_url"))
    return "sqlite:///" + str(tmp_path / "runs.db")


async def _damage_lease(url: str, run_id: str, value: str) -> None:
    """Run ``run_id`` left running by ``ghost`` (a dead engine) with the lease ``value`` (on
    Redis, owned by it: its status indexes as the engine's close left them)."""
    if url.startswith("sqlite:"):
        db = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        try:
            statement = (
                f"UPDATE dt_runs SET status = 'running', owner = 'ghost', lease_until = {value} "
                "WHERE run_id = ?"
            )
            assert db.execute(statement, (run_id,)).rowcount == 1
        finally:
            db.close()
    elif url.startswith("redis:"):
        prefix = f"{{dt-runs:{NAMESPACE}}}"
        async with open_redis(url) as client:
            if value == "+inf":  # the sweep's index: a score above every time
                await client.execute("ZADD", f"{prefix}:leases", "+inf", run_id)
            else:  # the run's own field: no time (the index as the engine left it)
                await client.execute("HSET", f"{prefix}:run:{run_id}", "lease", "soon")
            await client.execute("HSET", f"{prefix}:run:{run_id}", "owner", "ghost")
            await client.execute("SADD", f"{prefix}:owned:ghost", run_id)
    else:
        base, schema = url.split("?schema=")
        statement = f"""UPDATE "{schema}".runs SET status = 'running', owner = 'ghost',
            lease_until = {value}::float8 WHERE run_id = $1"""
        async with open_pool(base, size=1) as pool:
            await pool.fetch(statement, run_id)


def _app() -> App:
    app = App("leases")

    @app.step("double")
    async def double(n: int) -> int:
        return 2 * n

    @app.workflow("sleeper")
    async def sleeper(ctx: WorkflowContext, n: int) -> int:
        doubled: int = await ctx.step("double", n)
        await ctx.sleep(100)
        return doubled

    return app


_QUIET: dict[str, Any] = {
    "reconcile_interval": None, "watch_interval": None, "audit_interval": None,
}  # fmt: skip


async def _left_to_a_ghost(app: App, backend: dt.Backend, store: Any, url: str, value: str) -> None:
    """Run ``hurt`` of ``sleeper`` driven to its timer (15 s) by an engine that then closed,
    and left to a dead engine ``ghost`` whose lease is ``value`` (:func:`_damage_lease`)."""
    async with open_worker(app, backend, namespace=NAMESPACE), open_engine(
        app, backend, store=store, namespace=NAMESPACE, **_QUIET
    ) as engine:  # fmt: skip
        await engine.start("sleeper", 2, run_id="hurt", detach=True)
        await trio.sleep(15)
    await _damage_lease(url, "hurt", value)


@pytest.mark.parametrize(("kind", "value"), DAMAGED)
async def test_a_lease_that_is_no_time_has_expired_and_its_run_is_driven_again(
    url: str, value: str, store_clock: trio.testing.MockClock
) -> None:
    app = _app()
    async with open_store(url, NAMESPACE) as (backend, store):
        await _left_to_a_ghost(app, backend, store, url, value)
        # A claim takes it now and writes a time over the lease.
        [claimed] = [run for run in await store.claim_runs("next", 30.0) if run.run_id == "hurt"]
        assert claimed.owner == "next"
        # (Redis keeps the time as Lua prints it: 14 digits)
        assert claimed.lease_until == pytest.approx(trio.current_time() + 30.0, abs=1e-9)
        await store.release_runs("next", ["hurt"])
        # An engine adopts it and drives it to its end, at its timer's time.
        async with open_worker(app, backend, namespace=NAMESPACE), open_engine(
            app, backend, store=store, namespace=NAMESPACE, **_QUIET
        ) as engine:  # fmt: skip
            with trio.fail_after(300):
                assert await engine.result("hurt") == 4
        run = await store.get_run("hurt")
        assert run is not None
        assert (run.status, run.owner, run.lease_until) == (RunStatus.COMPLETED, None, None)


@pytest.mark.parametrize(("kind", "value"), [DAMAGED[2], DAMAGED[3]])
async def test_a_cancel_of_a_run_whose_lease_is_infinite_does_not_wait_for_it(
    url: str, value: str, store_clock: trio.testing.MockClock
) -> None:
    # ``runs cancel`` waits (grace + the lease's rest) for the engine driving a run to settle
    # it; a lease of infinity is no engine's (it waited for ever): the run is cancelled in the
    # store at once, as one nobody drives.
    app = _app()
    async with open_store(url, NAMESPACE) as (backend, store):
        await _left_to_a_ghost(app, backend, store, url, value)
        async with dt.open_operations(backend, namespace=NAMESPACE) as ops:
            start = trio.current_time()
            with trio.fail_after(300):
                assert await ops.cancel_run("hurt")
            assert trio.current_time() - start < 1.0
        run = await store.get_run("hurt")
        assert run is not None
        assert run.status is RunStatus.CANCELLED


async def test_take_over_of_a_run_whose_lease_is_infinite_takes_it(
    tmp_path: Path, store_clock: trio.testing.MockClock
) -> None:
    # ``engine.take_over`` claims nothing while a live engine's lease holds; a lease of
    # infinity is no time (it refused for ever): the run is taken over and driven here.
    url = "sqlite:///" + str(tmp_path / "runs.db")
    app = _app()
    async with open_store(url, NAMESPACE) as (backend, store):
        await _left_to_a_ghost(app, backend, store, url, "9e999")
        async with open_worker(app, backend, namespace=NAMESPACE), open_engine(
            app, backend, store=store, namespace=NAMESPACE, reconcile=False, **_QUIET
        ) as engine:  # fmt: skip
            assert await engine.take_over("hurt")
            with trio.fail_after(300):
                assert await engine.result("hurt") == 4
