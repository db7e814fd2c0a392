"""A SQLite file this process cannot write (a copy made read-only, a file in a read-only folder,
another user's live store): the commands that only read open it read-only, those that change
something refuse it in one line (docs/decisions.md, "Read-only SQLite files").

Real files with real permissions: as root (which writes anywhere) the commands run as
``nobody`` through ``setpriv``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio

import durable_trio as dt
from durable_trio.brokers import Job
from durable_trio.brokers.sqlite import SqliteBroker

if TYPE_CHECKING:
    from collections.abc import Iterator

#: Seconds a command may take.
BOUND = 30.0


def _as_another_user() -> list[str]:
    """The prefix that runs a command without root's power to write anywhere."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: permissions cannot bite")
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.fixture
def folder() -> Iterator[Path]:
    """A folder another user can reach (pytest's own are private to root), removed after."""
    made = Path(tempfile.mkdtemp(prefix="dt-read-only-"))
    made.chmod(0o755)
    try:
        probe = subprocess.run(
            [*_as_another_user(), sys.executable, "-c", "import durable_trio"],
            capture_output=True,
            timeout=BOUND,
            check=False,
        )
        if probe.returncode != 0:
            pytest.skip("the package cannot be imported as another user here")
        yield made
    finally:
        for path in (made, *made.rglob("*")):
            if path.is_dir():
                path.chmod(0o755)
        shutil.rmtree(made)


def _make_store(file: Path) -> None:
    """A store as an engine leaves it: a failed run, a pending one, closed cleanly."""

    async def make() -> None:
        async with dt.open_backend(f"sqlite:///{file}") as backend:
            async with backend.open_run_store("shop") as store:
                for run_id, status in (("order-17", dt.RunStatus.FAILED),
                                       ("order-18", dt.RunStatus.PENDING)):
                    await store.create_run(dt.RunRecord(run_id, "flow", 1, status, 0.0, 0.0))

    trio.run(make)
    assert not Path(f"{file}-wal").exists()  # (the last close wrote it back into the file)


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_as_another_user(), sys.executable, "-m", "durable_trio", *argv],
        capture_output=True,
        text=True,
        timeout=BOUND,
        check=False,
    )


def _digest(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


@pytest.mark.parametrize("where", ["read-only file", "read-only folder"])
def test_the_reading_commands_read_a_file_this_process_cannot_write(
    folder: Path, where: str
) -> None:
    home = folder / "copy"
    home.mkdir()
    home.chmod(0o755)
    file = home / "app.db"
    _make_store(file)
    if where == "read-only file":
        file.chmod(0o444)
        home.chmod(0o777)  # SQLite may make its -shm there (another user's: never ours)
    else:
        file.chmod(0o666)  # writable, but SQLite cannot make its -wal and -shm beside it
        home.chmod(0o555)
    before = _digest(file)
    url = f"sqlite:///{file}"

    listed = _cli("runs", "list", "--json", "--backend", url)
    assert (listed.returncode, listed.stderr) == (0, "")
    assert [run["runId"] for run in json.loads(listed.stdout)["runs"]] == [
        "order-18",
        "order-17",
    ]
    shown = _cli("runs", "show", "order-17", "--backend", url)
    assert (shown.returncode, shown.stderr) == (0, "")
    assert "status failed" in shown.stdout
    for argv in (("queues",), ("jobs", "failed"), ("schedules", "list"), ("health",)):
        done = _cli(*argv, "--backend", url)
        assert (done.returncode, done.stderr) == (0, ""), argv

    # A command that changes something refuses it in one line, and says what still works.
    cancel = _cli("runs", "cancel", "order-18", "--backend", url)
    assert cancel.returncode == 2
    assert cancel.stderr.splitlines() == [
        f"error: cannot use {str(file)!r} as the SQLite database file: "
        + ("it is not writable" if where == "read-only file" else
           "its folder is not writable (SQLite makes its -wal and -shm files there)")
        + " (the commands that only read, such as runs list, open it read-only)"
    ]  # fmt: skip
    assert _digest(file) == before
    assert not (home / "app.db.bells").exists()  # no doorbell folder made for a reader


def test_a_write_ahead_log_that_cannot_be_read_from_there_is_said_in_words(
    folder: Path,
) -> None:
    """A read-only folder holding the file and a ``-wal`` with commits, without its ``-shm``
    (a store copied while it ran): SQLite cannot read those commits from there, and reading
    the file alone (``immutable``) would show a past state as the present: refused."""
    home = folder / "copy"
    home.mkdir()
    file = home / "app.db"
    _make_store(file)
    Path(f"{file}-wal").write_bytes(b"\0" * 4096)  # (its content is never read)
    home.chmod(0o555)
    listed = _cli("runs", "list", "--backend", f"sqlite:///{file}")
    assert listed.returncode == 2
    assert listed.stderr.splitlines() == [
        f"error: cannot read {str(file)!r} read-only: its write-ahead log "
        f"{str(file) + '-wal'!r} holds commits not yet in the file, and SQLite cannot make "
        "the -shm file it needs to read them in a folder this process cannot write; copy the "
        "file with its -wal to a writable folder"
    ]


async def test_a_read_only_backend_reads_a_live_store_and_changes_nothing(
    tmp_path: Path,
) -> None:
    """``open_backend(url, existing=True, read_only=True)``: a live writer's commits are seen
    as they come; every change is refused with a BrokerError; no schema, no doorbell."""
    file = tmp_path / "live.db"
    url = f"sqlite:///{file}"
    async with dt.open_backend(url) as writer, writer.open_run_store("shop") as store:
        await store.create_run(dt.RunRecord("r-1", "flow", 1, dt.RunStatus.PENDING, 0.0, 0.0))
        async with (
            dt.open_operations(url, namespace="shop", existing=True, read_only=True) as ops,
        ):
            assert [run.run_id for run in (await ops.list_runs()).runs] == ["r-1"]
            await store.create_run(
                dt.RunRecord("r-2", "flow", 1, dt.RunStatus.PENDING, 1.0, 1.0)
            )
            assert [run.run_id for run in (await ops.list_runs()).runs] == ["r-2", "r-1"]
            with pytest.raises(dt.BrokerError, match="is open read-only"):
                await ops.cancel_run("r-1")
            with pytest.raises(dt.BrokerError, match="is open read-only"):
                await ops.backend.broker.push_on("shop:tasks:a", Job("j-1", b"{}"))
            broker = ops.backend.broker
            assert isinstance(broker, SqliteBroker)
            assert broker.doorbell is None
        run = await store.get_run("r-1")
        assert run is not None
        assert run.status is dt.RunStatus.PENDING


async def test_read_only_never_makes_a_file(tmp_path: Path) -> None:
    missing = tmp_path / "nothing.db"
    with pytest.raises(dt.ConfigError, match="no SQLite database at"):
        async with dt.open_backend(f"sqlite:///{missing}", existing=True, read_only=True):
            pass
    assert sorted(tmp_path.iterdir()) == []  # noqa: ASYNC240 (nothing made: file or sidecar)
