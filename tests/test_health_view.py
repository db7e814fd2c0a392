"""`durable-trio health`: the live view, the plain table, the Prometheus text, a real process."""

from __future__ import annotations

import io
import subprocess
import sys
from typing import TYPE_CHECKING

import trio
import trio.testing
from rich.console import Console

import durable_trio as dt
from durable_trio._health_view import prometheus_text, render_text, snapshot, watch

if TYPE_CHECKING:
    from pathlib import Path


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
            groups = await snapshot(backend, "ops")
            assert groups is not None
            assert "thumbnails" in render_text(groups, "ops")
            metrics = prometheus_text(groups)
            assert 'durable_trio_group_live_workers{group="thumbnails"} 1' in metrics
            assert 'durable_trio_worker_limit{group="thumbnails",instance="worker-7"} 4' in metrics
            # the view itself never looks like a worker
            health = await worker.group_health("thumbnails")
            assert health is not None
            assert [w.instance for w in health.live_workers] == ["worker-7"]


async def test_health_command_in_a_real_process_sees_a_worker_on_sqlite(tmp_path: Path) -> None:
    url = "sqlite:///" + str(tmp_path / "ops.db")
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


async def test_prometheus_exporter_serves_metrics() -> None:
    from durable_trio._health_view import serve_prometheus

    async with dt.open_backend("memory://") as backend:
        async with dt.open_queue_transport(backend, namespace="ops", instance_id="w1") as worker:
            worker.handle("mail", serve_forever)
            await trio.sleep(0.05)
            async with trio.open_nursery() as nursery:
                listeners = await nursery.start(trio.serve_tcp, lambda s: s.aclose(), 0)
                port = listeners[0].socket.getsockname()[1]
                nursery.cancel_scope.cancel()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve_prometheus, backend, "ops", port)
                await trio.sleep(0.1)
                async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                    await stream.send_all(b"GET /metrics HTTP/1.0\r\n\r\n")
                    response = b""
                    with trio.fail_after(5):
                        while chunk := await stream.receive_some():
                            response += chunk
                nursery.cancel_scope.cancel()
    assert response.startswith(b"HTTP/1.0 200 OK")
    assert b'durable_trio_group_live_workers{group="mail"} 1' in response
