"""Test doubles that wrap a real broker to count calls or inject faults at a chosen point."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

import durable_trio as dt
from durable_trio._engine import RunRecord, RunStatus, StepKind, StepState
from durable_trio.brokers import RenewOutcome
from durable_trio.brokers.memory import MemoryBroker

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence

    from durable_trio._engine import App, Engine, RunStore
    from durable_trio.brokers import ClaimedJob, Job, Lease, Recovery


class CountingBroker:
    """A memory broker that records every pop (time, queue) and can hide its wake-up signal."""

    def __init__(self, *, wakeup: bool = True) -> None:
        self.inner = MemoryBroker()
        self.pops: list[tuple[float, str]] = []
        self.handbacks: list[tuple[str, bool]] = []
        if wakeup:
            self.wait_for_work = self.inner.wait_for_work

    async def push_on(
        self, queue: str, job: Job, *, priority: int | None = None, delay: float = 0.0
    ) -> None:
        await self.inner.push_on(queue, job, priority=priority, delay=delay)

    async def pop_from(self, queue: str, *, worker: str = "") -> ClaimedJob | None:
        self.pops.append((trio.current_time(), queue))
        return await self.inner.pop_from(queue, worker=worker)

    async def pop_many(self, queue: str, count: int, *, worker: str = "") -> list[ClaimedJob]:
        self.pops.append((trio.current_time(), queue))
        return await self.inner.pop_many(queue, count, worker=worker)

    async def pop_ahead(
        self, queue: str, count: int, ahead: int, *, worker: str = ""
    ) -> list[ClaimedJob]:
        self.pops.append((trio.current_time(), queue))
        return await self.inner.pop_ahead(queue, count, ahead, worker=worker)

    async def mark_started(self, queue: str, leases: Sequence[Lease]) -> list[bool]:
        return await self.inner.mark_started(queue, leases)

    async def complete_job(self, lease: Lease, queue: str) -> bool:
        return await self.inner.complete_job(lease, queue)

    async def fail_job(self, lease: Lease, queue: str, error: str) -> bool:
        return await self.inner.fail_job(lease, queue, error)

    async def retry_job(
        self, lease: Lease, queue: str, *, delay: float = 0.0, count_attempt: bool = True
    ) -> bool:
        self.handbacks.append((lease.job_id, count_attempt))
        return await self.inner.retry_job(lease, queue, delay=delay, count_attempt=count_attempt)

    async def renew_jobs(self, queue: str, leases: Sequence[Lease]) -> RenewOutcome:
        return await self.inner.renew_jobs(queue, leases)

    async def recover_stalled_jobs(
        self, queue: str, threshold: float, max_stalled: int
    ) -> Recovery:
        return await self.inner.recover_stalled_jobs(queue, threshold, max_stalled)

    async def size_of(self, queue: str) -> int:
        return await self.inner.size_of(queue)

    async def failed_jobs(self, queue: str, *, limit: int = 100) -> Any:
        return await self.inner.failed_jobs(queue, limit=limit)

    async def aclose(self) -> None:
        await self.inner.aclose()


class HangingBroker(CountingBroker):
    """Stops answering (every call blocks forever) once ``hang`` is set: a dead broker."""

    def __init__(self) -> None:
        super().__init__()
        self.hang = False

    async def _maybe_hang(self) -> None:
        if self.hang:
            await trio.sleep_forever()

    async def pop_from(self, queue: str, *, worker: str = "") -> ClaimedJob | None:
        await self._maybe_hang()
        return await super().pop_from(queue, worker=worker)

    async def complete_job(self, lease: Lease, queue: str) -> bool:
        await self._maybe_hang()
        return await super().complete_job(lease, queue)

    async def retry_job(
        self, lease: Lease, queue: str, *, delay: float = 0.0, count_attempt: bool = True
    ) -> bool:
        await self._maybe_hang()
        return await super().retry_job(lease, queue, delay=delay, count_attempt=count_attempt)

    async def renew_jobs(self, queue: str, leases: Sequence[Lease]) -> RenewOutcome:
        await self._maybe_hang()
        return await super().renew_jobs(queue, leases)

    async def push_on(
        self, queue: str, job: Job, *, priority: int | None = None, delay: float = 0.0
    ) -> None:
        await self._maybe_hang()
        await super().push_on(queue, job, priority=priority, delay=delay)


class DefectiveBroker(CountingBroker):
    """``complete_job`` raises a programming error (not a ``BrokerError``), which ends the
    transport's job worker and with it the transport; ``raised`` is set just before, so a test
    body can raise its own exception at that very instant. ``on_queue``: only for that queue."""

    def __init__(self, on_queue: str | None = None) -> None:
        super().__init__()
        self.on_queue = on_queue
        self.raised = trio.Event()

    async def complete_job(self, lease: Lease, queue: str) -> bool:
        if self.on_queue is None or queue == self.on_queue:
            self.raised.set()
            raise TypeError("a broker defect")
        return await super().complete_job(lease, queue)


class Errors:
    """An ``on_error`` hook that keeps what it is given."""

    def __init__(self) -> None:
        self.seen: list[BaseException] = []

    def __call__(self, exc: BaseException) -> None:
        self.seen.append(exc)

    def messages(self) -> list[str]:
        return [str(e) for e in self.seen]


@asynccontextmanager
async def two_workers_and_an_engine(
    app: dt.App, backend: dt.Backend, *, concurrency: int, errors: Errors
) -> AsyncIterator[dt.Engine]:
    """Two workers of ``app`` (``concurrency`` each) and an engine on ``backend``, all
    reporting to ``errors``: the fleet the limits' and rates' tests run against."""
    async with (
        dt.open_worker(app, backend, concurrency=concurrency, on_error=errors),
        dt.open_worker(app, backend, concurrency=concurrency, on_error=errors),
        dt.open_engine(app, backend, on_error=errors) as engine,
    ):
        yield engine


class KillableWorker:
    """A real ``durable_trio worker`` process (see :func:`killable_worker`) and its pid."""

    def __init__(self, process: subprocess.Popen[bytes], pid: int) -> None:
        self.process, self.pid = process, pid

    async def kill9(self) -> float:
        """SIGKILL it and wait for its end. Returns when it was killed (``time.monotonic``)."""
        os.kill(self.pid, signal.SIGKILL)
        killed = time.monotonic()
        await trio.to_thread.run_sync(self.process.wait)
        return killed


@asynccontextmanager
async def killable_worker(
    target: str, url: str, namespace: str, env: dict[str, str], *options: str
) -> AsyncIterator[KillableWorker]:
    """A real worker process of ``target`` on ``url`` (instance ``victim``, ``env`` added to
    its environment, ``options`` added to its command line) whose claims come back 2 s after
    it is known dead (``--dead-worker-threshold 2``, sweeps every second, a stalled threshold
    of 10 minutes), up once its banner is read; killed and reaped on exit. The victim of the
    kill -9 tests (tests/test_dead_workers.py, tests/test_limits_chaos.py)."""
    argv = [
        sys.executable, "-m", "durable_trio", "worker", target, "--backend", url,
        "--namespace", namespace, "--instance-id", "victim", *options, "--stalled-threshold",
        "600", "--dead-worker-threshold", "2", "--stalled-check-interval", "1",
    ]  # fmt: skip
    full_env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent), **env}

    def spawn() -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, env=full_env)

    process = await trio.to_thread.run_sync(spawn)
    try:
        assert process.stdout is not None
        seen: list[str] = []  # (its banner, past any other line: as the supervisor's tests)
        found = None
        with trio.fail_after(30):
            while found is None:
                line = (await trio.to_thread.run_sync(process.stdout.readline)).decode()
                assert line, f"the worker ended before its banner: {seen!r}"
                seen.append(line)
                found = re.search(r"\(instance (\S+), pid (\d+)\)", line)
        yield KillableWorker(process, int(found[2]))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


class PausedRenewalBroker(CountingBroker):
    """Wraps a shared memory broker; while ``paused``, renewal answers "all renewed" without
    renewing anything — a worker whose event loop is blocked, seen from the broker."""

    def __init__(self, inner: MemoryBroker) -> None:
        super().__init__()
        self.inner = inner
        self.wait_for_work = inner.wait_for_work
        self.paused = False

    async def renew_jobs(self, queue: str, leases: Sequence[Lease]) -> RenewOutcome:
        if self.paused:
            return RenewOutcome(renewed=len(leases))
        return await self.inner.renew_jobs(queue, leases)


# --------------------------------------------------------------------------- crash tests


async def completed_steps(store: RunStore, run_ids: Iterable[str]) -> set[str]:
    """The idempotency keys of every checkpointed (completed) worker step of ``run_ids``."""
    done: set[str] = set()
    for run_id in run_ids:
        for record in await store.get_steps(run_id):
            if record.kind is StepKind.REMOTE and record.status is StepState.COMPLETED:
                done.add(record.idempotency_key)
    return done


async def kill_after(
    process: trio.Process, store: RunStore, run_ids: Sequence[str], checkpoints: int
) -> set[str]:
    """SIGKILL ``process`` once ``checkpoints`` steps of ``run_ids`` are completed in all;
    returns the keys of the steps completed when it died."""
    with trio.fail_after(30):
        # Polled: the checkpoints are written by another process.
        while len(await completed_steps(store, run_ids)) < checkpoints:  # noqa: ASYNC110
            await trio.sleep(0.01)
    process.kill()
    await process.wait()
    return await completed_steps(store, run_ids)


async def set_aside_by_stalls(
    broker: Any, producer: dt.QueueTransport, name: str, step: str, *, priority: int = 7
) -> str:
    """Dispatch a task ``name`` (step ``step``, ``priority``) and drive it out of stalls as the
    transport's sweep would with ``max_stalled=1``: one counted attempt, then two claims by a
    worker ``w-dead`` that went silent, the second past the limit, so the sweep hands it over
    and it is failed for good (the poison path). Returns its job id."""
    queue = producer.names.task_queue(name)
    task = dt.RemoteTask(run_id="r", step_id=step, attempt=1, name=name, priority=priority)
    job_id = await producer.dispatch(task)
    claimed = await broker.pop_from(queue, worker="w-dead")
    assert claimed.id == job_id
    assert await broker.retry_job(claimed.lease, queue)  # a handler failure: one attempt
    for _ in range(2):
        claimed = await broker.pop_from(queue, worker="w-dead")
        assert claimed.id == job_id
        # (a suspect, stalled before, is handed over not started: its handler starts now)
        assert await broker.mark_started(queue, [claimed.lease]) == [True]
        await trio.sleep(0.05)  # ... and the worker dies: the claim goes silent
        recovery = await broker.recover_stalled_jobs(queue, 0.02, 1)
    (poison,) = recovery.exceeded
    assert await broker.fail_job(poison.lease, queue, "stalled 2 times (max 1)")
    return job_id


async def serve_until_done(backend: dt.Backend, name: str, output: str) -> list[str]:
    """Run a worker transport (namespace ``shop``) whose handler of tasks ``name`` answers
    ``output``, until it has run a task and the queue holds nothing waiting or claimed (the
    close waits for the result's publication). Returns the step ids it ran, in order."""
    broker: Any = backend.broker
    ran: list[str] = []

    async def handle(task: dt.RemoteTask) -> str:
        ran.append(task.step_id)
        return output

    async with dt.open_queue_transport(backend, namespace="shop") as worker:
        worker.handle(name, handle)
        queue = worker.names.task_queue(name)
        with trio.fail_after(10):
            while not ran or await _pending(broker, queue):  # noqa: ASYNC110  (broker state)
                await trio.sleep(0.02)
    return ran


async def _pending(broker: Any, queue: str) -> int:
    stats = await broker.queue_stats(queue)
    return int(stats.ready + stats.delayed + stats.claimed)


async def wait_status(
    engine: dt.Engine, run_id: str, status: RunStatus, poll: float = 0.05
) -> RunRecord:
    """Poll ``engine`` until ``run_id`` has ``status`` (a run parked ``blocked`` settles in no
    driver's ``done``); returns its record."""
    while (record := await engine.get(run_id)).status is not status:  # noqa: ASYNC110
        await trio.sleep(poll)
    return record


def sqlite_url(path: Path) -> str:
    """The ``sqlite:`` URL of a real file at the absolute ``path``."""
    return f"sqlite:///{path}".replace("///", "////", 1)


def made_sqlite_url(path: Path) -> str:
    """:func:`sqlite_url`, its store made there and holding nothing (the commands that open
    only an existing database accept it)."""
    url = sqlite_url(path)

    async def make() -> None:
        async with dt.open_backend(url):
            pass

    trio.run(make)
    return url


@asynccontextmanager
async def short_lease_engine(
    app: App,
    url: str,
    *,
    engine_id: str,
    namespace: str | None = None,
    worker: bool = False,
    **options: Any,
) -> AsyncIterator[Engine]:
    """The engine of a crash test's child process: its own backend, a 1 s run lease and
    0.2 s reconcile and watch intervals, so a SIGKILLed engine's runs lapse, and another
    engine takes them over, within a second or two; with ``worker``, a worker of the app
    beside it. ``options`` go to ``open_engine``."""
    from durable_trio._engine import open_engine

    namespace = app.name if namespace is None else namespace  # open_engine's default
    async with dt.open_backend(url) as backend, contextlib.AsyncExitStack() as stack:
        if worker:
            await stack.enter_async_context(dt.open_worker(app, backend, namespace=namespace))
        engine = await stack.enter_async_context(
            open_engine(
                app,
                backend,
                namespace=namespace,
                engine_id=engine_id,
                run_lease=1.0,
                reconcile_interval=0.2,
                watch_interval=0.2,
                **options,
            )
        )
        yield engine


async def poll_until(check: Callable[[], Awaitable[bool]], *, interval: float = 0.05) -> None:
    """Await ``check()`` every ``interval`` seconds until it is true: for state another
    process writes (a store gives no wake-up for it). Bound it with ``trio.fail_after``."""
    while not await check():  # noqa: ASYNC110 (another process writes the state)
        await trio.sleep(interval)


async def has_steps(store: RunStore, run_id: str, count: int) -> bool:
    """Whether the run ``run_id`` has ``count`` checkpoints or more."""
    return len(await store.get_steps(run_id)) >= count
