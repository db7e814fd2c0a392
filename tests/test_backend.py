"""open_backend: URL schemes, and a transport round trip on each embedded backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import trio

import durable_trio as dt

if TYPE_CHECKING:
    from pathlib import Path


async def test_unknown_scheme_is_a_config_error() -> None:
    with pytest.raises(dt.ConfigError, match="unknown backend URL scheme 'postgres'"):
        async with dt.open_backend("postgres://x"):
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


async def test_redis_backend_round_trip(redis_url: str) -> None:
    async with dt.open_backend(redis_url) as backend:
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
            health = await transport.group_health("double")
            assert health is not None
            assert len(health.live_workers) == 1
    assert [r.output for r in got] == [42]
