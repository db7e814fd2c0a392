"""Issue 36, item 3 (Redis): a store emptied under running processes (``FLUSHALL``, a server
restarted without its data) is a loss nobody would otherwise report. The store's identity,
stamped once, is checked periodically and on every reconnection; its loss is logged at ERROR,
reported, recorded in the store and shown by health until an operator acknowledges it.

A private server; the real clock, with short intervals.
"""

from __future__ import annotations

import logging
import shutil
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from _redis_server import *  # noqa: F403
from durable_trio._redis import open_redis, open_redis_cluster
from durable_trio._transport._health import read_store_loss
from durable_trio.backends.redis import open_redis_backend
from durable_trio.brokers.redis import RedisBroker, RedisClusterBroker
from durable_trio.brokers.redis._identity import ALARM_KEY, IDENTITY_KEY
from durable_trio.cli._health import HealthReader, _scrape, render_text
from helpers import Errors

if TYPE_CHECKING:
    from collections.abc import Callable

    from _redis_cluster import RedisCluster
    from _redis_server import RedisServer


async def eventually(condition: Callable[[], Any], within: float = 10.0) -> None:
    """Return once ``condition()`` (awaited if it is a coroutine) is true."""
    with trio.fail_after(within):
        for _ in range(100_000):
            value = condition()
            if hasattr(value, "__await__"):
                value = await value
            if value:
                return
            await trio.sleep(0.05)


def calls(server: RedisServer) -> dict[str, int]:
    """``INFO commandstats`` as ``{command: calls}``."""
    out: dict[str, int] = {}
    for line in server.command("INFO", "commandstats").decode().splitlines():
        if line.startswith("cmdstat_"):
            name, _, fields = line[len("cmdstat_") :].partition(":")
            out[name] = int(fields.split(",")[0].split("=")[1])
    return out


def losses(errors: Errors) -> list[dt.StoreLost]:
    return [e for e in errors.seen if isinstance(e, dt.StoreLost)]


async def test_a_flushed_store_raises_the_alarm_once_until_acknowledged(
    redis_url: str, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    errors = Errors()
    caplog.set_level(logging.ERROR, logger="durable_trio.redis")
    async with (
        open_redis(redis_url) as client,
        RedisBroker(client, store_check_interval=0.1, on_error=errors) as broker,
    ):
        await eventually(lambda: client.execute("GET", IDENTITY_KEY))
        stamped = (await client.execute("GET", IDENTITY_KEY)).decode()
        before = calls(redis_server)
        await trio.sleep(0.3)  # a few checks: all is well, nothing reported
        after = calls(redis_server)
        # While all is well a check is one MGET, never the script (three commands).
        assert after.get("mget", 0) - before.get("mget", 0) >= 2
        assert after.get("evalsha", 0) == before.get("evalsha", 0)
        assert broker.store_loss is None
        assert await broker.read_store_loss() is None

        redis_server.command("FLUSHALL")
        await eventually(lambda: losses(errors))
        await trio.sleep(0.5)  # more checks: the alarm stands, reported once
        (loss,) = losses(errors)
        assert loss.lost == stamped
        assert loss.found is None
        assert "STORE LOST" in str(loss)
        assert "emptied or replaced" in str(loss)
        assert [r.levelno for r in caplog.records if "STORE LOST" in r.getMessage()] == [
            logging.ERROR
        ]
        # Recorded in the store (a process started now sees it) and a new identity stamped
        # with it: the next checks compare against the new one.
        restamped = (await client.execute("GET", IDENTITY_KEY)).decode()
        assert restamped != stamped
        async with open_redis(redis_url) as other:
            backend = dt.Backend(url=redis_url, broker=RedisBroker(other))
            seen = await read_store_loss(backend)
        assert seen is not None
        assert seen.lost == stamped
        assert broker.store_loss is not None

        assert await broker.acknowledge_store_loss()
        await eventually(lambda: broker.store_loss is None)
        assert await broker.read_store_loss() is None
        assert await client.execute("GET", ALARM_KEY) is None
        assert len(losses(errors)) == 1


def _restart_empty(server: RedisServer) -> None:
    """Stop the server and start it again without its data (its append-only file gone)."""
    server.stop(kill=True)
    for name in ("appendonlydir", "appendonly.aof", "dump.rdb"):
        path = server.dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    server.start()


async def test_a_server_restarted_empty_under_live_transports_shows_in_health(
    redis_url: str, redis_server: RedisServer
) -> None:
    """The periodic check is far off (60 s): the reconnection after the restart finds the loss;
    health (the transport's, the health command's text and metrics) shows it."""
    errors = Errors()
    options: dict[str, Any] = {"poll_interval": 0.05, "stalled_check_interval": 0.5}
    async with (
        open_redis_backend(redis_url, store_check_interval=60.0, on_error=errors) as backend,
        dt.open_queue_transport(backend, namespace="lost", **options) as engine,
        dt.open_queue_transport(backend, namespace="lost", concurrency=2, **options) as worker,
    ):

        async def work(task: dt.RemoteTask) -> str:
            return task.step_id

        done: list[str] = []

        async def on_result(result: dt.StepResult) -> None:
            done.append(result.step_id)

        worker.handle("work", work)
        engine.on_result(on_result)
        await engine.dispatch(dt.RemoteTask(run_id="r", step_id="s1", attempt=1, name="work"))
        await eventually(lambda: done)
        await eventually(lambda: redis_server.command("GET", IDENTITY_KEY))
        assert await engine.health.store_loss() is None

        await trio.to_thread.run_sync(_restart_empty, redis_server)
        await eventually(lambda: losses(errors))
        loss = await engine.health.store_loss()
        assert loss is not None
        reader = HealthReader(backend, "lost")
        await reader.read()
        assert reader.store_loss is not None
        assert render_text([], "lost", reader.store_loss).startswith("STORE LOST")
        assert "durable_trio_store_lost 1" in (await _scrape(reader)).decode()
        # The loops work on (the store works; only what it held is gone).
        await engine.dispatch(dt.RemoteTask(run_id="r", step_id="s2", attempt=1, name="work"))
        await eventually(lambda: "s2" in done)


async def test_on_a_cluster_the_master_holding_the_identity_is_watched(
    redis_cluster: RedisCluster,
) -> None:
    """A Cluster: the identity lives on one master; that master flushed raises the alarm."""
    redis_cluster.reset()
    errors = Errors()
    async with (
        open_redis_cluster(redis_cluster.url) as client,
        RedisClusterBroker(client, store_check_interval=0.1, on_error=errors) as broker,
    ):
        await eventually(lambda: client.execute("GET", IDENTITY_KEY))
        holder = redis_cluster.owner(redis_cluster.keyslot(IDENTITY_KEY))
        holder.command("FLUSHALL")
        await eventually(lambda: losses(errors))
        assert await broker.read_store_loss() is not None


async def test_the_console_shows_the_alarm_on_every_page(
    redis_url: str, redis_server: RedisServer
) -> None:
    pytest.importorskip("starlette")
    import httpx

    from durable_trio.console import create_app

    async with (
        open_redis_backend(redis_url, store_check_interval=0.1) as backend,
        dt.open_operations(backend, namespace="lost") as ops,
    ):
        await eventually(lambda: redis_server.command("GET", IDENTITY_KEY))
        transport = httpx.ASGITransport(app=create_app(ops))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            assert "STORE LOST" not in (await http.get("/runs")).text
            redis_server.command("FLUSHALL")
            await eventually(lambda: redis_server.command("GET", ALARM_KEY))
            for path in ("/runs", "/workers", "/queues"):
                page = await http.get(path)
                assert page.status_code == 200
                assert "STORE LOST" in page.text, path
