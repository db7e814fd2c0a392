"""Issue 32, "Failure": the PostgreSQL backend under a crashed server, terminated connections and
statement timeouts. Every loop reports, backs off, reconnects by itself and carries on; nothing
acknowledged is lost; every run completes (wall clock: each wait bounded by ``fail_after``).

The crash test runs an engine and a worker as real processes (``_pg_fault_process.py``) on a
server of its own with PostgreSQL's durable settings (``fsync``, ``synchronous_commit``): the
session's server runs without them, and an immediate stop may lose its last commits.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from _pg_fault_process import NAMESPACE, app, expected
from benchmarks.postgres_server import PostgresServer, find_bindir, make_folder
from durable_trio._engine import open_engine, open_worker
from helpers import Errors

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.postgres

SCRIPT = Path(__file__).with_name("_pg_fault_process.py")


def _schema() -> str:
    return f"f_{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def durable_server() -> Iterator[PostgresServer]:
    """A private server of this module's own, with fsync and synchronous commits on."""
    bindir = find_bindir()
    if bindir is None:
        if os.environ.get("CI") == "true":
            pytest.fail("initdb / pg_ctl not found", pytrace=False)
        pytest.skip("initdb / pg_ctl not found")
    server = PostgresServer(make_folder(), bindir, durable=True)
    try:
        server.init()
        server.start()
        yield server
    finally:
        server.stop("immediate")
        shutil.rmtree(server.dir, ignore_errors=True)


class Child:
    """One engine or worker process; its stderr goes to a file, shown when the test fails."""

    def __init__(self, role: str, url: str, folder: Path) -> None:
        self.role = role
        self.stderr = folder / f"{role}.err"
        env = {**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)}
        with self.stderr.open("wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, str(SCRIPT), role, url], stdout=subprocess.PIPE, stderr=err,
                env=env,
            )  # fmt: skip
        assert self.process.stdout is not None
        self.banner = self.process.stdout.readline()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()

    def report(self) -> str:
        lines = self.stderr.read_text(errors="replace").splitlines()
        return f"--- {self.role} stderr ({len(lines)} lines, last 30) ---\n" + "\n".join(
            lines[-30:]
        )


RUNS = 60
#: Seconds over which the runs are started; the server is crashed a third of the way in.
START_OVER = 6.0


@pytest.mark.chaos
async def test_an_immediate_restart_mid_run_loses_nothing_acknowledged(
    durable_server: PostgresServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``pg_ctl restart -m immediate`` (a crash: no checkpoint, every connection cut) while an
    engine process and a worker process run many runs: every run whose start was acknowledged
    completes, a start refused during the crash started again under its id completes once, and
    both processes (never restarted) serve a run started after."""
    url = f"{durable_server.url}?schema={_schema()}"
    children: list[Child] = []
    acknowledged: list[str] = []
    refused: list[int] = []
    try:
        async with dt.open_backend(url) as backend:
            # The schema first (each process migrates too: a no-op then).
            for role in ("engine", "worker"):
                child = await trio.to_thread.run_sync(Child, role, url, tmp_path)
                children.append(child)
                assert child.banner.strip() == b"ready", child.report()
            async with open_engine(app, backend, namespace=NAMESPACE, reconcile=False) as caller:

                async def crash() -> None:
                    await trio.to_thread.run_sync(durable_server.stop, "immediate")
                    await trio.sleep(1.0)
                    await trio.to_thread.run_sync(durable_server.start)

                async with trio.open_nursery() as nursery:
                    for n in range(RUNS):
                        if n == RUNS // 3:
                            nursery.start_soon(crash)
                        try:
                            await caller.start("chain", n, run_id=f"run-{n}", detach=True)
                        except dt.BrokerError:
                            refused.append(n)  # never acknowledged: the caller knows
                        else:
                            acknowledged.append(f"run-{n}")
                        await trio.sleep(START_OVER / RUNS)
                with trio.fail_after(45):
                    outputs = {run_id: await caller.result(run_id) for run_id in acknowledged}
                # A refused start (it may or may not have run) started again under its id:
                # one run each, all complete.
                with trio.fail_after(30):
                    for n in refused:
                        await caller.start("chain", n, run_id=f"run-{n}", detach=True)
                    for n in refused:
                        outputs[f"run-{n}"] = await caller.result(f"run-{n}")
                # Both processes are the ones started before the crash, and still serve.
                assert [c.process.poll() for c in children] == [None, None]
                with trio.fail_after(15):
                    await caller.start("chain", 1000, run_id="after", detach=True)
                    assert await caller.result("after") == expected(1000)
    except BaseException as exc:
        exc.add_note("\n".join(child.report() for child in children))
        raise
    finally:
        for child in children:
            child.close()
    assert outputs == {f"run-{n}": expected(n) for n in range(RUNS)}
    assert len(acknowledged) >= RUNS // 3  # those before the crash, at least
    assert refused, "some starts met the crash"
    with capsys.disabled():
        print(
            f"\n[postgres immediate restart] runs {RUNS}, acknowledged {len(acknowledged)}, "
            f"refused during the crash {len(refused)}, lost 0"
        )


# -- terminated connections -------------------------------------------------------------------


def _terminate(server: PostgresServer, tag: str) -> list[str]:
    """``pg_terminate_backend`` every connection named ``tag``; their last statements."""
    rows = server.sql(
        "SELECT query, pg_terminate_backend(pid) FROM pg_stat_activity "
        f"WHERE application_name = '{tag}'"
    )
    return [str(query) for query, _ in rows]


async def _start(caller: Any, n: int, errors: Errors) -> None:
    """Start run ``run-{n}`` detached, again under its id while the server refuses."""
    with trio.fail_after(30):
        while True:
            try:
                await caller.start("chain", n, run_id=f"run-{n}", detach=True)
                return
            except dt.BrokerError as exc:
                errors(exc)
                await trio.sleep(0.2)


async def test_every_connection_terminated_again_and_again_mid_run(
    postgres_url: str, postgres_server: PostgresServer
) -> None:
    """Each second ``pg_terminate_backend`` ends every connection of two backends (the pools'
    and the notify hubs' ``LISTEN`` connections) while an engine and a worker run; the runs are
    started by the second backend, which waits for their results (woken by the run store's
    ``NOTIFY``): every run completes, and a run started after the last round is woken too."""
    tag = f"dt_{uuid.uuid4().hex[:8]}"
    url = f"{postgres_url}?schema={_schema()}&application_name={tag}"
    errors = Errors()
    terminated: list[str] = []
    runs = 40
    async with (
        dt.open_backend(url) as here,
        open_worker(app, here, namespace=NAMESPACE, on_error=errors, stalled_threshold=2.0,
                    stalled_check_interval=0.5),
        open_engine(app, here, namespace=NAMESPACE, on_error=errors, run_lease=2.0,
                    reconcile_interval=0.5, stalled_threshold=2.0, stalled_check_interval=0.5),
        dt.open_backend(url) as there,
        open_engine(app, there, namespace=NAMESPACE, reconcile=False) as caller,
    ):  # fmt: skip

        async def storm() -> None:
            for _ in range(4):
                await trio.sleep(1.0)
                terminated.extend(await trio.to_thread.run_sync(_terminate, postgres_server, tag))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(storm)
            for n in range(runs):
                await _start(caller, n, errors)
                await trio.sleep(4.0 / runs)
        with trio.fail_after(45):
            outputs = {n: await caller.result(f"run-{n}") for n in range(runs)}
        assert outputs == {n: expected(n) for n in range(runs)}
        # The last round's victims are replaced: a new run's result still wakes its waiter.
        terminated.extend(await trio.to_thread.run_sync(_terminate, postgres_server, tag))
        await _start(caller, 1000, errors)
        with trio.fail_after(20):
            assert await caller.result("run-1000") == expected(1000)
    assert sum(q.startswith(("LISTEN", "SELECT 1")) for q in terminated) >= 2, terminated
    assert len(terminated) >= 4 * 3, terminated
    print(f"\nterminated {len(terminated)} connections; errors reported {len(errors.seen)}")


# -- statement timeouts -----------------------------------------------------------------------


def _hold_lock(server: PostgresServer, schema: str, seconds: float) -> None:
    """Lock the broker's jobs and the runs tables against everyone for ``seconds``."""
    import time

    import psycopg

    with psycopg.connect(server.url, connect_timeout=10) as conn:
        conn.execute(
            f'LOCK TABLE "{schema}".broker_jobs, "{schema}".runs IN ACCESS EXCLUSIVE MODE'.encode()
        )
        time.sleep(seconds)
        conn.rollback()


async def test_statement_timeouts_are_reported_and_retried_never_wedging_a_loop(
    postgres_url: str, postgres_server: PostgresServer
) -> None:
    """With ``statement_timeout`` at 300 ms (the URL's ``options``), the jobs and runs tables
    are locked for 3 s mid-run: the statements that wait for the lock are cancelled by the
    server, reported, and retried; once the lock is gone every run completes."""
    schema = _schema()
    url = f"{postgres_url}?schema={schema}&options=-c%20statement_timeout%3D300"
    errors = Errors()
    runs = 30
    async with (
        dt.open_backend(url) as backend,
        open_worker(app, backend, namespace=NAMESPACE, on_error=errors, stalled_threshold=2.0,
                    stalled_check_interval=0.5),
        open_engine(app, backend, namespace=NAMESPACE, on_error=errors, run_lease=2.0,
                    reconcile_interval=0.5, stalled_threshold=2.0,
                    stalled_check_interval=0.5) as engine,
    ):  # fmt: skip
        assert await backend.broker.pool.fetchval("SHOW statement_timeout") == "300ms"  # type: ignore[attr-defined]
        async with trio.open_nursery() as nursery:
            for n in range(runs):
                if n == runs // 3:
                    nursery.start_soon(trio.to_thread.run_sync, _hold_lock, postgres_server,
                                       schema, 3.0)  # fmt: skip
                await _start(engine, n, errors)
                await trio.sleep(3.0 / runs)
        with trio.fail_after(45):
            outputs = {n: await engine.result(f"run-{n}") for n in range(runs)}
    assert outputs == {n: expected(n) for n in range(runs)}
    canceled = [e for e in errors.seen if "statement timeout" in str(e)]
    assert canceled, errors.messages()
    print(f"\nstatement timeouts reported {len(canceled)}; errors reported {len(errors.seen)}")
