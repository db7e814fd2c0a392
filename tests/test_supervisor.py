"""``durable-trio worker --processes N`` (durable_trio._supervisor).

The restart policy at exact times; then real processes on a private Redis (wall clock,
bounded, marked chaos): a child killed with -9 is replaced (new pid, new instance id) and the
jobs it held come back through the stalled sweep and complete; SIGTERM or SIGINT to the
supervisor closes every child within its bound and loses no job; children that die at start
crash-loop: restarted with a bounded backoff, never given up, shown by ``health`` with their
last exit status (and exit status 3 at the close).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio

import durable_trio as dt
from durable_trio._naming import QueueNames
from durable_trio._supervisor import (
    CLOSE_MARGIN,
    CRASH_LOOP_EXIT,
    RestartPolicy,
    _Deaths,
    read_supervisors,
    resolve_processes,
)

if TYPE_CHECKING:
    from collections.abc import Callable

TESTS = Path(__file__).parent
TARGET = f"{TESTS / '_supervised_app.py'}:app"
SLACK = 4.0
BANNER = re.compile(r"\(instance (\S+), pid (\d+)\)")


# --- the policy, at exact times -------------------------------------------------------------


def test_backoff_doubles_up_to_its_bound_and_a_crash_loop_is_never_given_up() -> None:
    deaths = _Deaths(RestartPolicy(backoff_initial=0.5, backoff_max=3.0, crash_limit=5))
    assert [deaths.record(t) for t in (10.0, 10.5, 11.5, 13.5)] == [
        (0.5, False), (1.0, False), (2.0, False), (3.0, False)
    ]  # fmt: skip
    # The 5th death within 60 s: crash-looping, restarted after the bound (issue 30, item 10).
    assert deaths.record(16.5) == (3.0, True)
    assert deaths.record(19.5) == (3.0, True)
    assert deaths.looping(60.0)
    assert not deaths.looping(80.0)  # its deaths fell out of the window


def test_a_death_older_than_the_window_no_longer_counts() -> None:
    deaths = _Deaths(RestartPolicy(backoff_initial=1.0, crash_limit=3, crash_window=10.0))
    assert deaths.record(0.0) == (1.0, False)
    assert deaths.record(5.0) == (2.0, False)
    assert deaths.record(10.0) == (2.0, False)  # the death at 0.0 is one window old: gone
    assert deaths.record(14.9) == (4.0, True)  # 5.0, 10.0, 14.9: three within 10 s


def test_an_initial_delay_above_the_cap_waits_the_cap() -> None:
    """The policy's formula, ``min(initial * 2 ** (n - 1), max)``, taken from the one backoff
    helper (which refuses an initial above its cap: the policy clips it instead)."""
    deaths = _Deaths(RestartPolicy(backoff_initial=5.0, backoff_max=1.0, crash_limit=3))
    assert [deaths.record(t)[0] for t in (0.0, 1.0)] == [1.0, 1.0]


async def test_the_restart_delays_elapse_at_exact_virtual_times(autojump_clock: object) -> None:
    deaths = _Deaths(RestartPolicy(backoff_initial=0.25, backoff_max=1.0, crash_limit=4))
    start = trio.current_time()
    waits = []
    for _ in range(6):
        delay, _looping = deaths.record(trio.current_time())
        waits.append(delay)
        await trio.sleep(delay)
    assert waits == [0.25, 0.5, 1.0, 1.0, 1.0, 1.0]
    assert trio.current_time() - start == 4.75


def test_processes_and_policy_are_checked() -> None:
    assert resolve_processes("auto") == (os.cpu_count() or 1)
    assert (resolve_processes("3"), resolve_processes(2)) == (3, 2)
    for bad in (0, -1, "two", 1.5, True):
        with pytest.raises(dt.ConfigError):
            resolve_processes(bad)  # type: ignore[arg-type]
    with pytest.raises(dt.ConfigError, match="crash_limit"):
        RestartPolicy(crash_limit=0)
    with pytest.raises(dt.ConfigError, match="backoff_initial"):
        RestartPolicy(backoff_initial=0)
    with pytest.raises(dt.ConfigError, match="backoff_max must be finite"):
        RestartPolicy(backoff_max=float("inf"))  # (the backoff's cap: not a slot's first restart)


# --- real processes -------------------------------------------------------------------------


class Supervisor:
    """``durable-trio worker --processes N`` as a child of the test; its children's banners
    (stdout) are read as they come."""

    def __init__(self, argv: list[str], log: Path) -> None:
        # unbuffered, as in CI: print()'s text and newline were two writes, interleaved
        env = {**os.environ, "PYTHONPATH": str(TESTS.parent), "SUPERVISOR_TEST_LOG": str(log),
               "PYTHONUNBUFFERED": "1"}  # fmt: skip
        self.stderr = log.with_suffix(".err")
        with self.stderr.open("wb") as err:
            self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, env=env)
        self.banners: list[tuple[str, int]] = []  # (instance id, pid), in start order
        assert self.process.stdout is not None
        self._stdout = trio.lowlevel.FdStream(os.dup(self.process.stdout.fileno()))
        self._pending = b""

    async def read_banner(self, within: float) -> tuple[str, int]:
        """The next child's banner; other lines on the children's shared stdout are passed
        over, kept for the error if no banner comes. Read without a thread, so the bound
        holds (a ``readline`` in a thread can't be cancelled: it once hung a run 120 s)."""
        seen: list[str] = []
        found = None
        with trio.move_on_after(within):
            while found is None:
                line = await self._line()
                if line is None:  # the end of the output: every writer has exited
                    break
                found = BANNER.search(line)
                if found is None:
                    seen.append(line)
        assert found, (
            f"no banner within {within} s; lines seen: {seen!r}; partial: {self._pending!r}; "
            f"supervisor status: {self.process.poll()}; its stderr:\n{self.stderr.read_text()}"
        )
        self.banners.append((found[1], int(found[2])))
        return self.banners[-1]

    async def _line(self) -> str | None:
        while b"\n" not in self._pending:
            chunk = await self._stdout.receive_some(4096)
            if not chunk:
                return None
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode(errors="replace")

    async def exit_status(self, within: float) -> int:
        with trio.fail_after(within):
            return await trio.to_thread.run_sync(self.process.wait)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._stdout.close()  # (its dup of the pipe: a sync close, safe in a finally)
        for _, pid in self.banners:  # no child outlives a test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its supervisor) is not alive
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def events(log: Path, kind: str) -> list[list[str]]:
    if not log.exists():
        return []
    return [line.split()[1:] for line in log.read_text().splitlines() if line.startswith(kind)]


async def until(predicate: Callable[[], object], within: float) -> None:
    with trio.fail_after(within):
        # other processes write what we wait for: nothing to wait on but polling
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.05)


def task(step_id: str, seconds: float) -> dt.RemoteTask:
    return dt.RemoteTask(run_id="sup", step_id=step_id, attempt=1, name="work", input=seconds)


def supervisor_argv(url: str, namespace: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "durable_trio", "worker", TARGET, "--backend", url,
        "--namespace", namespace, "--processes", "2", *extra,
    ]  # fmt: skip


@pytest.mark.chaos
async def test_a_child_killed_with_9_is_replaced_and_its_jobs_come_back(
    redis_url: str, tmp_path: Path
) -> None:
    namespace, log = f"sup{random.randrange(1 << 30)}", tmp_path / "log"
    results: dict[str, object] = {}
    async with (
        dt.open_backend(redis_url) as backend,
        dt.open_queue_transport(backend, namespace=namespace, stalled_check_interval=0) as t,
    ):

        async def on_result(result: dt.StepResult) -> None:
            results[result.step_id] = result.output

        t.on_result(on_result)
        supervisor = Supervisor(
            supervisor_argv(
                redis_url, namespace, "--stalled-threshold", "2", "--stalled-check-interval",
                "0.5",
            ),
            log,
        )  # fmt: skip
        try:
            first = {await supervisor.read_banner(20), await supervisor.read_banner(20)}
            for n in range(6):
                await t.dispatch(task(f"s{n}", 1.0))
            await until(lambda: len(events(log, "START")) == 6, 10)
            victim = int(events(log, "START")[0][1])
            held = {step for step, pid, _ in events(log, "START") if int(pid) == victim}
            os.kill(victim, signal.SIGKILL)
            replacement = await supervisor.read_banner(0.5 + 20)  # backoff 0.5 s, then start
            # a job back from a stall is a suspect: each worker runs one at a time
            await until(lambda: len(results) == 6, 2.0 + 0.5 + 6 * 1.0 + 2 * SLACK)
        finally:
            supervisor.process.send_signal(signal.SIGTERM)
            status = await supervisor.exit_status(5.0 + 2.0 + CLOSE_MARGIN + SLACK)
            supervisor.kill()
    pids = {pid for _, pid in first}
    assert victim in pids
    assert replacement[1] not in pids
    assert replacement[0] not in {i for i, _ in first}
    assert held  # the victim held claims; each came back and ran again elsewhere
    assert set(results) == {f"s{n}" for n in range(6)}
    assert all(results[step] != victim for step in results)
    for step in held:
        assert len([s for s, _, _ in events(log, "START") if s == step]) == 2
    err = supervisor.stderr.read_text()
    assert f"(pid {victim}) exited with status -9: restarting in 0.5 s" in err, err
    assert status == 0, err


@pytest.mark.chaos
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_to_the_supervisor_closes_every_child_and_loses_no_job(
    redis_url: str, tmp_path: Path, signum: int
) -> None:
    namespace, log = f"sup{random.randrange(1 << 30)}", tmp_path / "log"
    results: dict[str, object] = {}
    close_timeout = 1.5
    async with (
        dt.open_backend(redis_url) as backend,
        dt.open_queue_transport(backend, namespace=namespace, stalled_check_interval=0) as t,
    ):

        async def on_result(result: dt.StepResult) -> None:
            results[result.step_id] = result.output

        t.on_result(on_result)
        supervisor = Supervisor(
            supervisor_argv(redis_url, namespace, "--close-timeout", str(close_timeout)), log
        )
        try:
            children = [await supervisor.read_banner(20), await supervisor.read_banner(20)]
            for n in range(4):  # finish within close_timeout
                await t.dispatch(task(f"short{n}", 0.5))
            await t.dispatch(task("long", 8.0))  # does not: handed back
            await until(lambda: len(events(log, "START")) == 5, 10)
            sent = time.monotonic()
            supervisor.process.send_signal(signum)
            status = await supervisor.exit_status(close_timeout + 2.0 + CLOSE_MARGIN + SLACK)
            closed = time.monotonic() - sent
        finally:
            supervisor.kill()
        assert not any(alive(pid) for _, pid in children)
        assert closed < close_timeout + 2.0 + CLOSE_MARGIN
        await until(lambda: len(results) == 4, SLACK)
        assert set(results) == {f"short{n}" for n in range(4)}
        # the long step was handed back: a new worker takes it at once and finishes it
        heir = Supervisor(
            [*supervisor_argv(redis_url, namespace)[:-2], "--processes", "1"], tmp_path / "heir"
        )
        try:
            await heir.read_banner(20)
            await until(lambda: "long" in results, 8.0 + SLACK)
        finally:
            heir.process.send_signal(signal.SIGTERM)
            await heir.exit_status(5.0 + SLACK)
            heir.kill()
    err = supervisor.stderr.read_text()
    name = signal.Signals(signum).name
    assert f"{name}: closing 2 worker process(es) gracefully" in err, err
    assert err.count(f"{name}: closing gracefully") == 2, err  # each child, once
    assert "Traceback" not in err, err
    assert status == 0, err


def _popen(argv: list[str], err: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with err.open("wb") as stderr:
        return subprocess.Popen(argv, stderr=stderr, env=env)


@pytest.mark.chaos
async def test_children_that_die_at_start_crash_loop_and_are_never_given_up(
    tmp_path: Path,
) -> None:
    """Issue 30, item 10: children that die at start (``--concurrency 0``: status 2) are
    restarted with a bounded backoff well past the crash limit (before: given up after it);
    ``durable-trio health`` shows each slot crash-looping with its last exit status, and the
    supervisor exits 3 at the close."""
    url = f"sqlite:///{tmp_path / 'sup.db'}"
    script = (
        "import logging, sys\n"
        "import durable_trio as dt\n"
        "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        f"sys.exit(dt.run_worker_processes({TARGET!r}, {url!r}, processes=2,\n"
        "    worker_args=['--concurrency', '0'], namespace='looping',\n"
        "    restart=dt.RestartPolicy(backoff_initial=0.05, backoff_max=0.2, crash_limit=3,\n"
        "                             crash_window=60)))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    err = tmp_path / "supervisor.err"
    supervisor = _popen([sys.executable, "-c", script], err, env)
    try:

        def health() -> str:
            done = subprocess.run(
                [sys.executable, "-m", "durable_trio", "health", "--backend", url,
                 "--namespace", "looping"],
                capture_output=True, text=True, env=env, timeout=30,
            )  # fmt: skip
            return done.stdout

        async def looping_past_the_limit() -> bool:
            async with dt.open_backend(url) as backend:
                assert backend.keys is not None
                slots = await read_supervisors(backend.keys, QueueNames("looping"))
            return len(slots) == 2 and all(
                s.crash_looping and s.last_exit == 2 and s.restarts >= 6 for s in slots
            )

        with trio.fail_after(90):
            while not await looping_past_the_limit():
                assert supervisor.poll() is None, err.read_text()  # never given up
                await trio.sleep(0.2)
        shown = await trio.to_thread.run_sync(health)
        for slot in (0, 1):
            assert f"crash-looping: worker process {slot} of supervisor" in shown, shown
        assert "last exit status 2" in shown
        supervisor.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            status = await trio.to_thread.run_sync(supervisor.wait)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
    assert status == CRASH_LOOP_EXIT, err.read_text()
    text = err.read_text()
    assert "worker process 0: crash loop (3 deaths within 60 s, the last with status 2)" in text
    assert "restarting every 0.2 s" in text


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--processes", "0"], "error: processes must be a positive integer or 'auto', got 0"),
        (["--processes", "many"], "error: processes must be a positive integer or 'auto'"),
    ],
)
def test_a_bad_processes_option_is_one_line_and_status_2(args: list[str], error: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "durable_trio", "worker", TARGET, "--backend", "memory://", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(TESTS.parent)},
        timeout=30,
        check=False,
    )
    assert (done.returncode, done.stderr.startswith(error)) == (2, True), done.stderr
    assert "Traceback" not in done.stderr


def test_a_bad_target_is_refused_once_before_any_child_starts() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "durable_trio", "worker", "no_such_module:app", "--processes", "2"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "error: cannot import 'no_such_module': No module named 'no_such_module'"
    ]
