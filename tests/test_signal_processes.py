"""SIGTERM / SIGINT to real worker and engine processes, on SQLite and on Redis (wall clock).

A signal starts the graceful close: a step that fits in ``close_timeout`` finishes and its
result is delivered; a longer one is handed back attempt-neutrally and another worker gets it at
once (no sweep runs anywhere, so nothing but the handback can redeliver it); a second signal
closes at once; an engine releases its runs so another takes them over at once.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio

import durable_trio as dt
from _signal_worker import app
from durable_trio._engine import RunStatus, open_engine, open_run_store

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

pytestmark = pytest.mark.chaos

SCRIPT = Path(__file__).with_name("_signal_worker.py")
TARGET = f"{SCRIPT}:app"
#: Seconds a process may take to close after its signal, beyond what the test asks it to wait.
SLACK = 3.0


@pytest.fixture(params=["sqlite", "redis", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    if request.param == "postgres":
        return str(request.getfixturevalue("postgres_schema_url"))
    return "sqlite:///" + str(tmp_path / "signals.db")


class Proc:
    """A child process whose first stdout line (``ready`` or a banner) has been read."""

    def __init__(self, argv: list[str], log: Path, instance: str) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": str(SCRIPT.parent.parent),
            "SIGNAL_TEST_LOG": str(log),
            "SIGNAL_TEST_INSTANCE": instance,
        }
        self.process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        assert self.process.stdout is not None
        self.banner = self.process.stdout.readline().decode()
        assert self.banner, self.process.stderr.read() if self.process.stderr else ""

    def signal(self, signum: int) -> float:
        self.process.send_signal(signum)
        return time.time()

    async def exit_status(self, within: float) -> tuple[int, str, str]:
        """Wait for the exit (at most ``within`` s): (status, rest of stdout, stderr)."""
        with trio.fail_after(within):
            out, err = await trio.to_thread.run_sync(self.process.communicate)
        return self.process.returncode, out.decode(), err.decode()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.communicate()


async def start(argv: list[str], log: Path, instance: str) -> Proc:
    # in a thread: a process starting slowly must not stall this test's event loop
    with trio.fail_after(20):
        return await trio.to_thread.run_sync(Proc, argv, log, instance)


def worker_argv(
    url: str, namespace: str, instance: str, log: Path, close_timeout: float
) -> list[str]:
    return [sys.executable, str(SCRIPT), url, namespace, instance, str(log), str(close_timeout)]


def cli_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "durable_trio", *args]


def events(log: Path, kind: str) -> list[list[str]]:
    """The log lines of ``kind`` (CLAIM, START, END, CANCELLED, CLOSED), split, oldest first."""
    if not log.exists():
        return []
    return [line.split()[1:] for line in log.read_text().splitlines() if line.startswith(kind)]


async def until(predicate: Callable[[], object], within: float) -> None:
    with trio.fail_after(within):
        # another process writes what we wait for: nothing to wait on but polling
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.02)


@asynccontextmanager
async def dispatcher(
    url: str, namespace: str
) -> AsyncIterator[tuple[dt.QueueTransport, list[tuple[float, dt.StepResult]]]]:
    """The engine side: a transport that dispatches "work" steps and collects their results
    (with their arrival times). No sweep, as in the workers."""
    results: list[tuple[float, dt.StepResult]] = []
    async with (
        dt.open_backend(url) as backend,
        dt.open_queue_transport(
            backend, namespace=namespace, stalled_check_interval=0
        ) as transport,
    ):

        async def on_result(result: dt.StepResult) -> None:
            results.append((time.time(), result))

        transport.on_result(on_result)
        yield transport, results


def work(step_id: str, seconds: float) -> dt.RemoteTask:
    return dt.RemoteTask(run_id="sig", step_id=step_id, attempt=1, name="work", input=seconds)


def fresh_namespace() -> str:
    return f"sig{random.randrange(1 << 30)}"


async def test_sigterm_to_durable_trio_worker_lets_the_running_step_finish(
    url: str, tmp_path: Path
) -> None:
    namespace, log = fresh_namespace(), tmp_path / "log"
    async with dispatcher(url, namespace) as (transport, results):
        # the real command, default close_timeout (5 s)
        worker = await start(
            cli_argv("worker", TARGET, "--backend", url, "--namespace", namespace), log, "cli"
        )
        try:
            assert worker.banner.startswith("worker: serving")
            await transport.dispatch(work("s1", 2.0))
            await until(lambda: events(log, "START"), 10)
            sent = worker.signal(signal.SIGTERM)
            status, _, err = await worker.exit_status(2.0 + SLACK)
            closed = time.time()
        finally:
            worker.kill()
        await until(lambda: results, 5)
    # the step ran to its end, its result delivered once; the close waited for it, no longer
    assert [r.output for _, r in results] == ["cli"]
    assert events(log, "CANCELLED") == []
    assert len(events(log, "END")) == 1
    assert closed - sent < 2.0 + SLACK
    assert (status, "Traceback" not in err) == (0, True), err
    assert "SIGTERM: closing gracefully" in err


async def test_sigterm_hands_a_step_longer_than_close_timeout_back_to_another_worker_at_once(
    url: str, tmp_path: Path
) -> None:
    namespace, log = fresh_namespace(), tmp_path / "log"
    async with dispatcher(url, namespace) as (transport, results):
        first = await start(worker_argv(url, namespace, "w1", log, 0.5), log, "w1")
        second: Proc | None = None
        try:
            await transport.dispatch(work("long", 3.0))
            await until(lambda: events(log, "START"), 10)
            second = await start(worker_argv(url, namespace, "w2", log, 5.0), log, "w2")
            sent = first.signal(signal.SIGTERM)
            status, _, err = await first.exit_status(0.5 + SLACK)
            await until(lambda: len(events(log, "START")) == 2, SLACK)
            taken_over = float(events(log, "START")[1][2])
            await until(lambda: results, 3.0 + SLACK)
        finally:
            first.kill()
            if second is not None:
                second.kill()
    assert (status, "Traceback" not in err) == (0, True), err
    assert [(step, who) for step, who, _ in events(log, "CANCELLED")] == [("long", "w1")]
    # handed back attempt-neutrally (attempts and stalled count unchanged), w2 has it at once
    claims = [claim[:4] for claim in events(log, "CLAIM")]
    assert claims == [["long", "w1", "0", "0"], ["long", "w2", "0", "0"]]
    assert taken_over - sent < 0.5 + SLACK  # the stalled threshold is 1800 s
    assert [r.output for _, r in results] == ["w2"]


async def test_a_second_signal_makes_the_worker_exit_at_once(url: str, tmp_path: Path) -> None:
    namespace, log = fresh_namespace(), tmp_path / "log"
    async with dispatcher(url, namespace) as (transport, _):
        worker = await start(worker_argv(url, namespace, "w1", log, 30.0), log, "w1")
        try:
            await transport.dispatch(work("long", 60.0))
            await until(lambda: events(log, "START"), 10)
            worker.signal(signal.SIGTERM)
            await trio.sleep(0.3)
            assert worker.process.poll() is None  # waiting for the step (close_timeout 30 s)
            sent = worker.signal(signal.SIGINT)
            status, _, err = await worker.exit_status(SLACK)
            closed = time.time()
        finally:
            worker.kill()
    assert closed - sent < SLACK
    assert status == 128 + signal.SIGINT  # forced: the close was cut short
    assert "SIGINT again: closing now" in err, err
    assert "Traceback" not in err, err
    assert [who for _, who, _ in events(log, "CANCELLED")] == ["w1"]
    assert len(events(log, "CLOSED")) == 1


async def test_sigint_to_durable_trio_engine_releases_its_runs_at_once(
    url: str, tmp_path: Path
) -> None:
    namespace, log = fresh_namespace(), tmp_path / "log"
    async with dt.open_backend(url) as backend:
        async with open_engine(app, backend, namespace=namespace, reconcile=False) as starter:
            await starter.start("nap", run_id="n", detach=True)
        engine = await start(
            cli_argv(
                "engine", TARGET, "--backend", url, "--namespace", namespace,
                "--engine-id", "first",
            ),
            log,
            "cli",
        )  # fmt: skip
        try:
            assert "(1 run(s) resumed)" in engine.banner, engine.banner
            sent = engine.signal(signal.SIGINT)
            status, _, err = await engine.exit_status(SLACK)
            closed = time.time()
        finally:
            engine.kill()
        assert (status, "Traceback" not in err) == (0, True), err
        assert closed - sent < SLACK
        async with open_run_store(backend, namespace) as store:
            record = await store.get_run("n")
        assert record is not None
        assert (record.status, record.owner) == (RunStatus.PENDING, None)
        # not after the 30 s run lease: at once
        async with open_engine(app, backend, namespace=namespace, engine_id="second") as heir:
            assert heir.statistics().runs_resumed == 1
            assert (await heir.get("n")).owner == "second"


async def test_ctrl_c_to_durable_trio_run_prints_the_run_id(tmp_path: Path) -> None:
    url, namespace = "sqlite:///" + str(tmp_path / "run.db"), fresh_namespace()
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)}
    argv = cli_argv("run", TARGET, "nap", "--backend", url, "--namespace", namespace)

    def spawn() -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)

    process = await trio.to_thread.run_sync(spawn)
    try:
        async with dt.open_backend(url) as backend, open_run_store(backend, namespace) as store:

            async def started() -> bool:
                return bool(await store.list_runs(status=RunStatus.RUNNING))

            with trio.fail_after(10):
                while not await started():  # noqa: ASYNC110  (the run is in another process)
                    await trio.sleep(0.05)
            process.send_signal(signal.SIGINT)
            with trio.fail_after(SLACK):
                out, err = await trio.to_thread.run_sync(process.communicate)
            (run,) = await store.list_runs()
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()
    assert process.returncode == 130
    assert b"Traceback" not in err, err
    assert out.decode().splitlines() == [f'{{"runId": "{run.run_id}", "status": "interrupted"}}']
    assert (run.status, run.owner) == (RunStatus.PENDING, None)  # released for an engine


async def test_the_example_in_docs_close_md_closes_on_sigterm(tmp_path: Path) -> None:
    page = (SCRIPT.parent.parent / "docs" / "close.md").read_text()
    section = page.split("## Signals", 1)[1]
    example = tmp_path / "example.py"
    example.write_text(section.split("```python\n", 1)[1].split("```", 1)[0])
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)}

    def spawn() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, str(example)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=tmp_path,
        )

    process = await trio.to_thread.run_sync(spawn)
    try:
        assert process.stdout is not None
        with trio.fail_after(20):
            banner = await trio.to_thread.run_sync(process.stdout.readline)
        assert banner.startswith(b"serving")
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(SLACK):
            _, err = await trio.to_thread.run_sync(process.communicate)
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()
    assert process.returncode == 0, err
    assert b"SIGTERM: closing gracefully" in err
