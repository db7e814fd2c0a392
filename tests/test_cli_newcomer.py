"""Where a newcomer stumbled on the command line (issue 30, item 12): a closed pipe, Ctrl-C and
SIGTERM on `health --prometheus`, an app module that fails to import, a busy console port,
`health --json` and one JSON casing everywhere. Real processes where the defect needs one
(wall clock, bounded)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from _redis_server import _free_port
from durable_trio.cli._main import main

if TYPE_CHECKING:
    from pathlib import Path

#: Seconds a real process may take to start serving, and to exit after its signal.
START_BOUND = 20.0
EXIT_BOUND = 5.0


def _database_with_runs(tmp_path: Path, runs: int) -> str:
    url = f"sqlite:///{tmp_path / 'x.db'}"

    async def make() -> None:
        async with dt.open_backend(url) as backend, backend.open_run_store("shop") as store:
            for index in range(runs):
                record = dt.RunRecord(f"run-{index}", "order", {"n": index}, dt.RunStatus.PENDING,
                                      0.0, 0.0)  # fmt: skip
                await store.create_run(record)

    trio.run(make)
    return url


@pytest.mark.chaos
def test_a_closed_pipe_ends_the_listing_quietly(tmp_path: Path) -> None:
    """`runs list --json | head -1`: the reader is gone before the command writes; no
    `BrokenPipeError` traceback, SIGPIPE's conventional status."""
    url = _database_with_runs(tmp_path, 200)
    process = subprocess.Popen(
        [sys.executable, "-m", "durable_trio", "runs", "list", "--json", "--backend", url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None
    process.stdout.close()  # as `head` does once it has its line
    _, err = process.communicate(timeout=START_BOUND)
    assert err.decode() == ""
    assert process.returncode == 128 + signal.SIGPIPE


@pytest.mark.chaos
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_health_prometheus_stops_on_a_signal_without_a_traceback(
    tmp_path: Path, signum: signal.Signals
) -> None:
    url = _database_with_runs(tmp_path, 1)
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "durable_trio", "health", "--backend", url,
         "--prometheus", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + START_BOUND
        while True:
            assert process.poll() is None, process.communicate()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    assert b"durable_trio_up 1" in r.read()
                break
            except OSError:
                assert time.monotonic() < deadline, "the exporter never answered"
                time.sleep(0.1)
        process.send_signal(signum)
        _, err = process.communicate(timeout=EXIT_BOUND)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0
    assert "Traceback" not in err.decode()
    assert err.decode().splitlines() == [
        f"{signum.name}: closing gracefully (send it again to close now)"
    ]


def test_an_app_module_that_fails_to_import_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "broken_app_mod.py").write_text(
        "import durable_trio as dt\napp = dt.App('shop')\nundefined_name\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    status = main(["worker", "broken_app_mod:app", "--backend", "memory://"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1
    assert err.startswith("error: cannot import 'broken_app_mod': NameError: name ")
    assert "broken_app_mod.py:3)" in err


def test_an_app_module_that_calls_trio_run_at_its_top_level_is_told_how_to_guard_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """README's first example saved as shop.py runs ``trio.run(main)`` at its top level: the
    CLI imports it from inside its own ``trio.run``, and says what to change."""
    (tmp_path / "script_app_mod.py").write_text(
        "import trio\nimport durable_trio as dt\napp = dt.App('shop')\n"
        "async def main() -> None:\n    pass\n\ntrio.run(main)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    status = main(["runs", "list", "--backend", "memory://", "--app", "script_app_mod:app"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1
    assert err.startswith("error: cannot import 'script_app_mod': its top level calls trio.run()")
    assert "script_app_mod.py:7)" in err
    assert 'if __name__ == "__main__":' in err


def test_the_console_on_a_busy_port_says_address_in_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _database_with_runs(tmp_path, 0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status = main(["console", "--backend", url, "--port", str(port)])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith(f"error: cannot listen on 127.0.0.1:{port}: [Errno 98]")
    assert "in use" in err
    assert "nursery" not in err


def test_the_console_takes_its_namespace_from_app_as_runs_list_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``durable-trio console --app shop:app``, as a newcomer types it after ``runs list --app
    shop:app``: the console opens on the App's namespace; an App that cannot be imported is
    one line."""
    (tmp_path / "console_app_mod.py").write_text(
        "import durable_trio as dt\napp = dt.App('shop-console')\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("DURABLE_TRIO_NAMESPACE", raising=False)
    seen: dict[str, Any] = {}

    async def fake_console(backend: str, **options: Any) -> None:
        seen.update(options, backend=backend)
        await trio.lowlevel.checkpoint()

    monkeypatch.setattr("durable_trio.console.run_console", fake_console)
    url = f"sqlite:///{tmp_path / 'c.db'}"
    assert main(["console", "--backend", url, "--app", "console_app_mod:app"]) == 0
    assert (seen["backend"], seen["namespace"]) == (url, "shop-console")
    assert main(["console", "--backend", url, "--app", "no_such_console_mod:app"]) == 2
    assert capsys.readouterr().err.startswith("error: cannot import 'no_such_console_mod'")


def test_health_json_and_one_casing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = _database_with_runs(tmp_path, 1)
    status = main(["health", "--backend", url, "--json"])
    out = capsys.readouterr().out
    assert status == 0
    assert json.loads(out) == {
        "namespace": "shop", "storeLost": None, "groups": [], "orphanedQueues": [],
        "crashLoops": [], "flowControl": [],
    }
    status = main(["schedules", "add", "nightly", "order", "--every", "60", "--backend", url])
    assert status == 0
    capsys.readouterr()
    status = main(["schedules", "list", "--json", "--backend", url])
    [row] = json.loads(capsys.readouterr().out)
    keys = set(row)
    assert {"lastTick", "nextTick", "catchUp", "maxCatchUp"} <= keys
    assert not [key for key in keys if "_" in key]
    status = main(["health", "--backend", url, "--json", "--watch"])
    assert status == 2
    assert capsys.readouterr().err == (
        "error: --json prints one reading: not with --watch or --prometheus\n"
    )
