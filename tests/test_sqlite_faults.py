"""SQLite under faults of its file (issue 36): a write lock held past ``busy_timeout``, a full
disk, the file deleted or replaced under live processes, many processes opening a new file at
once, and a file that should shrink after its backlog drains.

Real files, real locks (another connection), a real small file system (a 16 MiB tmpfs, mounted
when this runs as root) and real processes; the broker's clock is the wall clock, so every wait
is short and bounded by ``fail_after``.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest
import trio

import durable_trio as dt
from durable_trio._engine import App, WorkflowContext, open_engine, open_worker
from durable_trio._engine._records import RunRecord, RunStatus
from durable_trio._engine._stores.sqlite import SqliteRunStore
from durable_trio._sqlite import _connection as connection_module
from durable_trio.backends._backend import Backend
from durable_trio.backends.sqlite import SqliteRunStores
from durable_trio.brokers import Job
from durable_trio.brokers.sqlite import SqliteBroker
from durable_trio.cli._health import HealthReader
from durable_trio.keys.sqlite import SqliteKeyStore

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator
    from pathlib import Path

NS = "faults"

app = App(NS)


@app.step("work")
async def work(n: int) -> str:
    return "x" * 400 + str(n)  # a little weight: the file grows with every checkpoint


@app.workflow("chain")
async def chain(ctx: WorkflowContext, n: int) -> int:
    return sum([len(await ctx.step("work", n * 10 + i)) for i in range(4)])


@app.step("heavy")
async def heavy(n: int) -> str:
    return "y" * 20_000 + str(n)


@app.workflow("heavy")
async def heavy_chain(ctx: WorkflowContext, n: int) -> int:
    await ctx.sleep(0.3)  # the disk is full by then: every checkpoint after needs new space
    return sum([len(await ctx.step("heavy", n * 10 + i)) for i in range(4)])


def expected_heavy(n: int) -> int:
    return sum(20_000 + len(str(n * 10 + i)) for i in range(4))


def expected(n: int) -> int:
    return sum(400 + len(str(n * 10 + i)) for i in range(4))


def run_record(run_id: str) -> RunRecord:
    return RunRecord(run_id, "chain", 1, RunStatus.PENDING, 0.0, 0.0)


@contextlib.asynccontextmanager
async def sqlite_backend(path: Path, *, busy_timeout: float = 5.0) -> AsyncIterator[Backend]:
    """What ``open_backend("sqlite:///...")`` builds, with a short ``busy_timeout``."""
    broker = await SqliteBroker.open(path, busy_timeout=busy_timeout)
    keys = await SqliteKeyStore.attach(broker)
    backend = Backend(
        url=f"sqlite:///{path}", broker=broker, keys=keys, run_stores=SqliteRunStores(broker)
    )
    try:
        yield backend
    finally:
        with trio.CancelScope(shield=True):
            await backend.aclose()


@contextlib.contextmanager
def write_lock(path: Path) -> Iterator[sqlite3.Connection]:
    """Another connection holding ``path``'s write lock until the block ends."""
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        yield other
    finally:
        other.execute("ROLLBACK")
        other.close()


# ------------------------------------------------------------------------ item 4: the lock


async def test_every_writer_of_a_failed_batch_gets_its_own_retryable_error(
    tmp_path: Path,
) -> None:
    """20 writes batched into one transaction that cannot take the lock: each writer raises
    its own BrokerUnavailable (before: the first did, the 19 others outcome.AlreadyUsedError,
    which no loop retries), and each succeeds when retried after the lock is gone."""
    path = tmp_path / "locked.db"
    store = await SqliteRunStore.open(path, NS, busy_timeout=0.1)
    try:
        raised: dict[int, BaseException] = {}

        async def write(n: int) -> None:
            try:
                await store.create_run(run_record(f"run-{n}"))
            except Exception as exc:
                raised[n] = exc

        with write_lock(path):
            async with trio.open_nursery() as nursery:
                for n in range(20):
                    nursery.start_soon(write, n)
        assert sorted(raised) == list(range(20))
        assert all(type(exc) is dt.BrokerUnavailable for exc in raised.values()), raised
        assert len({id(exc) for exc in raised.values()}) == 20  # each its own
        assert all("locked" in str(exc) for exc in raised.values())
        assert store.batches < 20  # they were one batch (or a few): the case in question
        async with trio.open_nursery() as nursery:
            for n in range(20):
                nursery.start_soon(store.create_run, run_record(f"run-{n}"))
        assert len(await store.list_runs()) == 20
    finally:
        await store.aclose()


async def test_the_engine_carries_on_after_another_process_held_the_write_lock(
    tmp_path: Path,
) -> None:
    """An engine and a worker driving runs while another connection holds the write lock
    past their ``busy_timeout``: they report it and retry; once the lock goes, every run
    finishes (before: the engine died of AlreadyUsedError)."""
    path = tmp_path / "held.db"
    reported: list[BaseException] = []
    runs = 12
    async with sqlite_backend(path, busy_timeout=0.05) as backend:
        async with (
            open_worker(app, backend, namespace=NS, on_error=reported.append),
            open_engine(
                app, backend, namespace=NS, on_error=reported.append, reconcile_interval=0.2
            ) as engine,
        ):
            ids = [await engine.start("chain", n, run_id=f"run-{n}") for n in range(runs)]
            for _ in range(3):  # three outages, mid-flight
                with write_lock(path):
                    await trio.sleep(0.6)  # 12 busy timeouts
                await trio.sleep(0.1)
            with trio.fail_after(30):
                results = [await engine.result(run_id) for run_id in ids]
    assert results == [expected(n) for n in range(runs)]
    assert any("locked" in str(exc) for exc in reported)
    assert not [exc for exc in reported if "AlreadyUsed" in repr(exc)]


# -------------------------------------------------------------------- item 4: a full disk


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 16 MiB file system (tmpfs, mounted for this test; it needs root): room for
    SQLite's WAL, which grows to 4 MiB before its checkpoint."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if made.returncode != 0:
        pytest.skip("mounting a small tmpfs is not permitted here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill_disk(mount: Path) -> Path:
    """Write a file until the file system is full; returns it (remove it to free the space)."""
    filler = mount / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        with contextlib.suppress(OSError):  # unbuffered: nothing left to fail at close
            while os.write(fd, b"\0" * 4096):
                pass
    finally:
        os.close(fd)
    return filler


async def test_a_full_disk_is_reported_and_waited_out(small_disk: Path) -> None:
    """The disk fills while an engine and a worker drive runs: the full disk is reported (as
    such), nothing dies; once space returns every run finishes, nothing lost."""
    path = small_disk / "full.db"
    reported: list[BaseException] = []
    runs = 30
    async with sqlite_backend(path, busy_timeout=1.0) as backend:
        async with (
            open_worker(app, backend, namespace=NS, on_error=reported.append),
            open_engine(
                app,
                backend,
                namespace=NS,
                on_error=reported.append,
                reconcile_interval=0.2,
                run_lease=2.0,
            ) as engine,
        ):
            ids = [await engine.start("heavy", n, run_id=f"run-{n}") for n in range(runs)]
            filler = fill_disk(small_disk)
            with trio.fail_after(20):
                while not any("full" in str(exc) for exc in reported):  # noqa: ASYNC110
                    await trio.sleep(0.05)
            await trio.sleep(1.0)  # full for a while: every loop meets it
            filler.unlink()
            with trio.fail_after(60):
                results = [await engine.result(run_id) for run_id in ids]
    assert results == [expected_heavy(n) for n in range(runs)]
    full = [exc for exc in reported if "disk is full" in str(exc)]
    assert full, reported
    assert not [exc for exc in reported if "AlreadyUsed" in repr(exc)]
    assert not [exc for exc in reported if "savepoint" in str(exc)]  # the real error, said


# ------------------------------------------------- item 7: concurrent openers of a new file


async def test_opening_a_new_file_waits_for_another_opener_holding_its_lock(
    tmp_path: Path,
) -> None:
    """Another connection creating its tables in a new file (rollback mode, its reserved lock
    held) while we open it: SQLite refuses our switch to WAL at once, busy handler or not (it
    would deadlock); the open tries again until the other is done (before: "database is
    locked" at once, what killed a worker or an engine started together on a new file)."""
    path = tmp_path / "new.db"
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    other.execute("CREATE TABLE theirs (x)")

    async def finish_later() -> None:
        await trio.sleep(0.3)
        other.execute("COMMIT")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(finish_later)
        with trio.fail_after(5):
            broker = await SqliteBroker.open(path, busy_timeout=2.0)
    other.close()
    async with broker:
        await broker.push_on("q", Job("1", b"{}"))
        assert await broker.size_of("q") == 1
    (mode,) = sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()
    assert mode == "wal"


def opener(url: str, kind: str, at: float) -> None:
    """(A child process.) Open a worker or an engine on ``url`` at wall-clock ``at``."""
    import time

    async def main() -> None:
        await trio.sleep(max(0.0, at - time.time()))
        async with dt.open_backend(url) as backend:
            if kind == "engine":
                async with open_engine(app, backend, namespace=NS):
                    pass
            else:
                async with open_worker(app, backend, namespace=NS):
                    pass
        print("up", flush=True)

    trio.run(main)


@pytest.mark.chaos
async def test_a_worker_and_an_engine_started_together_on_a_new_file_both_come_up(
    tmp_path: Path,
) -> None:
    """15 times: a worker process and an engine process open the same new file at the same
    instant; both come up (before: one died of "database is locked" now and then)."""
    import time

    failures = []
    for attempt in range(15):
        url = "sqlite:///" + str(tmp_path / f"new-{attempt}.db")
        at = time.time() + 1.2  # both imported by then: they open together
        procs = [
            await trio.lowlevel.open_process(
                [sys.executable, __file__, url, kind, repr(at)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for kind in ("worker", "engine")
        ]
        with trio.fail_after(30):
            for proc in procs:
                assert proc.stdout is not None
                assert proc.stderr is not None
                out = await proc.stdout.receive_some(1 << 16)
                err = b""
                while chunk := await proc.stderr.receive_some(1 << 16):
                    err += chunk
                await proc.wait()
                if proc.returncode != 0 or b"up" not in out:
                    failures.append((attempt, err.decode(errors="replace")[-400:]))
    assert not failures, failures


# ------------------------------------------------- item 3: the file deleted or replaced


def remove_database(path: Path) -> None:
    """``rm file.db file.db-wal file.db-shm``, as an operator resetting a store would."""
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{path}{suffix}")


async def wait_reported(reported: list[BaseException], words: str) -> BaseException:
    with trio.fail_after(10):
        while True:
            for exc in reported:
                for error in (exc, exc.__cause__):
                    if isinstance(error, dt.StoreLost) and words in str(error):
                        return error
            await trio.sleep(0.05)


@pytest.mark.parametrize("how", ["deleted", "replaced"])
async def test_a_file_deleted_or_replaced_under_a_live_engine_and_worker_is_said_loudly(
    tmp_path: Path, how: str
) -> None:
    """An engine and a worker (two connections) serve runs; the file is deleted (or another
    store is moved over it). Each says so, naming the file and what happened: the engine's
    next write raises StoreLost, the worker's loops report it, health reads raise it; nothing
    more is written to the file nobody else reaches (before: they went on writing there
    silently, and runs started by a new process on the new file stayed pending)."""
    path = tmp_path / "live.db"
    reported: list[BaseException] = []
    async with (
        sqlite_backend(path) as worker_side,
        sqlite_backend(path) as engine_side,
        open_worker(app, worker_side, namespace=NS, on_error=reported.append),
        open_engine(app, engine_side, namespace=NS, on_error=reported.append) as engine,
    ):
        assert isinstance(worker_side.broker, SqliteBroker)
        with trio.fail_after(10):
            assert await engine.result(await engine.start("chain", 1)) == expected(1)
        if how == "deleted":
            remove_database(path)
            words = f"{str(path)!r} was deleted"
        else:
            other = tmp_path / "other.db"
            async with sqlite_backend(other):  # another store, stamped
                pass
            os.replace(other, path)
            words = f"{str(path)!r} was replaced by another file"
        # The engine's next write is refused, with the reason.
        with pytest.raises(dt.StoreLost, match=words.replace("(", r"\(")):
            await engine.start("chain", 2, run_id="after")
        # The worker, waiting for work, notices at its next look and reports it.
        error = await wait_reported(reported, words)
        assert "restart the process" in str(error)
        assert worker_side.broker.lost is not None
        assert words in worker_side.broker.lost
        # Health read through either says it too.
        reader = HealthReader(worker_side, NS)
        with pytest.raises(dt.StoreLost, match="restart the process"):
            await reader.read()
        assert reader.errors == 1
    # Nothing of the run started after reached a file: the path holds no such run.
    if how == "replaced":
        async with sqlite_backend(path) as fresh, fresh.open_run_store(NS) as store:
            assert await store.get_run("after") is None


async def test_a_file_overwritten_in_place_is_noticed_by_its_stamp(tmp_path: Path) -> None:
    """Another store's bytes written over the file in place keep its inode; the store stamp
    differs, and the next call after IDENTITY_CHECK_INTERVAL raises StoreLost."""
    path = tmp_path / "inplace.db"
    broker = await SqliteBroker.open(path)
    async with broker:
        await broker.push_on("q", Job("1", b"{}"))
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("UPDATE dt_meta SET value = value + 1 WHERE name = 'store'")
        db.close()
        await trio.sleep(1.0)  # IDENTITY_CHECK_INTERVAL: the stamp is read again
        with pytest.raises(dt.StoreLost, match="overwritten in place"):
            await broker.size_of("q")
        with pytest.raises(dt.StoreLost):  # and stays so
            await broker.push_on("q", Job("2", b"{}"))


async def test_a_write_ahead_log_deleted_under_a_live_connection_is_said_and_written_back(
    tmp_path: Path,
) -> None:
    """``rm file.db-wal`` under live processes: they went on committing into the unlinked log,
    which nobody else reads and a killed process loses, without a word, while every process
    started since failed with ``disk I/O error (SQLITE_IOERR_SHORT_READ)``. The next write
    says so (StoreLost) after writing the log back into the file, and stays refused."""
    path = tmp_path / "wal.db"

    def in_the_file() -> int:
        """Jobs in the file itself, as after a crash (its -wal and -shm ignored)."""
        db = sqlite3.connect(f"file:{path}?immutable=1", uri=True)
        try:
            ((count,),) = db.execute("SELECT count(*) FROM dt_jobs").fetchall()
        except sqlite3.OperationalError:  # no such table: even the schema is in the log
            return 0
        finally:
            db.close()
        return int(count)

    async with await SqliteBroker.open(path) as broker:
        await broker.push_on("q", Job("1", b"{}"))
        assert in_the_file() == 0  # (committed into the log only)
        os.unlink(f"{path}-wal")
        with pytest.raises(dt.StoreLost, match=r"write-ahead log .* was deleted") as lost:
            await broker.push_on("q", Job("2", b"{}"))
        assert "what it held was written back into the file" in str(lost.value)
        assert in_the_file() == 1  # job 1 is safe in the file, whatever happens next
        with pytest.raises(dt.StoreLost):  # and stays refused
            await broker.size_of("q")


# ------------------------------------------- item 10: space given back after a drain


async def test_a_drained_backlog_gives_its_space_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backlog of ~24 MiB pushed and drained: the new file is incremental-vacuum, and the
    idle connection gives the free pages back step by step until the file is small again
    (before: it stayed at its largest)."""
    monkeypatch.setattr(connection_module, "MAINTENANCE_INTERVAL", 0.05)
    path = tmp_path / "drained.db"
    payload = b"z" * 4000
    async with await SqliteBroker.open(path) as broker:
        for start in range(0, 6000, 500):
            jobs = [Job(f"j{n}", payload) for n in range(start, start + 500)]
            await broker.push_many("q", jobs, [None] * len(jobs))
        await trio.sleep(0.2)  # (a look now finds nothing free yet)
        peak = path.stat().st_size
        assert peak > 20_000_000
        while claims := await broker.pop_many("q", 500):
            await broker.complete_many("q", [c.lease for c in claims])
        with trio.fail_after(20):
            while path.stat().st_size > peak // 8:  # noqa: ASYNC110
                await trio.sleep(0.05)
        assert broker.connection.pages_freed > 5000
        await broker.push_on("q", Job("after", b"{}"))  # and it works as before
        assert (await broker.pop_from("q")) is not None
    (mode,) = sqlite3.connect(path).execute("PRAGMA auto_vacuum").fetchone()
    assert mode == 2  # incremental


async def test_an_older_file_keeps_its_mode_and_works(tmp_path: Path) -> None:
    """A file made before (auto_vacuum NONE, tables in it) is left as it is."""
    path = tmp_path / "older.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE theirs (x)")
    db.commit()
    db.close()
    async with await SqliteBroker.open(path) as broker:
        await broker.push_on("q", Job("1", b"{}"))
        assert await broker.size_of("q") == 1
    (mode,) = sqlite3.connect(path).execute("PRAGMA auto_vacuum").fetchone()
    assert mode == 0


if __name__ == "__main__":
    opener(sys.argv[1], sys.argv[2], float(sys.argv[3]))
