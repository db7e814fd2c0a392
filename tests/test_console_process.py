"""``durable-trio console`` as a real process (wall clock, bounded): it answers HTTP on
loopback, serves the runs page, and exits 0 promptly on SIGTERM and on SIGINT; beyond loopback
without a token it is refused with a one-line error."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from typing import TYPE_CHECKING

import pytest

from _redis_server import _free_port
from helpers import made_sqlite_url

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.chaos

#: Seconds the process may take to listen, and to exit after its signal.
START_BOUND = 20.0
EXIT_BOUND = 5.0


def _console(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "durable_trio", "console", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=2) as response:
        return int(response.status), response.read().decode()


def _wait_until_it_answers(process: subprocess.Popen[bytes], base: str) -> str:
    deadline = time.monotonic() + START_BOUND
    while True:
        assert process.poll() is None, process.communicate()
        try:
            status, page = _get(base + "/")
        except OSError:
            if time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"the console did not answer on {base} within {START_BOUND} s")
            time.sleep(0.1)
            continue
        assert status == 200
        return page


def _made_database(tmp_path: Path) -> str:
    """A SQLite URL whose file exists (the console opens only a database that is there)."""
    return made_sqlite_url(tmp_path / "x.db")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_console_serves_the_runs_page_and_exits_0_on_a_signal(
    tmp_path: Path, signum: signal.Signals
) -> None:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    process = _console("--backend", _made_database(tmp_path), "--port", str(port))
    try:
        page = _wait_until_it_answers(process, base)
        assert "Runs" in page
        process.send_signal(signum)
        started = time.monotonic()
        out, err = process.communicate(timeout=EXIT_BOUND)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err.decode()
    assert time.monotonic() - started < EXIT_BOUND
    assert f"console: {base}" in out.decode()


def test_beyond_loopback_without_a_token_is_refused_in_one_line(tmp_path: Path) -> None:
    process = _console(
        "--backend", f"sqlite:///{tmp_path / 'x.db'}", "--host", "0.0.0.0", "--port", "0"
    )
    out, err = process.communicate(timeout=START_BOUND)
    assert process.returncode == 2, (out, err)
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error:")
    assert "token" in lines[0]
