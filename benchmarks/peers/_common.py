"""What every Python peer runner shares (standard library only: it runs in the peers' venvs).

A runner (``run_<peer>.py``) is started by :func:`benchmarks.peers.run_peers` with the peer's own
virtualenv python. As the *producer* it enqueues, times, and prints ONE JSON line; for S1, S3 and
S4 it starts ITSELF again with ``--role worker`` as a separate worker process.

How the producer learns what a worker did, without adding Redis traffic:

* ``BENCH_STARTED_FILE``: the worker writes ``time.monotonic()`` there just before it enters the
  peer's run loop (after imports and set-up): the "worker start" of S1.
* ``BENCH_DONE_FILE`` (S1): each job appends ``(n, time.monotonic())`` (16 bytes, ``O_APPEND``);
  the producer waits until every job number is there and takes the largest first completion.
* ``BENCH_PROBE_PORT`` (S3): each job sends ``(n, time.monotonic())`` in one UDP datagram to the
  producer on 127.0.0.1.

``CLOCK_MONOTONIC`` is one clock for every process of the machine, so those times compare.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
import json
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator

SCENARIOS = ("S1", "S2", "S3", "S4")
_PROBE = struct.Struct("<qd")
_HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- arguments


@dataclass
class Args:
    redis: str
    scenario: str
    jobs: int
    queues: int
    window: float
    samples: int
    warmup: int
    deadline: float
    settle: float
    concurrency: int
    role: str
    queue_names: list[str] = field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description="one benchmark scenario against one peer")
    parser.add_argument("--redis", required=True, help="redis://127.0.0.1:PORT/0 (private)")
    parser.add_argument("--scenario", choices=SCENARIOS, required=True)
    parser.add_argument("--jobs", type=int, default=10_000, help="S1/S2: number of jobs")
    parser.add_argument("--queues", type=int, default=1, help="queues the worker listens on")
    parser.add_argument("--window", type=float, default=10.0, help="S4: idle window (s)")
    parser.add_argument("--samples", type=int, default=300, help="S3: timed jobs")
    parser.add_argument("--warmup", type=int, default=30, help="S3: untimed jobs first")
    parser.add_argument(
        "--deadline", type=float, default=60.0, help="S1/S3: stop measuring after this many s"
    )
    parser.add_argument("--settle", type=float, default=2.0, help="S4: idle time before window")
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--role", choices=("producer", "worker"), default="producer")
    ns = parser.parse_args(argv)
    args = Args(**{k: v for k, v in vars(ns).items()})
    args.queue_names = [f"bench{i}" for i in range(max(1, args.queues))]
    return args


# ----------------------------------------------------------------------------- job side


_job_state: dict[str, Any] = {}
_job_lock = threading.Lock()


def _job_signals() -> dict[str, Any]:
    """This process's completion channels, opened once (threads race here: under a lock)."""
    state = _job_state
    pid = os.getpid()
    if state.get("pid") == pid:
        return state
    with _job_lock:
        if _job_state.get("pid") == pid:
            return _job_state
        fresh: dict[str, Any] = {}  # first job in this process (or in a forked child)
        done = os.environ.get("BENCH_DONE_FILE")
        if done:
            fresh["fd"] = os.open(done, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        port = os.environ.get("BENCH_PROBE_PORT")
        if port:
            fresh["sock"] = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            fresh["addr"] = ("127.0.0.1", int(port))
        fresh["pid"] = pid
        globals()["_job_state"] = fresh
        return fresh


def job_done(n: int) -> None:
    """Call at the end of every benchmark job: records its completion time (see module doc)."""
    now = time.monotonic()
    state = _job_signals()
    fd = state.get("fd")
    if fd is not None:
        os.write(fd, _PROBE.pack(n, now))
    sock = state.get("sock")
    if sock is not None:
        sock.sendto(_PROBE.pack(n, now), state["addr"])


def _stamp(variable: str) -> None:
    path = os.environ.get(variable)
    if path:
        tmp = f"{path}.tmp"
        Path(tmp).write_text(repr(time.monotonic()))
        os.replace(tmp, path)


def worker_started(*, ready: bool = True) -> None:
    """The worker calls this just before entering the peer's run loop.

    ``ready=False``: the peer says itself when it is ready (call :func:`worker_ready` then);
    S4's settle time counts from there.
    """
    _stamp("BENCH_STARTED_FILE")
    if ready:
        _stamp("BENCH_READY_FILE")


def worker_ready() -> None:
    """The peer's own "worker ready" moment (for peers with a slow, signalled start-up)."""
    _stamp("BENCH_READY_FILE")


def stop_on_sigterm(callback: Callable[[], None]) -> None:
    """For workers without their own signal handling: run ``callback`` on SIGTERM/SIGINT."""

    def handler(signum: int, frame: object) -> None:
        callback()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def install_async_stop(loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    """An event set on SIGTERM/SIGINT, for asyncio workers that run our own loop."""
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return stop


# ----------------------------------------------------------------------------- producer side


class BenchError(RuntimeError):
    """The measurement could not be made (the message says why)."""


_live_workers: list[WorkerProcess] = []


class WorkerProcess:
    """This runner started again with ``--role worker``, as its own process group."""

    def __init__(self, workdir: Path, argv: list[str], env: dict[str, str]) -> None:
        self.log = workdir / "worker.log"
        self.started_file = workdir / "started"
        self.ready_file = workdir / "ready"
        full_env = {
            **os.environ,
            **env,
            "BENCH_STARTED_FILE": str(self.started_file),
            "BENCH_READY_FILE": str(self.ready_file),
        }
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=full_env,
                start_new_session=True,
            )  # fmt: skip
        _live_workers.append(self)

    def log_tail(self, lines: int = 3) -> str:
        with contextlib.suppress(OSError):
            text = self.log.read_text(errors="replace").strip().splitlines()
            return " | ".join(text[-lines:])
        return "(no log)"

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise BenchError(f"worker exited with {self.process.returncode}: {self.log_tail()}")

    def wait_started(self, timeout: float = 60.0, *, ready: bool = False) -> float:
        """Block until the worker is about to run (``ready``: until it said it is ready);
        return that ``monotonic()`` time."""
        path = self.ready_file if ready else self.started_file
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(OSError, ValueError):
                return float(path.read_text())
            time.sleep(0.005)
        raise BenchError(f"worker not started within {timeout:.0f} s: {self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM the worker's process group, SIGKILL it after 5 s."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # stragglers (forked children)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        with contextlib.suppress(ValueError):
            _live_workers.remove(self)


class Probe:
    """S3: a UDP socket on 127.0.0.1 that jobs report ``(n, monotonic())`` to."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])

    def wait(self, n: int, timeout: float) -> float:
        """The completion time of job ``n`` (older, late reports are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"job {n} did not complete within {timeout:.0f} s")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(64)
            except TimeoutError:
                continue
            seq, when = _PROBE.unpack(data)
            if seq == n:
                return float(when)

    def close(self) -> None:
        self.sock.close()


@dataclass
class Context:
    """What a peer's producer functions get."""

    args: Args
    workdir: Path
    script: str
    probe: Probe | None = None
    notes: list[str] = field(default_factory=list)

    def spawn_worker(self, env: dict[str, str] | None = None) -> WorkerProcess:
        argv = [sys.executable, self.script, *_worker_argv(self.args)]
        return WorkerProcess(self.workdir, argv, env or {})


def _worker_argv(args: Args) -> list[str]:
    return [
        "--redis", args.redis, "--scenario", args.scenario, "--jobs", str(args.jobs),
        "--queues", str(args.queues), "--concurrency", str(args.concurrency),
        "--role", "worker",
    ]  # fmt: skip


def result(metric: str, value: float | None, unit: str, note: str = "") -> dict[str, Any]:
    return {"metric": metric, "value": value, "unit": unit, "note": note}


class Peer(Protocol):
    """What a ``run_<peer>.py`` module provides to :func:`main`."""

    name: str

    def version(self) -> str: ...

    def worker(self, args: Args) -> None:
        """Run the peer's worker in this process until SIGTERM; call worker_started() first."""

    def prefill(self, ctx: Context, n: int) -> str:
        """Enqueue ``n`` jobs (numbered 0..n-1) as fast as the peer allows; say how."""

    def enqueue_timed(self, ctx: Context, n: int) -> list[dict[str, Any]]:
        """S2: enqueue ``n`` jobs one by one (and in bulk, if the peer can); results."""

    def latencies(self, ctx: Context, probe: Probe) -> list[float]:
        """S3: warm-up, then timed jobs one at a time; latencies in ms."""


# ----------------------------------------------------------------------------- timing helpers


def timed_sync(call: Callable[[int], object], n: int) -> float:
    """Seconds to call ``call(i)`` for i in 0..n-1, one after the other."""
    start = time.perf_counter()
    for i in range(n):
        call(i)
    return time.perf_counter() - start


async def timed_async(call: Callable[[int], Awaitable[object]], n: int) -> float:
    """Seconds to ``await call(i)`` for i in 0..n-1, one after the other."""
    start = time.perf_counter()
    for i in range(n):
        await call(i)
    return time.perf_counter() - start


def latency_loop_sync(
    args: Args,
    probe: Probe,
    enqueue: Callable[[int], object],
    gap: Callable[[], float] | None = None,
) -> list[float]:
    """Warm-up, then timed jobs one at a time: ms from just before enqueue to job completion.

    Warm-up is ``args.warmup`` jobs or 2 s, whichever ends first; timing stops after
    ``args.samples`` jobs or ``args.deadline`` s (with at least 10 samples). ``gap()``, if given,
    is slept before each job (for polling peers: so that jobs arrive at random poll phases).
    """
    out: list[float] = []
    warm_until = time.monotonic() + 2.0
    for i in itertools.count():
        if i >= args.warmup or time.monotonic() > warm_until:
            break
        enqueue(i)
        probe.wait(i, timeout=30.0)
    stop_at = time.monotonic() + args.deadline
    for i in range(1_000_000, 1_000_000 + args.samples):
        if gap is not None:
            time.sleep(gap())
        start = time.monotonic()
        enqueue(i)
        out.append((probe.wait(i, timeout=30.0) - start) * 1000.0)
        if time.monotonic() > stop_at and len(out) >= 10:
            break
    return out


async def latency_loop_async(
    args: Args,
    probe: Probe,
    enqueue: Callable[[int], Awaitable[object]],
    gap: Callable[[], float] | None = None,
) -> list[float]:
    """:func:`latency_loop_sync` for asyncio producers (the probe read blocks: nothing runs)."""
    out: list[float] = []
    warm_until = time.monotonic() + 2.0
    for i in itertools.count():
        if i >= args.warmup or time.monotonic() > warm_until:
            break
        await enqueue(i)
        probe.wait(i, timeout=30.0)
    stop_at = time.monotonic() + args.deadline
    for i in range(1_000_000, 1_000_000 + args.samples):
        if gap is not None:
            await asyncio.sleep(gap())
        start = time.monotonic()
        await enqueue(i)
        out.append((probe.wait(i, timeout=30.0) - start) * 1000.0)
        if time.monotonic() > stop_at and len(out) >= 10:
            break
    return out


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100.0 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def _load_redis_helpers() -> Any:
    spec = importlib.util.spec_from_file_location(
        "_bench_redis_server", _HERE.parent / "redis_server.py"
    )
    if spec is None or spec.loader is None:
        raise BenchError("cannot load benchmarks/redis_server.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- scenarios


def _completions(data: bytes) -> dict[int, float]:
    """Job number -> its first completion time, from the S1 done file."""
    first: dict[int, float] = {}
    for n, when in _PROBE.iter_unpack(data[: len(data) - len(data) % _PROBE.size]):
        if n not in first or when < first[n]:
            first[n] = when
    return first


def _s1(peer: Peer, ctx: Context) -> list[dict[str, Any]]:
    args = ctx.args
    started = time.monotonic()
    how = peer.prefill(ctx, args.jobs)
    prefill_s = time.monotonic() - started
    done_file = ctx.workdir / "done"
    done_file.touch()
    worker = ctx.spawn_worker({"BENCH_DONE_FILE": str(done_file)})
    try:
        spawned = time.monotonic()
        t0 = worker.wait_started()
        target = _PROBE.size * args.jobs
        stop_at = t0 + args.deadline
        while time.monotonic() <= stop_at:
            if done_file.stat().st_size >= target:
                missing = args.jobs - len(_completions(done_file.read_bytes()))
                if missing <= 0:
                    break
                target += _PROBE.size * missing  # some ran twice: wait for the rest
            worker.check_alive()
            time.sleep(0.005)
        data = done_file.read_bytes()
    finally:
        worker.stop()
    completions = _completions(data)
    count = len(completions)
    if count == 0:
        raise BenchError(f"no job completed within {args.deadline:.0f} s: {worker.log_tail()}")
    first, last = min(completions.values()), max(completions.values())
    rate = count / (last - t0)
    note = f"{count} jobs in {last - t0:.2f} s from worker start"
    if count > 1 and last > first:
        note += f" ({(count - 1) / (last - first):.0f} jobs/s from the 1st job done)"
    runs = len(data) // _PROBE.size
    if runs > count:
        note += f"; {runs - count} job(s) ran twice"
    note += f"; worker start-up {t0 - spawned:.2f} s not counted; prefilled in {prefill_s:.1f} s"
    note += f" ({how})"
    if count < args.jobs:
        note += f"; stopped after {args.deadline:.0f} s with {count}/{args.jobs} jobs done"
    return [result("drain", rate, "jobs/s", note)]


def _s3(peer: Peer, ctx: Context) -> list[dict[str, Any]]:
    probe = Probe()
    worker = ctx.spawn_worker({"BENCH_PROBE_PORT": str(probe.port)})
    try:
        worker.wait_started(ready=True)
        samples = peer.latencies(ctx, probe)
    finally:
        worker.stop()
        probe.close()
    note = f"{len(samples)} samples after a warm-up"
    if len(samples) < ctx.args.samples:
        note += f" (cut at the {ctx.args.deadline:.0f} s deadline)"
    return [
        result("p50", percentile(samples, 50), "ms", note),
        result("p99", percentile(samples, 99), "ms", note),
        result("mean", statistics.fmean(samples), "ms", note),
    ]


def _s4(peer: Peer, ctx: Context) -> list[dict[str, Any]]:
    args = ctx.args
    helpers = _load_redis_helpers()
    commandstats = cast("Callable[[str], dict[str, int]]", helpers.commandstats)
    worker = ctx.spawn_worker({})
    try:
        worker.wait_started(ready=True)
        time.sleep(args.settle)
        worker.check_alive()
        before = commandstats(args.redis)
        start = time.monotonic()
        time.sleep(args.window)
        after = commandstats(args.redis)
        elapsed = time.monotonic() - start
        worker.check_alive()
    finally:
        worker.stop()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if k != "info"}
    delta = {k: v for k, v in delta.items() if v > 0}
    total = sum(delta.values())
    top = sorted(delta.items(), key=lambda kv: -kv[1])[:4]
    detail = ", ".join(f"{k} {v / elapsed:.1f}/s" for k, v in top) or "no command"
    note = f"{args.queues} queue(s), {elapsed:.1f} s window {args.settle:g} s after ready: {detail}"
    return [result(f"{args.queues}q", total / elapsed, "cmds/s", note)]


def run_producer(peer: Peer, args: Args, script: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"bench-{peer.name}-") as tmp:
        ctx = Context(args=args, workdir=Path(tmp), script=script)
        if args.scenario == "S1":
            results = _s1(peer, ctx)
        elif args.scenario == "S2":
            results = peer.enqueue_timed(ctx, args.jobs)
        elif args.scenario == "S3":
            results = _s3(peer, ctx)
        else:
            results = _s4(peer, ctx)
    return {"results": results, "notes": ctx.notes}


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Whatever libraries print goes to stderr: stdout carries our one JSON line only."""
    saved = os.dup(1)
    try:
        sys.stdout.flush()
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _watch_parent() -> None:
    """A worker whose producer died (killed on a time-out) takes its process group down."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        with contextlib.suppress(OSError):
            os.killpg(os.getpgid(0), signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, name="bench-parent-watch", daemon=True).start()


class _Terminated(BaseException):
    pass


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated(f"signal {signum}")


def main(peer: Peer, script: str) -> int:
    """Entry point of every Python runner."""
    args = parse_args()
    if args.role == "worker":
        _watch_parent()
        peer.worker(args)
        return 0
    out: dict[str, Any] = {"peer": peer.name, "scenario": args.scenario, "queues": args.queues}
    code = 0
    signal.signal(signal.SIGTERM, _raise_terminated)  # so that `finally` stops the worker
    with _stdout_to_stderr():
        try:
            out["version"] = peer.version()
            out.update(run_producer(peer, args, script))
        except (Exception, _Terminated) as exc:  # reported: the harness goes on with the others
            traceback.print_exc()
            out["error"] = f"{type(exc).__name__}: {exc}"
            code = 1
        finally:
            for worker in list(_live_workers):
                worker.stop()
    print(json.dumps(out), flush=True)
    return code
