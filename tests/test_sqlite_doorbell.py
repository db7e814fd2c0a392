"""The SQLite broker's cross-process doorbell (``durable_trio/_sqlite/_doorbell.py``).

A push by one broker wakes another broker's waiter at once through a Unix datagram socket
beside the file; the ``data_version`` tick stays as the safety net for everything the doorbell
loses (socket or folder removed, a folder that cannot hold sockets, a dead process's socket).
Tests that prove the doorbell did the waking set ``wakeup_interval`` far beyond their bounds.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio

from durable_trio._sqlite import Doorbell, bells_folder
from durable_trio._sqlite import _doorbell as doorbell_module
from durable_trio.brokers import Job
from durable_trio.brokers.sqlite import SqliteBroker

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

Q = "bell"
NEVER = 3600.0
"""A tick period no test waits for: whatever wakes within the test's bound is the doorbell."""


def job(n: int) -> Job:
    return Job(f"job-{n}", b"{}")


def sockets(db_path: str | os.PathLike[str]) -> list[str]:
    folder = f"{db_path}.bells"
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def foreign_socket(db_path: str, name: str) -> socket.socket:
    """A socket bound in the doorbell folder by someone who is not a broker."""
    folder = f"{db_path}.bells"
    os.makedirs(folder, exist_ok=True)
    bound = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    bound.bind(f"{folder}/{name}")
    return bound


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A short folder of its own, in place of pytest's: a Unix socket's path holds at most 107
    bytes, and pytest's folders under xdist (``/tmp/pytest-of-USER/pytest-N/popen-gwK/
    test_name0/``) leave too little of them for ``durable.db.bells/<pid>-<random>`` (the
    broker then says so and falls back to its tick, which is not what these tests check)."""
    folder = tempfile.mkdtemp(prefix="dt-bell-")
    try:
        yield Path(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "durable.db"


async def open_pair(db_path: Path, tick: float) -> tuple[SqliteBroker, SqliteBroker]:
    return (
        await SqliteBroker.open(db_path, wakeup_interval=tick),
        await SqliteBroker.open(db_path, wakeup_interval=tick),
    )


@pytest.fixture
async def pair(db_path: Path) -> AsyncIterator[tuple[SqliteBroker, SqliteBroker]]:
    a, b = await open_pair(db_path, NEVER)
    try:
        yield a, b
    finally:
        await a.aclose()
        await b.aclose()


async def wake_time(
    waiting: SqliteBroker, push: SqliteBroker, *, bound: float, queue: str = Q
) -> float:
    """Seconds from ``push``'s push to ``waiting``'s waiter waking (fails past ``bound``)."""
    woke = trio.Event()

    async def waiter() -> None:
        await waiting.wait_for_work(queue)
        woke.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.sleep(0.05)  # the waiter looked, found nothing, and sleeps
        assert not woke.is_set()
        start = trio.current_time()
        await push.push_on(queue, job(1))
        with trio.fail_after(bound):
            await woke.wait()
    return trio.current_time() - start


# ----------------------------------------------------------------------- one process


async def test_a_push_by_another_broker_on_the_file_wakes_a_waiter_without_the_tick(
    pair: tuple[SqliteBroker, SqliteBroker],
) -> None:
    a, b = pair
    assert a.doorbell is not None
    assert b.doorbell is not None
    elapsed = await wake_time(a, b, bound=0.5)
    print(f"woken {elapsed * 1000:.2f} ms after the push (tick {NEVER:g} s)")
    assert a.doorbell.received >= 1
    assert b.doorbell.sent == 1  # the waiter's socket only: b binds none, and skips its own
    assert await a.pop_from(Q) is not None


async def test_each_of_two_waiting_brokers_is_woken_by_the_others_push(
    pair: tuple[SqliteBroker, SqliteBroker],
) -> None:
    a, b = pair
    assert await wake_time(a, b, bound=0.5) < 0.5
    assert await a.pop_from(Q) is not None
    assert await wake_time(b, a, bound=0.5) < 0.5  # now both listen: a rings b, not itself
    assert a.doorbell is not None
    assert b.doorbell is not None
    assert len(sockets(a.path)) == 2


async def test_writes_that_make_no_work_ready_ring_no_one(
    pair: tuple[SqliteBroker, SqliteBroker],
) -> None:
    a, b = pair
    assert b.doorbell is not None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.wait_for_work, Q)
        await trio.sleep(0.05)
        await b.push_on("elsewhere", job(1))  # rings: a push, any queue
        sent = b.doorbell.sent
        claimed = await b.pop_from("elsewhere")
        assert claimed is not None
        assert await b.complete_job(claimed.lease, "elsewhere")
        assert await b.pop_from(Q) is None
        # A consumer acknowledging and claiming, pushing nothing (issue 30, item 8: each of
        # these woke every other process, which then waited out the gap for its next ring).
        await b.push_on("elsewhere", job(2))
        sent = b.doorbell.sent
        claimed = await b.pop_from("elsewhere")
        assert claimed is not None
        done, more = await b.finish_and_claim("results", [], "elsewhere", [claimed.lease], 5)
        assert (done, more) == ([True], [])
        assert b.doorbell.sent == sent
        nursery.cancel_scope.cancel()


async def test_a_delayed_push_by_another_broker_wakes_the_waiter_when_due_not_before(
    pair: tuple[SqliteBroker, SqliteBroker],
) -> None:
    """A delayed push rings without naming its queue: the waiter's broker looks (a tick) and
    learns the due time, instead of popping at once for nothing."""
    a, b = pair
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.wait_for_work, Q)
        await trio.sleep(0.05)
        ticks = a.connection.ticks
        start = trio.current_time()
        await b.push_on(Q, job(1), delay=0.3)
        with trio.fail_after(2):
            await a.wait_for_work(Q)
        elapsed = trio.current_time() - start
        assert a.connection.ticks > ticks  # the ring's tick (the period is an hour)
        nursery.cancel_scope.cancel()
    assert 0.25 <= elapsed < 0.3 + 0.25


async def test_an_idle_waiting_broker_does_nothing_but_its_safety_tick(db_path: Path) -> None:
    a, b = await open_pair(db_path, 0.1)
    try:
        assert a.doorbell is not None
        async with trio.open_nursery() as nursery:
            for n in range(5):
                nursery.start_soon(a.wait_for_work, f"{Q}:{n}")
            await trio.sleep(0.05)
            executed, ticks = a.connection.executed, a.connection.ticks
            await trio.sleep(1.0)
            assert a.connection.executed == executed
            assert 5 <= a.connection.ticks - ticks <= 12  # ~10 ticks of 0.1 s, no more
            assert a.doorbell.received == 0
            nursery.cancel_scope.cancel()
    finally:
        await a.aclose()
        await b.aclose()


async def test_closing_a_broker_stops_its_thread_and_removes_its_socket(db_path: Path) -> None:
    broker = await SqliteBroker.open(db_path, wakeup_interval=NEVER)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(broker.wait_for_work, Q)
        await trio.sleep(0.05)
        assert len(sockets(db_path)) == 1
        nursery.cancel_scope.cancel()
    start = time.monotonic()
    await broker.aclose()
    assert time.monotonic() - start < 1.0
    assert sockets(db_path) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("durable-trio-doorbell:")]


def test_rings_within_the_minimum_gap_are_gathered_into_one_wake_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(doorbell_module, "MIN_GAP", 0.2)
    calls: list[tuple[float, frozenset[str] | None]] = []
    listener = Doorbell(str(tmp_path / "x.db"), lambda q: calls.append((time.monotonic(), q)))
    ringer = Doorbell(str(tmp_path / "x.db"), lambda q: None)
    try:
        listener.listen()
        ringer.ring("first")
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.001)
        for name in ("a", "b", "c", "d"):
            ringer.ring(name)
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # nothing more comes
        assert [q for _, q in calls] == [frozenset({"first"}), frozenset("abcd")]
        assert calls[1][0] - calls[0][0] >= 0.19
        assert listener.received == 2
    finally:
        listener.close()
        ringer.close()


def test_rings_nobody_here_waits_for_are_handed_over_at_once_and_open_no_gap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30, item 8: another process's traffic on a queue nobody here waits on (an engine's
    results, seen by a worker) is no wake-up: the ring that follows, for a queue we wait on,
    wakes at once instead of waiting out the gap the first would have opened."""
    monkeypatch.setattr(doorbell_module, "MIN_GAP", 10.0)  # longer than any bound below
    path = str(tmp_path / "x.db")
    seen: list[frozenset[str] | None] = []
    woken = threading.Semaphore(0)

    def on_ring(queues: frozenset[str] | None) -> None:
        seen.append(queues)
        woken.release()

    listener = Doorbell(path, on_ring, interested=lambda q: q is None or "tasks" in q)
    ringer = Doorbell(path, lambda q: None)
    try:
        listener.listen()
        ringer.ring("tasks")
        assert woken.acquire(timeout=5)
        for _ in range(3):
            ringer.ring("results")
            assert woken.acquire(timeout=5), "a ring of no interest waited for the gap"
        assert listener.received == 1  # only the first was a wake-up
        ringer.ring("tasks")  # within the 10 s gap of the first wake-up: gathered, as before
        assert not woken.acquire(timeout=0.3)
        assert frozenset({"results"}) in seen
    finally:
        listener.close()
        ringer.close()


def test_a_ring_that_answers_ours_waits_only_the_answer_gap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30, item 8: request/reply back to back (each side rings the other once, then
    waits for the answer) wakes after ANSWER_GAP (none), not the whole gap, every time, though
    each answer comes within the gap of the last wake-up; a ring that answers nothing of ours
    still waits the gap out."""
    monkeypatch.setattr(doorbell_module, "MIN_GAP", 10.0)  # longer than any bound below
    path = str(tmp_path / "x.db")
    woken = {"client": threading.Semaphore(0), "worker": threading.Semaphore(0)}
    client = Doorbell(path, lambda q: woken["client"].release())
    worker = Doorbell(path, lambda q: woken["worker"].release())
    try:
        client.listen()
        worker.listen()
        for n in range(5):
            client.ring(f"request-{n}")
            assert woken["worker"].acquire(timeout=5), f"request {n} waited for the gap"
            worker.ring(f"reply-{n}")
            assert woken["client"].acquire(timeout=5), f"reply {n} waited for the gap"
        assert worker.skipped_gaps == 4  # its first wake-up had no gap to skip
        assert client.skipped_gaps == 4
        client.ring("request-5")
        assert woken["worker"].acquire(timeout=5)
        # The worker has not answered: another ring within the gap gathers, as a stream's.
        client.ring("more")
        assert not woken["worker"].acquire(timeout=0.3)
        assert worker.received == 6
    finally:
        client.close()
        worker.close()


def test_the_doorbell_folder_sits_beside_the_file_and_memory_databases_have_none(
    tmp_path: Path,
) -> None:
    assert bells_folder(str(tmp_path / "x.db")) == f"{tmp_path / 'x.db'}.bells"
    assert bells_folder(f"file:{tmp_path / 'x%20y.db'}?mode=rwc") == f"{tmp_path / 'x y.db'}.bells"
    assert bells_folder(":memory:") is None
    assert bells_folder("file:shared?mode=memory&cache=shared") is None


# ----------------------------------------------------------------------- the doorbell lost


async def test_a_waiter_whose_socket_was_removed_wakes_by_the_tick_and_binds_a_new_one(
    db_path: Path,
) -> None:
    a, b = await open_pair(db_path, 0.2)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.wait_for_work, "other")  # keeps a listening throughout
            await trio.sleep(0.05)
            (old,) = sockets(db_path)
            os.unlink(f"{db_path}.bells/{old}")
            await b.push_on("other", job(0))  # finds no socket: no error
            assert await wake_time(a, b, bound=2.0) < 2.0  # the tick
            (new,) = sockets(db_path)  # the tick bound a fresh socket
            assert new != old
            assert await a.pop_from(Q) is not None
            assert a.doorbell is not None
            received = a.doorbell.received
            await wake_time(a, b, bound=2.0)
            assert a.doorbell.received > received  # the doorbell rings again
            nursery.cancel_scope.cancel()
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_removed_folder_is_survived_by_pushes_and_made_again_by_the_waiter(
    db_path: Path,
) -> None:
    a, b = await open_pair(db_path, 0.2)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.wait_for_work, "other")
            await trio.sleep(0.05)
            shutil.rmtree(f"{db_path}.bells")
            assert await wake_time(a, b, bound=2.0) < 2.0
            await trio.sleep(0.3)
            assert len(sockets(db_path)) == 1
            nursery.cancel_scope.cancel()
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_folder_that_cannot_hold_sockets_leaves_the_tick_with_one_log_line(
    db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A plain file where the folder goes: mkdir and bind fail, even for root.
    (db_path.parent / f"{db_path.name}.bells").write_bytes(b"")
    a, b = await open_pair(db_path, 0.2)
    try:
        with caplog.at_level(logging.WARNING, logger="durable_trio"):
            assert await wake_time(a, b, bound=2.0) < 2.0
            assert await a.pop_from(Q) is not None
            assert await wake_time(a, b, bound=2.0) < 2.0
        assert a.doorbell is not None
        assert not a.doorbell.bound
        warnings = [r for r in caplog.records if "SQLite doorbell" in r.getMessage()]
        assert len(warnings) == 2  # one line per broker (a binds, b rings), not per push
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_path_too_long_for_a_unix_socket_is_reached_through_the_folders_descriptor(
    tmp_path: Path,
) -> None:
    # sun_path holds 107 bytes: the socket is bound and rung as /proc/self/fd/<fd>/<name>.
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    assert len(os.fsencode(f"{deep}/durable.db.bells/{os.getpid()}-{'0' * 12}")) > 107
    a, b = await open_pair(deep / "durable.db", NEVER)
    try:
        assert await wake_time(a, b, bound=0.5) < 0.5  # the doorbell, not the tick
        assert a.doorbell is not None
        assert a.doorbell.bound
        assert b.doorbell is not None
        assert b.doorbell.sent == 1
        assert len(sockets(deep / "durable.db")) == 1  # the file lands in the real folder
        assert await a.pop_from(Q) is not None
        # The folder removed and made again: the ringer's old descriptor names a deleted
        # folder; it takes a fresh one and rings again.
        shutil.rmtree(f"{deep}/durable.db.bells")
        a.doorbell.check()  # what the waiter's tick does: bind again, in a new folder
        assert len(sockets(deep / "durable.db")) == 1
        assert await wake_time(a, b, bound=0.5) < 0.5
    finally:
        await a.aclose()
        await b.aclose()
    assert sockets(deep / "durable.db") == []


async def test_without_proc_self_fd_a_path_too_long_leaves_the_tick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(doorbell_module, "_PROC_FDS", str(tmp_path / "no-proc"))  # not Linux
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    a, b = await open_pair(deep / "durable.db", 0.2)
    try:
        assert await wake_time(a, b, bound=2.0) < 2.0
        assert a.doorbell is not None
        assert not a.doorbell.bound
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_dead_processes_socket_is_unlinked_by_the_next_ring(
    pair: tuple[SqliteBroker, SqliteBroker],
) -> None:
    a, b = pair
    foreign_socket(a.path, "1-dead").close()  # the file stays, nobody reads it: as after kill -9
    assert await wake_time(a, b, bound=0.5) < 0.5
    assert b.doorbell is not None
    assert b.doorbell.unlinked == 1
    assert "1-dead" not in sockets(a.path)


async def test_a_socket_whose_buffer_is_full_is_skipped_without_an_error(
    pair: tuple[SqliteBroker, SqliteBroker],
) -> None:
    a, b = pair
    deaf = foreign_socket(a.path, "1-deaf")  # alive, never reads: its queue fills up
    try:
        for n in range(200):
            await b.push_on(Q, job(n))  # none blocks, none raises
        assert b.doorbell is not None
        assert b.doorbell.unlinked == 0
        assert "1-deaf" in sockets(a.path)
        assert await a.size_of(Q) == 200
    finally:
        deaf.close()


async def test_a_ring_that_cannot_name_its_queue_makes_the_waiter_tick(
    pair: tuple[SqliteBroker, SqliteBroker],
) -> None:
    a, b = pair
    long_name = "q" * 2000  # over a datagram's name limit: the ring names no queue
    ticks = a.connection.ticks
    await wake_time(a, b, bound=0.5, queue=long_name)
    assert a.connection.ticks > ticks  # the tick (period 3600 s) ran at the ring


async def test_a_broker_opened_without_a_doorbell_makes_no_folder_and_wakes_by_the_tick(
    db_path: Path,
) -> None:
    a = await SqliteBroker.open(db_path, wakeup_interval=0.1, doorbell=False)
    b = await SqliteBroker.open(db_path, wakeup_interval=0.1, doorbell=False)
    try:
        assert a.doorbell is None
        assert await wake_time(a, b, bound=2.0) < 2.0
        assert not await trio.Path(f"{db_path}.bells").exists()
    finally:
        await a.aclose()
        await b.aclose()


# ----------------------------------------------------------------------- real processes

PUSHER = """
import sys, time, trio
from durable_trio.brokers import Job
from durable_trio.brokers.sqlite import SqliteBroker

async def main(path):
    async with await SqliteBroker.open(path) as broker:
        for n in range(5):
            await trio.sleep(0.3)
            print(f"{time.time():.6f}", flush=True)
            await broker.push_on("bell", Job(f"job-{n}", b"{}"))

trio.run(main, sys.argv[1])
"""

WAITER = """
import sys, trio
from durable_trio.brokers.sqlite import SqliteBroker

async def main(path):
    broker = await SqliteBroker.open(path, wakeup_interval=30)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(broker.wait_for_work, "bell")
        await trio.sleep(0.2)
        print("waiting", flush=True)
        await trio.sleep_forever()

trio.run(main, sys.argv[1])
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


@pytest.mark.chaos
async def test_a_push_in_another_process_wakes_a_waiter_within_milliseconds(
    tmp_path: Path, db_path: Path
) -> None:
    script = tmp_path / "pusher.py"
    script.write_text(PUSHER)
    broker = await SqliteBroker.open(db_path, wakeup_interval=30)
    delays: list[float] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(broker.wait_for_work, "warm-up")  # listening before the child
            await trio.sleep(0.05)
            process = await nursery.start(
                partial(trio.run_process, stdout=subprocess.PIPE, env=_env()),
                [sys.executable, str(script), str(db_path)],
            )
            assert process.stdout is not None
            lines = _Lines(process.stdout)
            with trio.fail_after(30):
                for n in range(5):
                    await broker.wait_for_work(Q)
                    woke = time.time()
                    pushed = float(await lines.receive_line())
                    delays.append(woke - pushed)
                    claimed = await broker.pop_from(Q)
                    assert claimed is not None
                    assert claimed.id == f"job-{n}"
            nursery.cancel_scope.cancel()
    finally:
        await broker.aclose()
    print("cross-process wake-ups (ms):", " ".join(f"{d * 1000:.2f}" for d in delays))
    assert max(delays) < 0.5  # the tick is 30 s: the doorbell did it


@pytest.mark.chaos
async def test_kill_9_of_a_waiting_process_leaves_a_socket_the_next_ring_unlinks(
    tmp_path: Path, db_path: Path
) -> None:
    script = tmp_path / "waiter.py"
    script.write_text(WAITER)
    async with await SqliteBroker.open(db_path, wakeup_interval=NEVER) as broker:
        command = [sys.executable, str(script), str(db_path)]
        child = await trio.to_thread.run_sync(
            lambda: subprocess.Popen(command, stdout=subprocess.PIPE, env=_env())
        )
        try:
            assert child.stdout is not None
            line = await trio.to_thread.run_sync(child.stdout.readline)
            assert line.strip() == b"waiting"
            assert len(sockets(db_path)) == 1
        finally:
            child.kill()
            child.wait()
            assert child.stdout is not None
            child.stdout.close()
        assert len(sockets(db_path)) == 1  # kill -9: nobody removed it
        await broker.push_on(Q, job(1))  # no error reaches the push
        assert sockets(db_path) == []
        assert broker.doorbell is not None
        assert broker.doorbell.unlinked == 1


class _Lines:
    """Lines of a child's stdout, read without blocking the event loop."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = b""

    async def receive_line(self) -> str:
        while b"\n" not in self._buffer:
            chunk = await self._stream.receive_some()
            assert chunk, "the child exited"
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()
