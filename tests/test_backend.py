"""open_backend: URL schemes, a transport round trip on each backend, and its run stores."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import pytest
import trio

import durable_trio as dt
from durable_trio._engine import RunRecord, RunStatus, RunStore, open_run_store
from durable_trio._engine._stores.memory import MemoryRunStore
from durable_trio._engine._stores.redis import RedisRunStore
from durable_trio._engine._stores.sqlite import SqliteRunStore

if TYPE_CHECKING:
    from pathlib import Path


async def test_unknown_scheme_is_a_config_error() -> None:
    with pytest.raises(dt.ConfigError, match="unknown backend URL scheme 'mysql'"):
        async with dt.open_backend("mysql://x"):
            pass


@pytest.mark.parametrize("url", ["sqlite://host/x.db", "sqlite:///", "sqlite:"])
async def test_bad_sqlite_urls_are_config_errors(url: str) -> None:
    with pytest.raises(dt.ConfigError):
        async with dt.open_backend(url):
            pass


async def test_sqlite_backend_round_trip_survives_reopening(tmp_path: Path) -> None:
    """The embedded default is durable: a job pushed before a close is there after a reopen."""
    url = "sqlite:///" + str(tmp_path / "sub" / "app.db")  # sqlite:////abs/path
    async with dt.open_backend(url) as backend:
        assert backend.keys is not None
        async with dt.open_queue_transport(backend, namespace="durable-test") as producer:
            await producer.dispatch(
                dt.RemoteTask(run_id="r", step_id="s", attempt=1, name="later", input=41)
            )
    assert (tmp_path / "sub" / "app.db").exists()
    async with dt.open_backend(url) as backend:
        async with dt.open_queue_transport(backend, namespace="durable-test") as worker:
            got: list[dt.StepResult] = []
            arrived = trio.Event()

            async def later(task: dt.RemoteTask) -> int:
                return int(task.input) + 1

            async def on_result(result: dt.StepResult) -> None:
                got.append(result)
                arrived.set()

            worker.handle("later", later)
            worker.on_result(on_result)
            with trio.fail_after(10):
                await arrived.wait()
    assert [r.output for r in got] == [42]


@pytest.fixture(params=["redis", "redis-sentinel"])
def any_redis_url(request: pytest.FixtureRequest) -> str:
    """A fresh database on the private server, or on the private Sentinel group's master."""
    fixture = "redis_url" if request.param == "redis" else "redis_sentinel_url"
    return str(request.getfixturevalue(fixture))


async def test_redis_backend_round_trip(any_redis_url: str) -> None:
    async with dt.open_backend(any_redis_url) as backend:
        assert backend.keys is not None
        assert "@" not in backend.url
        async with dt.open_queue_transport(backend, namespace="backend-test") as transport:
            got: list[dt.StepResult] = []
            arrived = trio.Event()

            async def double(task: dt.RemoteTask) -> int:
                return int(task.input) * 2

            async def on_result(result: dt.StepResult) -> None:
                got.append(result)
                arrived.set()

            transport.handle("double", double)
            transport.on_result(on_result)
            await transport.dispatch(
                dt.RemoteTask(run_id="r", step_id="s", attempt=1, name="double", input=21)
            )
            with trio.fail_after(10):
                await arrived.wait()
            health = await transport.health.group_health("double")
            assert health is not None
            assert len(health.live_workers) == 1
    assert [r.output for r in got] == [42]


def pending(run_id: str) -> RunRecord:
    return RunRecord(run_id, "order", None, RunStatus.PENDING, 0, 0)


async def assert_opens_share_runs(first: dt.Backend, second: dt.Backend) -> RunStore:
    """A run created through ``first``'s store is read through ``second``'s."""
    async with open_run_store(first, "shop") as writer, open_run_store(second, "shop") as reader:
        await writer.create_run(pending("r"))
        stored = await reader.get_run("r")
        assert stored is not None
        assert stored.run_id == "r"
        async with open_run_store(second, "other") as elsewhere:
            assert await elsewhere.get_run("r") is None  # runs are per namespace
        return reader


async def test_memory_run_stores_live_on_the_backend() -> None:
    """Engines on one memory backend share its runs; another backend has its own."""
    async with dt.open_backend("memory://") as backend, dt.open_backend("memory://") as other:
        store = await assert_opens_share_runs(backend, backend)
        assert isinstance(store, MemoryRunStore)
        async with open_run_store(other, "shop") as elsewhere:
            assert await elsewhere.get_run("r") is None
        # leaving the block did not close it: the next engine still sees the run
        async with open_run_store(backend, "shop") as again:
            assert again is store


async def test_sqlite_run_stores_are_on_the_broker_s_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/app.db"
    async with dt.open_backend(url) as backend:
        store = await assert_opens_share_runs(backend, backend)
        assert isinstance(store, SqliteRunStore)
    async with dt.open_backend(url) as reopened, open_run_store(reopened, "shop") as store:
        assert await store.get_run("r") is not None  # durable


async def test_redis_run_stores_are_on_the_backend_s_client(redis_url: str) -> None:
    async with dt.open_backend(redis_url) as backend, dt.open_backend(redis_url) as other:
        store = await assert_opens_share_runs(backend, other)
        assert isinstance(store, RedisRunStore)


async def test_a_hand_built_backend_has_memory_run_stores_of_its_own() -> None:
    async with dt.open_backend("memory://") as real:
        wrapped = dt.Backend(url="test://", broker=real.broker, keys=real.keys)
        async with open_run_store(real, "shop") as store:
            await store.create_run(pending("r"))
        async with open_run_store(wrapped, "shop") as own:
            assert isinstance(own, MemoryRunStore)
            assert await own.get_run("r") is None


async def test_a_hand_built_backend_given_the_run_stores_shares_the_runs(tmp_path: Path) -> None:
    """A wrapped SQLite broker's backend keeps the real backend's runs (same file, same
    connection thread) when handed its run stores; ``attrs.evolve`` keeps them too."""
    async with dt.open_backend(f"sqlite:///{tmp_path}/app.db") as real:
        wrapped = dt.Backend(
            url=real.url, broker=real.broker, keys=None, run_stores=real.run_stores
        )
        assert isinstance(await assert_opens_share_runs(real, wrapped), SqliteRunStore)
        store_less = attrs.evolve(real, keys=None)
        async with open_run_store(store_less, "shop") as store:
            assert await store.get_run("r") is not None
