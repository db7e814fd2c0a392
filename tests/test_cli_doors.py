"""Bad values at the command line's doors, as a newcomer types them: each is one line on stderr
starting `error: `, exit status 2, no traceback, and nothing started or served."""

from __future__ import annotations

import errno
import os
import socket
from typing import TYPE_CHECKING

import pytest
import trio

import durable_trio as dt
from durable_trio.cli._main import main

if TYPE_CHECKING:
    from pathlib import Path

FLOWS = """
import durable_trio as dt

app = dt.App("shop")


@app.step("hello")
async def hello(name: str) -> str:
    return f"hello, {name}"


@app.workflow("greet")
async def greet(ctx: dt.WorkflowContext, name: str) -> str:
    return await ctx.step("hello", name)
"""


def _one_error_line(err: str) -> str:
    assert err.count("\n") == 1, err
    assert err.startswith("error: "), err
    assert "Traceback" not in err
    return err


async def _run_ids(url: str) -> list[str]:
    async with dt.open_operations(url, namespace="shop") as ops:
        return [run.run_id for run in (await ops.list_runs()).runs]


@pytest.mark.parametrize("timeout", ["-1", "nan", "inf"])
def test_run_refuses_a_bad_timeout_before_it_starts_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], timeout: str
) -> None:
    (tmp_path / "door_flows.py").write_text(FLOWS)
    url = f"sqlite:///{tmp_path / 'x.db'}".replace("///", "////", 1)
    target = f"{tmp_path / 'door_flows.py'}:app"
    status = main(["run", target, "greet", '"you"', "--timeout", timeout, "--backend", url])
    assert status == 2
    err = _one_error_line(capsys.readouterr().err)
    assert "--timeout must be a finite number of seconds >= 0" in err
    assert not (tmp_path / "x.db").exists()  # nothing opened, so no run left behind
    assert main(["run", target, "greet", '"you"', "--with-worker", "--backend", url]) == 0
    assert len(trio.run(_run_ids, url)) == 1


def test_run_says_error_before_an_input_that_is_not_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "door_flows2.py").write_text(FLOWS)
    target = f"{tmp_path / 'door_flows2.py'}:app"
    assert main(["run", target, "greet", "{oops", "--backend", "memory://"]) == 2
    assert _one_error_line(capsys.readouterr().err).startswith("error: INPUT is not JSON")
    assert main(["run", target, "greet", "--input", "{oops", "--backend", "memory://"]) == 2
    assert _one_error_line(capsys.readouterr().err).startswith("error: --input is not JSON")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--watch", "--interval", "-1"], "--interval must be a finite number of seconds > 0"),
        (["--watch", "--interval", "nan"], "--interval must be a finite number of seconds > 0"),
        (["--watch", "--interval", "0"], "--interval must be a finite number of seconds > 0"),
        (["--watch", "--iterations", "0"], "--iterations must be an integer >= 1"),
        (["--prometheus", "99999"], "--prometheus: a port is 0..65535"),
        (["--prometheus", "-1"], "--prometheus: a port is 0..65535"),
    ],
)
def test_health_refuses_a_bad_interval_iterations_or_port(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    """Each was a traceback, or (99999) a port the kernel wrapped to another one while the
    line printed the one given."""
    url = f"sqlite:///{tmp_path / 'x.db'}".replace("///", "////", 1)
    assert main(["schedules", "add", "s", "wf", "--every", "60", "--force", "--backend", url]) == 0
    capsys.readouterr()
    assert main(["health", "--backend", url, *argv]) == 2
    out, err = capsys.readouterr()
    assert said in _one_error_line(err)
    assert out == ""


def test_health_prometheus_on_a_busy_port_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It printed `serving ...` before it listened, then a traceback of the bind."""
    url = f"sqlite:///{tmp_path / 'x.db'}".replace("///", "////", 1)
    assert main(["schedules", "add", "s", "wf", "--every", "60", "--force", "--backend", url]) == 0
    capsys.readouterr()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["health", "--backend", url, "--prometheus", str(port)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert _one_error_line(err) == (
        f"error: cannot listen on 127.0.0.1:{port}: [Errno {errno.EADDRINUSE}] "
        f"{os.strerror(errno.EADDRINUSE)}\n"
    )


async def test_health_prometheus_says_the_port_it_listens_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Port 0 picks a free one: the line names that one, once it listens."""
    from durable_trio.cli._health import HealthReader, _serve_and_watch

    async with dt.open_backend("memory://") as backend:
        reader = HealthReader(backend, "shop")
        with trio.move_on_after(5) as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_serve_and_watch, reader, 0, False, 1.0, None)
                await trio.sleep(0.5)
                [line] = capsys.readouterr().out.splitlines()
                port = int(line.removeprefix("serving Prometheus metrics on http://127.0.0.1:")
                           .removesuffix("/metrics"))  # fmt: skip
                assert port > 0
                reply = b""
                async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                    await stream.send_all(b"GET /metrics HTTP/1.0\r\n\r\n")
                    while chunk := await stream.receive_some():
                        reply += chunk
                assert b"durable_trio_up" in reply
                nursery.cancel_scope.cancel()
        assert not scope.cancelled_caught


@pytest.mark.parametrize("url", ["foo://x", "sqlite://rel.db", "redis://127.0.0.1:notaport"])
def test_examples_on_a_bad_backend_url_say_so_once(
    capsys: pytest.CaptureFixture[str], url: str
) -> None:
    """`examples run --all` on a mistyped URL ran every example, each failing with the same
    error (13 of 14 'failed', exit 1): the URL is one line now, before any example runs."""
    assert main(["examples", "run", "--all", "--backend", url]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    _one_error_line(err)


@pytest.mark.parametrize(
    "command", [["runs", "list"], ["queues"], ["schedules", "list"], ["health"]]
)
def test_namespace_help_says_the_backend_only_namespace_is_found(
    capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """The help said `else durable`, while the command finds the backend's only namespace
    (docs/operations.md, "The namespace")."""
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "else --app's name, else the backend's only one; none yet: durable" in text


@pytest.mark.parametrize("scheme", ["redis", "postgresql"])
def test_a_server_not_there_is_one_line_without_a_retry_it_will_not_make(
    capsys: pytest.CaptureFixture[str], scheme: str
) -> None:
    """A one-shot command exits at the first refusal: the pool's "next connect attempt in ..."
    (for a process that goes on) is left out of its line."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"{scheme}://127.0.0.1:{port}/" + ("0" if scheme == "redis" else "postgres")
    assert main(["runs", "list", "--backend", url]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"127.0.0.1:{port}" in line
    assert "next connect attempt" not in line
