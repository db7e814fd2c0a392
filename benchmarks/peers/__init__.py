"""Other Redis job queues, measured in the same run on the same Redis as ours (``make bench``).

:func:`run_peers` runs SAQ, arq, rq, Dramatiq, Celery, taskiq and (where ``node`` exists) BullMQ
through the scenarios S1-S4 and returns one row per figure. Every peer runs in a subprocess, with
its own interpreter from a throwaway environment (:mod:`benchmarks.peers.venv`): nothing of theirs
is imported here. How each peer is driven: ``benchmarks/peers/README.md``.

* S1: drain N pre-enqueued no-op jobs with one worker process (concurrency 10): jobs/s from the
  worker's start to the last job done.
* S2: enqueue N jobs one by one, and in bulk where the peer has a bulk API: jobs/s.
* S3: enqueue -> job done latency, one job at a time, idle worker: p50 / p99 ms.
* S4: Redis commands/s of an idle worker process on 1 and on 10 queues, from ``INFO
  commandstats`` deltas over a window, each on a private ``redis-server`` of its own.

S1-S3 use the given (private) server, ``FLUSHALL``-ed before every run and at the end.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import redis_server
from . import venv

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["PEERS", "SCENARIOS", "format_table", "run_peers"]

PEERS = ("bullmq", "dramatiq", "taskiq", "saq", "celery", "arq", "rq")
SCENARIOS = ("S1", "S2", "S3", "S4")
_METRICS = {  # what each scenario reports, in order
    "S1": ("drain",),
    "S2": ("one-by-one", "bulk"),
    "S3": ("p50", "p99"),
    "S4": ("1q", "10q"),
}
_SCRUBBED_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")


@dataclass(frozen=True)
class Plan:
    """Sizes and time bounds of one harness run."""

    reps: int
    jobs: int
    samples: int
    warmup: int
    window: float
    settle: float
    s1_deadline: float  # stop a slow drain after this long and report the rate so far
    s3_deadline: float  # stop sampling after this long (at least 10 samples)
    s4_parallel: int = 4  # S4 workers measured at once, each with its own private server

    def timeout(self, scenario: str) -> float:
        """Hard bound of one runner subprocess."""
        if scenario == "S1":
            return self.s1_deadline + 150.0
        if scenario == "S3":
            return self.s3_deadline + 120.0
        if scenario == "S4":
            return self.settle + self.window + 120.0
        return 240.0


FULL = Plan(
    reps=3, jobs=10_000, samples=300, warmup=30, window=10.0, settle=3.0,
    s1_deadline=15.0, s3_deadline=8.0,
)  # fmt: skip
QUICK = Plan(
    reps=1, jobs=1_000, samples=100, warmup=20, window=3.0, settle=2.0,
    s1_deadline=5.0, s3_deadline=3.0,
)  # fmt: skip


@dataclass(frozen=True)
class _Target:
    """One row label: a peer, possibly with a non-default knob."""

    label: str
    env: venv.PeerEnv
    extra_env: dict[str, str] = field(default_factory=dict)
    scenarios: tuple[str, ...] = SCENARIOS
    note: str = ""


class _RunFailed(Exception):
    pass


def _targets(envs: dict[str, venv.PeerEnv]) -> list[_Target]:
    out: list[_Target] = []
    for name, env in envs.items():
        out.append(_Target(name, env))
        if name == "arq":  # its default 0.5 s poll dominates S1/S3: show the knob's effect too
            variant = _Target(
                "arq (poll 50 ms)", env, {"BENCH_ARQ_POLL_DELAY": "0.05"},
                scenarios=("S1", "S3", "S4"), note="poll_delay=0.05 (default 0.5)",
            )  # fmt: skip
            out.append(variant)
    return out


def _invoke(
    target: _Target, redis_url: str, scenario: str, plan: Plan, *, queues: int = 1
) -> dict[str, Any]:
    """Run one runner subprocess; its parsed JSON line (raises _RunFailed with the reason)."""
    assert target.env.command is not None
    argv = [
        *target.env.command,
        "--redis", redis_url, "--scenario", scenario, "--jobs", str(plan.jobs),
        "--queues", str(queues), "--window", str(plan.window), "--settle", str(plan.settle),
        "--samples", str(plan.samples), "--warmup", str(plan.warmup),
        "--deadline", str(plan.s1_deadline if scenario == "S1" else plan.s3_deadline),
        "--concurrency", "10",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    env.update(target.env.env)
    env.update(target.extra_env)
    timeout = plan.timeout(scenario)
    process = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=env, text=True, start_new_session=True, cwd=venv.PEERS_DIR,
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        raise _RunFailed(f"timed out after {timeout:.0f} s") from None
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = [line for line in stderr.strip().splitlines() if line.strip()]
        reason = tail[-1].strip() if tail else f"exit code {process.returncode}, no output"
        raise _RunFailed(reason[:300])
    try:
        out: dict[str, Any] = json.loads(lines[-1])
    except ValueError as exc:
        raise _RunFailed(f"unreadable output: {exc}") from None
    if out.get("error"):
        raise _RunFailed(str(out["error"])[:300])
    return out


def _kill_group(process: subprocess.Popen[str]) -> None:
    """SIGTERM the runner's group (it stops its worker), SIGKILL it 5 s later."""
    for signum, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            break
        try:
            process.communicate(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue


def _row(
    target: _Target, scenario: str, metric: str | None, value: float | None, unit: str, note: str
) -> dict[str, Any]:
    if target.note:
        note = f"{target.note}; {note}" if note else target.note
    return {
        "peer": target.label, "scenario": scenario, "metric": metric, "value": value,
        "unit": unit, "note": note,
    }  # fmt: skip


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _aggregate(target: _Target, scenario: str, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per metric: the median over the runs, the individual runs in the note."""
    rows: list[dict[str, Any]] = []
    version = runs[0].get("version", "?")
    for metric in _METRICS[scenario]:
        found = [r for run in runs for r in run.get("results", []) if r.get("metric") == metric]
        if not found:
            continue
        values = [float(r["value"]) for r in found if r.get("value") is not None]
        unit = str(found[0].get("unit", ""))
        if not values:
            rows.append(_row(target, scenario, metric, None, unit, str(found[0].get("note", ""))))
            continue
        median = statistics.median(values)
        nearest = min(found, key=lambda r: abs(float(r.get("value") or 0.0) - median))
        note = f"{target.env.peer} {version}; {nearest.get('note', '')}"
        extra = [str(n) for run in runs for n in run.get("notes", [])]
        if extra:
            note += "; " + "; ".join(dict.fromkeys(extra))
        if len(values) > 1:
            note += f"; median of {len(values)}: " + ", ".join(_fmt(v) for v in values)
        rows.append(_row(target, scenario, metric, median, unit, note))
    return rows


def _failed(target: _Target, scenario: str, reason: str) -> dict[str, Any]:
    return _row(target, scenario, None, None, "", reason)


def _run_sequential(
    target: _Target, redis_url: str, scenario: str, plan: Plan, say: Callable[[str], None]
) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    for rep in range(plan.reps):
        redis_server.flushall(redis_url)
        started = time.monotonic()
        try:
            out = _invoke(target, redis_url, scenario, plan)
        except _RunFailed as exc:
            say(f"peers: {target.label} {scenario} run {rep + 1}: FAILED: {exc}")
            return [_failed(target, scenario, f"failed: {exc}")]
        runs.append(out)
        figures = ", ".join(
            f"{r['metric']} {_fmt(r['value'])}"
            for r in out.get("results", [])
            if r.get("value") is not None
        )
        took = time.monotonic() - started
        say(f"peers: {target.label} {scenario} run {rep + 1}/{plan.reps}: {figures} ({took:.1f} s)")
    redis_server.flushall(redis_url)
    return _aggregate(target, scenario, runs)


def _run_idle(target: _Target, queues: int, plan: Plan) -> dict[str, Any] | str:
    """S4 for one target and queue count, on a private server of its own: its output or why not."""
    try:
        with redis_server.private_redis() as server:
            return _invoke(target, server.url, "S4", plan, queues=queues)
    except (_RunFailed, redis_server.RedisError, OSError) as exc:
        return str(exc)


def _run_s4(targets: list[_Target], plan: Plan, say: Callable[[str], None]) -> list[dict[str, Any]]:
    jobs = [(t, q) for t in targets for q in (1, 10)]
    if not jobs:
        return []
    say(f"peers: S4 idle workers, {len(jobs)} at once (at most {plan.s4_parallel}), "
        f"each on its own private redis-server, {plan.window:.0f} s window")  # fmt: skip
    with ThreadPoolExecutor(max_workers=plan.s4_parallel) as pool:
        outs = list(pool.map(lambda job: _run_idle(job[0], job[1], plan), jobs))
    rows: list[dict[str, Any]] = []
    for target in targets:
        runs: list[dict[str, Any]] = []
        for (t, queues), out in zip(jobs, outs, strict=True):
            if t is not target:
                continue
            if isinstance(out, str):
                rows.append(_row(target, "S4", f"{queues}q", None, "cmds/s", f"failed: {out}"))
            else:
                runs.append(out)
        for run in runs:
            rows += _aggregate(target, "S4", [run])
    return rows


def run_peers(
    redis_url: str,
    *,
    quick: bool,
    scenarios: list[str],
    peers: Sequence[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every available peer through ``scenarios``; one row per figure.

    Rows: ``{"peer", "scenario", "metric", "value", "unit", "note"}``; ``value`` is the median of
    3 runs (1 in ``quick`` mode, which also uses 1,000 jobs and 3 s windows), or ``None`` with the
    reason in ``note`` ("unavailable: ...", "failed: ...", "n/a: ..."). ``redis_url`` must be a
    private server: it is ``FLUSHALL``-ed between runs. Progress goes to ``log`` (default: stderr).
    """
    say = log or (lambda message: print(message, file=sys.stderr, flush=True))
    plan = QUICK if quick else FULL
    wanted = [s for s in SCENARIOS if s in scenarios]
    names = [p for p in PEERS if peers is None or p in peers]
    envs = venv.ensure_envs(names, log=say)
    rows: list[dict[str, Any]] = []
    runnable: list[_Target] = []
    for name, env in envs.items():
        if env.available:
            seconds = env.install_seconds
            how = "reused" if seconds is None else f"installed in {seconds} s"
            say(f"peers: {name} environment {how}, {env.size_mb} MB")
    for target in _targets(envs):
        if not target.env.available:
            say(f"peers: {target.label} unavailable: {target.env.reason}")
            for scenario in wanted:
                if scenario in target.scenarios:
                    rows.append(_failed(target, scenario, f"unavailable: {target.env.reason}"))
            continue
        runnable.append(target)
    for target in runnable:
        for scenario in wanted:
            if scenario != "S4" and scenario in target.scenarios:
                rows += _run_sequential(target, redis_url, scenario, plan, say)
    if "S4" in wanted:
        rows += _run_s4([t for t in runnable if "S4" in t.scenarios], plan, say)
    order = {t.label: i for i, t in enumerate(_targets(envs))}
    rows.sort(key=lambda r: (r["scenario"], order.get(r["peer"], 99)))
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Rows as a plain-text table (value, unit, peer, metric; notes shortened)."""
    lines: list[str] = []
    for row in rows:
        value = "-" if row["value"] is None else _fmt(float(row["value"]))
        label = f"{row['scenario']} {row['metric'] or ''}".strip()
        note = str(row["note"])
        lines.append(f"  {label:<16} {row['peer']:<18} {value:>10} {row['unit']:<7} {note[:110]}")
    return "\n".join(lines)
