"""Scaling on a 3-master Redis Cluster with one worker process per master (issue 17).

Part of the ``redis-cluster`` section (benchmarks/redis_cluster.py), on the same private
3-master cluster. Queues are placed on purpose: for each master, step names are picked whose
task queue's hash tag (``{NAMESPACE:tasks:STEP}``, see :mod:`durable_trio._redis._keyslot`)
falls in a slot that master serves, so "the queues of master m" is a real placement, not a hope.

Worker side (no-op steps, concurrency 32 per process, as S1): the producer (this process)
fills the queues of the masters used with the same number of jobs each and counts the results;
the workers are real subprocesses (benchmarks/_redis_worker.py). Two timings:

* *from start*: the queues filled first, then the workers started; timed as the Redis race
  times the peers, from the first worker's ``start`` line (imports and connecting done) to the
  last result consumed here (so a process that starts late costs what it costs);
* *steady*: every worker started and waiting, then the queues filled (the producer pushing
  while the workers drain), from the fill's start to the last result.

Each case also says where the CPU went over the timed window (cores: CPU seconds over wall
seconds): the producer, the workers (and the busiest), the masters (and the busiest). Cases:

* 1 process serving the queues of 1 master;
* 1 process serving the queues of all 3 masters (the baseline of the ratios);
* 2 processes, each serving the queues of one master (2 masters used);
* 3 processes, each serving the queues of one master.

Engine side (cheap): 3-step workflows/s with 1 and with 2 engine processes
(benchmarks/_cluster_engine.py: an engine and a worker in one process, each process its own
namespace, so its own queues), all workflows started at once.

On this 2-core machine the masters, the worker processes and the producer share the two cores:
the figures say how far one machine goes, not how far a cluster of machines would.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

import durable_trio as dt
from durable_trio._naming import QueueNames
from durable_trio._redis._keyslot import key_slot
from durable_trio._redis._url import parse_redis_cluster_url

from .redis import _cpu_seconds
from .redis_server import _info_fields, command

__all__ = ["measure"]

WORKER = Path(__file__).with_name("_redis_worker.py")
ENGINE = Path(__file__).with_name("_cluster_engine.py")
SRC = Path(__file__).resolve().parent.parent
_CONCURRENCY = 32
_QUEUES_PER_MASTER = 2


def _masters(url: str) -> list[tuple[int, int, int]]:
    """``(first slot, last slot, port)`` of each master's slot ranges, by port."""
    seed = parse_redis_cluster_url(url).seeds[0]
    reply: Any = command(f"redis://{seed.host}:{seed.port}/0", "CLUSTER", "SLOTS")
    return sorted((int(r[0]), int(r[1]), int(r[2][1])) for r in reply)


def _steps_per_master(url: str, namespace: str) -> list[list[str]]:
    """For each master (ordered by port), ``_QUEUES_PER_MASTER`` step names whose task queue
    lives in one of its slots."""
    ranges = _masters(url)
    ports = sorted({port for _, _, port in ranges})
    names = QueueNames(namespace)
    chosen: dict[int, list[str]] = {port: [] for port in ports}
    n = 0
    while any(len(steps) < _QUEUES_PER_MASTER for steps in chosen.values()):
        step = f"noop-{n}"
        slot = key_slot("{" + names.task_queue(step) + "}")
        port = next(p for first, last, p in ranges if first <= slot <= last)
        if len(chosen[port]) < _QUEUES_PER_MASTER:
            chosen[port].append(step)
        n += 1
    return [chosen[port] for port in ports]


def _spawn(argv: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, env=env)


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    process.wait()
    if process.stdout is not None:
        process.stdout.close()


async def _start_line(process: subprocess.Popen[bytes]) -> list[bytes]:
    """The fields of its ``start WALLCLOCK [CPU]`` line."""
    assert process.stdout is not None
    line = await trio.to_thread.run_sync(process.stdout.readline)
    if not line.startswith(b"start "):
        raise RuntimeError(f"a benchmark process died before starting: {line!r}")
    return line.split()


def _master_cpu(url: str) -> list[float]:
    """CPU seconds (user + system) each master has used so far, by port (``INFO cpu``)."""
    ports = sorted({port for _, _, port in _masters(url)})
    seconds = []
    for port in ports:
        fields = _info_fields(f"redis://127.0.0.1:{port}/0", "cpu")
        seconds.append(float(fields["used_cpu_user"]) + float(fields["used_cpu_sys"]))
    return seconds


async def _fill(producer: dt.QueueTransport, steps: list[str], jobs_per_queue: int) -> None:
    for step in steps:
        for first in range(0, jobs_per_queue, 1000):
            await producer.dispatch_many(
                [
                    dt.RemoteTask(run_id="s", step_id=f"{step}.{n}", attempt=1, name=step)
                    for n in range(first, min(first + 1000, jobs_per_queue))
                ]
            )


async def _drain(
    url: str, groups: list[list[str]], jobs_per_queue: int, *, warm: bool
) -> tuple[float, dict[str, float]]:
    """Aggregate jobs/s, one worker process per group of master indexes, and where the CPU
    went meanwhile: each part's CPU seconds over the timed wall seconds (1.0 = one core).

    ``warm=False``: the queues filled first, timed from the first worker's ``start`` line to the
    last result (as the peers are). ``warm=True``: every worker started and waiting first, then
    the queues filled, timed from the fill's start to the last result (no process start-up in
    the window: the steady rate)."""
    namespace = f"scale-{time.monotonic_ns()}"
    per_master = _steps_per_master(url, namespace)
    groups = [[step for index in group for step in per_master[int(index)]] for group in groups]
    steps = [step for group in groups for step in group]
    jobs = jobs_per_queue * len(steps)
    async with dt.open_backend(url) as backend:
        async with dt.open_queue_transport(
            backend, namespace=namespace, result_concurrency=64
        ) as producer:
            if not warm:
                await _fill(producer, steps, jobs_per_queue)
            done = trio.Event()
            count = 0

            async def on_result(result: dt.StepResult) -> None:
                nonlocal count
                count += 1
                if count == jobs:
                    done.set()

            producer.on_result(on_result)
            workers = [
                _spawn([str(WORKER), url, namespace, str(_CONCURRENCY), ",".join(group)])
                for group in groups
            ]
            try:
                opened = 0.0
                worker_base: dict[int, float] = {}
                base: list[Any] = []

                async def started(index: int) -> None:
                    nonlocal opened
                    line = await _start_line(workers[index])
                    worker_base[index] = float(line[2])
                    if not warm and not base:  # the window opens: what the others used so far
                        opened = float(line[1])
                        base.extend((_master_cpu(url), time.process_time()))
                    if warm:
                        await _ready(workers[index])

                async with trio.open_nursery() as nursery:
                    for index in range(len(workers)):
                        nursery.start_soon(started, index)
                if warm:
                    worker_base = {i: _cpu_seconds(w.pid) for i, w in enumerate(workers)}
                    base.extend((_master_cpu(url), time.process_time()))
                    opened = time.time()
                    await _fill(producer, steps, jobs_per_queue)
                with trio.fail_after(300):
                    await done.wait()
                end = time.time()
                own = time.process_time() - base[1]
                masters_after = _master_cpu(url)
                workers_used = [_cpu_seconds(w.pid) - worker_base[i] for i, w in enumerate(workers)]
            finally:
                for worker in workers:
                    _stop(worker)
    wall = end - opened
    masters_used = [a - b for a, b in zip(masters_after, base[0], strict=True)]
    shares = {
        "producer": own,
        "workers": sum(workers_used),
        "busiest worker": max(workers_used),
        "masters": sum(masters_used),
        "busiest master": max(masters_used),
    }
    shares = {key: value / wall for key, value in shares.items()}
    return jobs / wall, shares


async def _ready(process: subprocess.Popen[bytes]) -> None:
    assert process.stdout is not None
    line = await trio.to_thread.run_sync(process.stdout.readline)
    if line.strip() != b"ready":
        raise RuntimeError(f"a worker died before it was ready: {line!r}")


async def _engines(url: str, processes: int, workflows: int) -> float:
    """Aggregate 3-step workflows/s of ``processes`` engine processes, ``workflows`` each."""
    stamp = time.monotonic_ns()
    children = [
        _spawn([str(ENGINE), url, f"scale-engine-{stamp}-{n}", str(workflows)])
        for n in range(processes)
    ]
    try:
        starts = [float((await _start_line(child))[1]) for child in children]
        ends = []
        for child in children:
            assert child.stdout is not None
            with trio.fail_after(300):
                line = await trio.to_thread.run_sync(child.stdout.readline)
            if not line.startswith(b"end "):
                raise RuntimeError(f"an engine process failed: {line!r}")
            ends.append(float(line.split()[1]))
    finally:
        for child in children:
            _stop(child)
    return processes * workflows / (max(ends) - min(starts))


#: (label, groups of master indexes: one worker process per group)
_CASES: list[tuple[str, list[list[str]]]] = [
    ("1 process, 1 master's queues", [["0"]]),
    ("1 process, all 3 masters' queues", [["0", "1", "2"]]),
    ("2 processes, 1 master each", [["0"], ["1"]]),
    ("3 processes, 1 master each", [["0"], ["1"], ["2"]]),
]


async def measure(url: str, quick: bool) -> dict[str, Any]:
    """The scaling figures on the 3-master cluster at ``url`` (see the module docs)."""
    jobs_per_queue = 500 if quick else 2_500
    repeats = 1 if quick else 3
    figures: dict[str, Any] = {}
    for warm, how in ((False, "from start"), (True, "steady")):
        rates: dict[str, float] = {}
        for label, groups in _CASES:
            measured = sorted(
                [await _drain(url, groups, jobs_per_queue, warm=warm) for _ in range(repeats)],
                key=lambda pair: pair[0],
            )
            rate, shares = measured[len(measured) // 2]  # the median run, and its CPU shares
            rates[label] = rate
            figures[f"scaling ({how}): {label} (jobs/s)"] = (
                rate,
                f"median of {repeats}, {jobs_per_queue * _QUEUES_PER_MASTER} jobs per master",
            )
            figures[f"scaling ({how}): {label}: CPU cores used"] = (
                sum(shares[k] for k in ("producer", "workers", "masters")),
                "; ".join(f"{k} {v:.2f}" for k, v in shares.items()),
            )
        base = rates["1 process, all 3 masters' queues"]
        for label in ("2 processes, 1 master each", "3 processes, 1 master each"):
            figures[f"scaling ({how}): {label.split(',')[0]} / 1 process, 3 masters (x)"] = (
                rates[label] / base,
                "aggregate jobs/s ratio",
            )
    workflows = 200 if quick else 1000
    engine_rates = {}
    for processes in (1, 2):
        engine_runs = [await _engines(url, processes, workflows) for _ in range(repeats)]
        engine_rates[processes] = statistics.median(engine_runs)
        figures[f"scaling: {processes} engine process(es), 3-step workflows/s"] = (
            engine_rates[processes],
            f"median of {repeats}, {workflows} at once per process",
        )
    figures["scaling: 2 engine processes / 1 (x)"] = (
        engine_rates[2] / engine_rates[1],
        "aggregate workflows/s ratio",
    )
    return figures
