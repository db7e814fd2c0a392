"""`durable-trio health`: the live view, the plain table, the Prometheus text, a real process."""

from __future__ import annotations

import io
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest
import trio
import trio.testing
from rich.console import Console

import durable_trio as dt
from durable_trio.brokers.memory import MemoryBroker
from durable_trio.cli._health import (
    SCRAPE_TIMEOUT,
    HealthReader,
    prometheus_text,
    render_text,
    respond,
    serve_prometheus,
    snapshot,
    watch,
)
from durable_trio.keys.memory import MemoryKeyStore

if TYPE_CHECKING:
    from pathlib import Path

    from durable_trio.keys import KeyEntry


async def serve_forever(task: dt.RemoteTask) -> None:
    await trio.sleep_forever()


async def test_watch_shows_a_running_workers_group_live(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with dt.open_backend("memory://") as backend:
        async with dt.open_queue_transport(
            backend, namespace="ops", instance_id="worker-7", concurrency=4
        ) as worker:
            worker.handle("thumbnails", serve_forever)
            await worker.dispatch(
                dt.RemoteTask(run_id="r", step_id="s", attempt=1, name="thumbnails")
            )
            await trio.sleep(11)  # the 10 s beat carries in-flight 1
            screen = io.StringIO()
            console = Console(file=screen, width=160, force_terminal=False)
            await watch(backend, "ops", interval=1.0, iterations=2, console=console)
            text = screen.getvalue()
            assert "thumbnails" in text
            assert "worker-7" in text
            assert "1/4 fixed" in text
            assert "flow control" not in text  # (no queue with a limit or a rate)
            limits = backend.broker
            assert isinstance(limits, dt.brokers.SupportsQueueLimits)
            await limits.set_queue_limit("ops:tasks:thumbnails", 2)
            screen = io.StringIO()
            console = Console(file=screen, width=160, force_terminal=False)
            await watch(backend, "ops", interval=1.0, iterations=1, console=console)
            flow = screen.getvalue().split("flow control", 1)[1]
            row = next(line for line in flow.splitlines() if "ops:tasks:thumbnails" in line)
            assert [cell.strip() for cell in row.strip("│ ").split("│")] == [
                "ops:tasks:thumbnails", "2", "1", "0", "—",
            ]  # limit 2, 1 in use, none waiting, no rate
            groups = await snapshot(backend, "ops")
            assert groups is not None
            assert "thumbnails" in render_text(groups, "ops")
            metrics = prometheus_text(groups)
            assert 'durable_trio_group_live_workers{group="thumbnails"} 1' in metrics
            assert 'durable_trio_worker_limit{instance="worker-7"} 4' in metrics
            assert 'durable_trio_worker_serves{instance="worker-7",group="thumbnails"} 1' in metrics
            # the view itself never looks like a worker
            health = await worker.health.group_health("thumbnails")
            assert health is not None
            assert [w.instance for w in health.live_workers] == ["worker-7"]


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_health_command_in_a_real_process_sees_a_worker(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = "sqlite:///" + str(tmp_path / "ops.db")
    if kind == "postgres":
        url = str(request.getfixturevalue("postgres_schema_url"))
    async with dt.open_backend(url) as backend:
        async with dt.open_queue_transport(backend, namespace="ops", instance_id="w-real") as w:
            w.handle("invoices", serve_forever)
            await trio.sleep(0.2)
            result = await trio.run_process(
                [
                    sys.executable,
                    "-m",
                    "durable_trio",
                    "health",
                    "--backend",
                    url,
                    "--namespace",
                    "ops",
                ],
                capture_stdout=True,
                capture_stderr=True,
            )
    out = result.stdout.decode()
    assert "invoices" in out
    assert "w-real" in out


def test_no_live_workers_is_said_plainly() -> None:
    assert "no live workers" in render_text([], "ops")
    assert "not available" in render_text(None, "ops")


def test_cli_help_lists_health() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "durable_trio", "health", "--help"], capture_output=True, text=True
    ).stdout
    assert "--watch" in out
    assert "--prometheus" in out


class FlakyKeys(MemoryKeyStore):
    """A memory key store whose next read raises ``fail`` (once), or that hangs while ``hang``."""

    def __init__(self) -> None:
        super().__init__()
        self.fail: Exception | None = None
        self.hang = False

    async def entries(self, prefix: str) -> list[KeyEntry]:
        if self.hang:
            await trio.sleep_forever()
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        return await super().entries(prefix)


async def get(reader: HealthReader, path: bytes = b"/metrics") -> bytes:
    """One scrape, over an in-memory stream, answered by the exporter's own responder."""
    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(respond, server, reader)
        await client.send_all(b"GET %s HTTP/1.0\r\n\r\n" % path)
        response = b""
        while chunk := await client.receive_some():
            response += chunk
    return response


async def test_prometheus_scrapes_survive_a_broker_error_a_hang_and_a_defect(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """One reader for every scrape; a scrape that meets a broker error answers ``up 0`` (200),
    one whose backend hangs answers the same at the scrape timeout, one that meets a defect
    answers 500; the next scrape works each time."""
    keys = FlakyKeys()
    backend = dt.Backend(url="memory://", broker=MemoryBroker(), keys=keys)
    async with dt.open_queue_transport(backend, namespace="ops", instance_id="w1") as worker:
        worker.handle("mail", serve_forever)
        await trio.testing.wait_all_tasks_blocked()
        reader = HealthReader(backend, "ops")
        ok = await get(reader)
        assert ok.startswith(b"HTTP/1.0 200 OK")
        assert b"\ndurable_trio_up 1\n" in ok
        assert b'durable_trio_group_live_workers{group="mail"} 1' in ok
        keys.fail = dt.BrokerError("key store down")
        down = await get(reader)
        assert down.startswith(b"HTTP/1.0 200 OK")
        assert b"\ndurable_trio_up 0\n" in down
        assert b"durable_trio_health_read_errors_total 1\n" in down
        samples = [line for line in down.splitlines() if not line.startswith(b"#")]
        assert not [line for line in samples if line.startswith(b"durable_trio_group")]
        assert "key store down" in caplog.text
        again = await get(reader)
        assert b"\ndurable_trio_up 1\n" in again
        assert b'durable_trio_group_live_workers{group="mail"} 1' in again
        keys.hang = True
        start = trio.current_time()
        slow = await get(reader)
        assert trio.current_time() - start == SCRAPE_TIMEOUT
        assert b"\ndurable_trio_up 0\n" in slow
        assert b"durable_trio_health_read_errors_total 2\n" in slow
        keys.hang = False
        keys.fail = TypeError("a key store defect")
        broken = await get(reader)
        assert broken.startswith(b"HTTP/1.0 500 Internal Server Error")
        assert (await get(reader)).startswith(b"HTTP/1.0 200 OK")
        assert (await get(reader, b"/nope")).startswith(b"HTTP/1.0 404 Not Found")
        assert (reader.reads, reader.errors) == (6, 2)


async def test_watch_outlives_a_failed_refresh(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A refresh the backend fails (Redis down, for one) showed nothing and ended the command
    (exit 2): the live view died with the first blip. It shows the error in one line above the
    last table and tries again at the next refresh."""
    keys = FlakyKeys()
    backend = dt.Backend(url="memory://", broker=MemoryBroker(), keys=keys)
    async with dt.open_queue_transport(backend, namespace="ops", instance_id="w1") as worker:
        worker.handle("mail", serve_forever)
        await trio.testing.wait_all_tasks_blocked()
        screen = io.StringIO()
        console = Console(file=screen, width=160, force_terminal=False)
        async with trio.open_nursery() as nursery:

            async def blip() -> None:
                await trio.sleep(1.5)  # after the first refresh, before the second
                keys.fail = dt.BrokerUnavailable("could not connect to the key store")

            nursery.start_soon(blip)
            await watch(backend, "ops", interval=1.0, iterations=3, console=console)
        text = screen.getvalue()
    assert "refresh failed: could not connect to the key store (trying again every 1 s)" in text
    after = text.split("refresh failed", 1)[1]
    assert "mail" in after  # the table is still shown, and the next refresh read it again


async def test_a_scrape_of_an_unavailable_backend_logs_one_line(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Every scrape of a backend that is down logged the error's traceback (a refused Redis:
    ~45 lines, every 15 s of Prometheus' scrapes); one line now."""
    keys = FlakyKeys()
    backend = dt.Backend(url="memory://", broker=MemoryBroker(), keys=keys)
    reader = HealthReader(backend, "ops")
    keys.fail = dt.BrokerUnavailable("could not connect to the key store")
    assert b"\ndurable_trio_up 0\n" in await get(reader)
    [record] = [r for r in caplog.records if "a scrape could not read" in r.getMessage()]
    assert record.exc_info is None
    assert record.getMessage() == (
        "health: a scrape could not read the backend: BrokerUnavailable: could not connect to"
        " the key store (in _scrape)"
    )


async def test_prometheus_exporter_serves_metrics_and_keeps_serving_after_an_error() -> None:
    """The real endpoint, on a free port, opened once: a scrape that meets a broker error is
    answered with ``up 0`` and the same server answers the next one."""
    keys = FlakyKeys()
    backend = dt.Backend(url="memory://", broker=MemoryBroker(), keys=keys)
    reader = HealthReader(backend, "ops")

    async def scrape(port: int) -> bytes:
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            await stream.send_all(b"GET /metrics HTTP/1.0\r\n\r\n")
            response = b""
            while chunk := await stream.receive_some():
                response += chunk
        return response

    async with dt.open_queue_transport(backend, namespace="ops", instance_id="w1") as worker:
        worker.handle("mail", serve_forever)
        await trio.sleep(0.05)
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                listeners = await nursery.start(serve_prometheus, reader, 0)
                port = listeners[0].socket.getsockname()[1]
                first = await scrape(port)
                keys.fail = dt.BrokerError("key store down")
                second = await scrape(port)
                third = await scrape(port)
                nursery.cancel_scope.cancel()
    assert first.startswith(b"HTTP/1.0 200 OK")
    assert b'durable_trio_group_live_workers{group="mail"} 1' in first
    assert second.startswith(b"HTTP/1.0 200 OK")
    assert b"\ndurable_trio_up 0\n" in second
    assert b'durable_trio_group_live_workers{group="mail"} 1' in third
    assert (reader.reads, reader.errors) == (3, 1)
