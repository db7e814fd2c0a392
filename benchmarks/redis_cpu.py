"""Our Redis client's CPU per command beside ioredis's, in the same run (issue 35, item 1).

The work, for each column: ``C`` concurrent callers (1, then 10) share ONE connection and send
``N`` commands in all (``RPUSH`` of one small value onto one list), each caller awaiting its reply
before its next command. The figure is the CPU the client's process spends per command
(user + system: ``time.process_time`` in Python, ``process.cpuUsage`` in Node), with the wall
time per command and the commands per write in the note. Every column runs in a process of its
own on the same private ``redis-server``; the columns take turns, ``ROUNDS`` times, and each
figure is the lowest of its turns (on a shared machine, load that comes and goes hits every
column alike, and the lowest is the one least disturbed). Columns:

* ours: ``durable_trio._redis.open_redis(url, pool_size=1)`` under ``trio.run``
  (benchmarks/_redis_cpu_worker.py);
* before (``--baseline TREE``): the same worker, with another checkout's ``durable_trio`` first
  on ``PYTHONPATH`` (``--baseline /path/to/main``: before/after back to back);
* ioredis (Node), one ``new IORedis()`` with its defaults (benchmarks/peers/run_ioredis.mjs; its
  environment is built like BullMQ's by benchmarks/peers/venv.py; skipped without ``node``);
* the socket alone, one caller: a blocking Python socket sending the same command and reading its
  reply, no event loop, no parser: the floor of a Python client's loopback round trip.

Run it alone with ``python -m benchmarks.redis_cpu [--quick] [--baseline TREE]``, or as the
``redis-cpu`` section of ``python -m benchmarks``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .peers.venv import ensure_envs
from .redis_server import RedisError, private_redis, redis_version

Figures = dict[str, Any]

ROUNDS = 3
CALLERS = (1, 10)
TARGET = 1.6  # issue 35: at most 1.6x ioredis's CPU per command with 10 callers
HERE = Path(__file__).resolve().parent
WORKER = HERE / "_redis_cpu_worker.py"
TIMEOUT = 300.0


def _json_line(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run(
        argv, capture_output=True, text=True, env=env, timeout=TIMEOUT, check=False,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{Path(argv[1]).name} exited {done.returncode}: {tail[:200]}")
    result: dict[str, Any] = json.loads(lines[-1])
    if "error" in result:
        raise RuntimeError(str(result["error"]))
    return result


def ours(url: str, callers: int, commands: int, tree: Path) -> dict[str, float]:
    """One round of our client (``tree``'s ``durable_trio``) in a worker process."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [sys.executable, str(WORKER), "--redis", url, "--callers", str(callers)]
    result = _json_line([*argv, "--commands", str(commands)], env)
    figures: dict[str, float] = result["rounds"][0]
    return figures


def ioredis(command: list[str], env: dict[str, str], url: str, callers: int, commands: int) -> Any:
    """One round of ioredis (its JSON line: version, rounds)."""
    argv = [*command, "--redis", url, "--callers", str(callers), "--commands", str(commands)]
    return _json_line([*argv, "--rounds", "1"], {**os.environ, **env})


def socket_alone(url: str, commands: int) -> dict[str, float]:
    """A blocking socket's ``RPUSH`` round trips, one at a time: CPU and wall per command."""
    parts = urlsplit(url)
    if (parts.port or 6379) == 6379:
        raise ValueError("port 6379 is the machine's shared Redis: never used here")
    payload = b"*3\r\n$5\r\nRPUSH\r\n$16\r\nbench:socket:one\r\n$1\r\nx\r\n"
    with socket.create_connection((parts.hostname or "127.0.0.1", parts.port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(min(commands, 1000)):  # warm-up
            sock.sendall(payload)
            sock.recv(65536)
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(commands):
            sock.sendall(payload)
            sock.recv(65536)  # ":<n>\r\n" arrives in one segment on loopback
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        sock.sendall(b"*2\r\n$3\r\nDEL\r\n$16\r\nbench:socket:one\r\n")
        sock.recv(65536)
    return {"cpu_us": cpu / commands * 1e6, "wall_us": wall / commands * 1e6}


def _lowest(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Per measure, the lowest of the rounds."""
    return {key: min(r[key] for r in rounds) for key in rounds[0]}


def _figure(label: str, measured: dict[str, float], commands: int) -> Figures:
    note = f"wall {measured['wall_us']:.1f} us/command"
    if "per_write" in measured:
        note += f", {measured['per_write']:.1f} commands/write"
    return {label: (measured["cpu_us"], f"{note}; {commands:,} commands, lowest of turns")}


def run(url: str, quick: bool, baseline: Path | None = None) -> Figures:
    """Every column on ``url`` (a private server), taking turns; figures by caller count."""
    commands = 5000 if quick else 20000
    rounds = 1 if quick else ROUNDS
    env = ensure_envs(["ioredis"])["ioredis"]
    trees: dict[str, Path] = {"ours": HERE.parent}
    if baseline is not None:
        trees["before"] = baseline
    measured: dict[tuple[str, int], list[dict[str, float]]] = {}
    version = ""
    for _ in range(rounds):
        for callers in CALLERS:
            for who, tree in trees.items():
                measured.setdefault((who, callers), []).append(ours(url, callers, commands, tree))
            if env.command is not None:
                line = ioredis(env.command, env.env, url, callers, commands)
                version = line["version"]
                measured.setdefault(("ioredis", callers), []).append(line["rounds"][0])
        measured.setdefault(("socket", 1), []).append(socket_alone(url, commands))
    figures: Figures = {}
    peer = f"ioredis {version}"
    for callers in CALLERS:
        what = f"RPUSH, {callers} caller{'s' if callers > 1 else ''} on one connection"
        mine = _lowest(measured[("ours", callers)])
        figures |= _figure(f"ours: {what}, CPU us/command", mine, commands)
        if ("before", callers) in measured:
            before = _lowest(measured[("before", callers)])
            figures |= _figure(f"before ({baseline}): {what}, CPU us/command", before, commands)
        if ("ioredis", callers) in measured:
            theirs = _lowest(measured[("ioredis", callers)])
            figures |= _figure(f"{peer}: {what}, CPU us/command", theirs, commands)
            figures[f"ours / ioredis CPU per command, {callers} caller(s) (x)"] = (
                mine["cpu_us"] / theirs["cpu_us"]
            )
    if env.command is None:
        figures["ioredis"] = (float("nan"), f"skipped: {env.reason}")
    alone = _lowest(measured[("socket", 1)])
    mine = _lowest(measured[("ours", 1)])
    figures["socket alone: RPUSH round trip, 1 caller, wall us"] = (
        alone["wall_us"],
        f"CPU {alone['cpu_us']:.1f} us; blocking send + recv, no event loop",
    )
    figures["ours / socket alone, round trip wall, 1 caller (x)"] = (
        mine["wall_us"] / alone["wall_us"]
    )
    return figures


def section(quick: bool, baseline: Path | None = None) -> Figures:
    """``python -m benchmarks redis-cpu``: :func:`run` on a private redis-server."""
    try:
        with private_redis() as server:
            print(f"  (private redis-server {redis_version(server.url)} on {server.url})")
            return run(server.url, quick, baseline)
    except (RedisError, RuntimeError, subprocess.TimeoutExpired) as exc:
        return {"redis-cpu section skipped": (float("nan"), f"{type(exc).__name__}: {exc}")}


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.redis_cpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="smaller runs (a smoke test)")
    parser.add_argument(
        "--baseline", type=Path, help="another checkout (e.g. main): a 'before' column"
    )
    args = parser.parse_args()
    print(
        f"Redis client CPU per command — Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} core(s), {time.strftime('%Y-%m-%d %H:%M')}"
        f"{' (quick)' if args.quick else ''}"
    )
    start = time.perf_counter()
    figures = section(args.quick, args.baseline)
    width = max(map(len, figures), default=10)
    for key, value in figures.items():
        number, note = value if isinstance(value, tuple) else (value, "")
        print(f"  {key:<{width}}  {float(number):>10,.2f}  {note}")
    print(f"  ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
