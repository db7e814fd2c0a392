"""Throwaway environments for the peers: one virtualenv per Python peer, one npm folder for BullMQ.

They live in ``benchmarks/peers/.envs/`` (git-ignored; ``$DURABLE_TRIO_PEER_ENVS`` moves them) and
are NOT dependencies of the package: the runners execute with the peers' own interpreters, in
subprocesses. Why one venv per peer: their redis-py requirements do not overlap (arq 0.28 wants
``redis<6``, taskiq-redis 1.2 wants ``redis>=8``, SAQ's ``redis`` extra wants ``<8``).

An environment is reused when its ``.bench-complete`` marker names the same requirements and
interpreter; otherwise it is rebuilt. A failed install makes that peer "unavailable: <reason>".
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

__all__ = ["ENVS_DIR", "NODE_PEERS", "POSTGRES_PEERS", "PYTHON_PEERS", "PeerEnv", "ensure_envs"]

PEERS_DIR = Path(__file__).resolve().parent
ENVS_DIR = Path(os.environ.get("DURABLE_TRIO_PEER_ENVS", PEERS_DIR / ".envs"))
MARKER = ".bench-complete"
INSTALL_TIMEOUT = 600.0  # seconds, per environment

# name -> (pip requirements, modules that must import afterwards). Versions are pinned so that
# figures compare from run to run; bump them here (the environments rebuild themselves).
# hiredis goes in every venv: redis-py uses it when present, as our own Redis client does.
PYTHON_PEERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # saq 0.26.4 imports typing_extensions without declaring it
    "saq": (("saq[redis,hiredis]==0.26.4", "typing_extensions"), ("saq",)),
    "arq": (("arq==0.28.0",), ("arq",)),  # arq itself requires redis[hiredis]
    "rq": (("rq==3.0.0", "hiredis"), ("rq",)),
    "dramatiq": (("dramatiq[redis]==2.2.1", "hiredis"), ("dramatiq", "redis")),
    "celery": (("celery[redis]==5.7.0", "hiredis"), ("celery", "redis")),
    "taskiq": (("taskiq==0.13.0", "taskiq-redis==1.2.4", "hiredis"), ("taskiq", "taskiq_redis")),
}
# The PostgreSQL peers (issue 32), run against the private PostgreSQL server by
# ``benchmarks/peers/postgres.py``: pgqueuer on asyncpg (its fastest driver), DBOS Transact 3.4
# (the version the issue names) on psycopg.
POSTGRES_PEERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "pgqueuer": (("pgqueuer==1.6.0", "asyncpg==0.32.0"), ("pgqueuer", "asyncpg")),
    "dbos": (("dbos==3.4.0",), ("dbos", "psycopg")),
}
# BullMQ 6.7 made ioredis an optional peer dependency, yet it is still the driver it loads for
# plain connection options: install both.
# ioredis alone is the peer of our Redis client's per-command cost (benchmarks/redis_cpu.py),
# the version BullMQ runs on.
NODE_PEERS: dict[str, tuple[str, ...]] = {
    "bullmq": ("bullmq@6.7.0", "ioredis@6.0.0"),
    "ioredis": ("ioredis@6.0.0",),
}


@dataclass
class PeerEnv:
    """A peer's environment: how to run its runner, or why it cannot be run."""

    peer: str
    command: list[str] | None = None  # interpreter + runner script; None: unavailable
    env: dict[str, str] = field(default_factory=dict)
    reason: str = ""
    install_seconds: float | None = None  # None: reused from an earlier run
    size_mb: float | None = None

    @property
    def available(self) -> bool:
        return self.command is not None


def _size_mb(path: Path) -> float:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += (Path(root) / name).lstat().st_size
    return round(total / 1e6, 1)


def _read_marker(path: Path) -> dict[str, object] | None:
    try:
        data = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    # pip's real complaint is often above its generic last line
    errors = [line for line in lines if "ERROR" in line or "error:" in line.lower()]
    return (errors[-1] if errors else lines[-1] if lines else "no output").strip()[:300]


def _run(label: str, argv: list[str], cwd: Path | None, timeout: float) -> str | None:
    """Run an install step; None if it worked, else the reason."""
    try:
        done = subprocess.run(
            argv, cwd=cwd, capture_output=True, text=True, timeout=timeout,
            stdin=subprocess.DEVNULL, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"{label} timed out after {timeout:.0f} s"
    except OSError as exc:
        return f"{argv[0]}: {exc}"
    if done.returncode != 0:
        return f"{label} exited {done.returncode}: {_last_line(done.stderr)}"
    return None


def _python_env(peer: str, log: Callable[[str], None]) -> PeerEnv:
    requirements, modules = {**PYTHON_PEERS, **POSTGRES_PEERS}[peer]
    path = ENVS_DIR / peer
    python = path / "bin" / "python"
    script = str(PEERS_DIR / f"run_{peer}.py")
    wanted = {"requirements": list(requirements), "python": sys.version.split()[0]}
    marker = _read_marker(path)
    reusable = marker is not None and {k: marker.get(k) for k in wanted} == wanted
    if reusable and python.exists():
        return PeerEnv(peer, [str(python), script], size_mb=_size_mb(path))
    log(f"peers: installing {peer} ({' '.join(requirements)}) into {path}")
    started = time.monotonic()
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    reason = _run("venv", [sys.executable, "-m", "venv", str(path)], None, 120.0)
    if reason is None:
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        reason = _run("pip install", [*pip, *requirements], None, INSTALL_TIMEOUT)
    if reason is None:
        imports = "; ".join(f"import {m}" for m in modules)
        reason = _run("import check", [str(python), "-c", imports], None, 120.0)
    if reason is not None:
        shutil.rmtree(path, ignore_errors=True)
        return PeerEnv(peer, reason=f"install failed: {reason}")
    seconds = round(time.monotonic() - started, 1)
    (path / MARKER).write_text(json.dumps({**wanted, "install_seconds": seconds}))
    return PeerEnv(peer, [str(python), script], install_seconds=seconds, size_mb=_size_mb(path))


def _node_env(peer: str, log: Callable[[str], None]) -> PeerEnv:
    packages = NODE_PEERS[peer]
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        return PeerEnv(peer, reason="node/npm not found on PATH")
    path = ENVS_DIR / peer
    script = str(PEERS_DIR / f"run_{peer}.mjs")
    env = {f"{peer.upper()}_DIR": str(path)}
    wanted = {"packages": list(packages)}
    marker = _read_marker(path)
    if marker is not None and marker.get("packages") == wanted["packages"]:
        return PeerEnv(peer, [node, script], env=env, size_mb=_size_mb(path))
    log(f"peers: installing {peer} ({' '.join(packages)}) into {path} with npm")
    started = time.monotonic()
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    (path / "package.json").write_text('{"name": "bench-peer-env", "private": true}\n')
    npm_args = ["install", "--no-audit", "--no-fund", "--loglevel=error"]
    reason = _run("npm install", [npm, *npm_args, *packages], path, INSTALL_TIMEOUT)
    if reason is None:
        modules = [package.rsplit("@", 1)[0] for package in packages]
        check = [node, "-e", "; ".join(f"require('{module}')" for module in modules)]
        reason = _run("require check", check, path, 60.0)
    if reason is not None:
        shutil.rmtree(path, ignore_errors=True)
        return PeerEnv(peer, reason=f"install failed: {reason}")
    seconds = round(time.monotonic() - started, 1)
    (path / MARKER).write_text(json.dumps({**wanted, "install_seconds": seconds}))
    return PeerEnv(peer, [node, script], env=env, install_seconds=seconds, size_mb=_size_mb(path))


def _ignore_marker(directory: Path) -> None:
    """Keep the environments out of git even without benchmarks/peers/.gitignore."""
    directory.mkdir(parents=True, exist_ok=True)
    ignore = directory / ".gitignore"
    if not ignore.exists():
        ignore.write_text("*\n")


def ensure_envs(
    peers: Iterable[str], *, log: Callable[[str], None] | None = None
) -> dict[str, PeerEnv]:
    """Create (or reuse) the environments of ``peers``, several at once; never raises."""
    say = log or (lambda message: print(message, file=sys.stderr, flush=True))
    names = list(peers)
    _ignore_marker(ENVS_DIR)

    def one(peer: str) -> PeerEnv:
        try:
            if peer in PYTHON_PEERS or peer in POSTGRES_PEERS:
                return _python_env(peer, say)
            if peer in NODE_PEERS:
                return _node_env(peer, say)
            return PeerEnv(peer, reason="unknown peer")
        except Exception as exc:  # an environment problem must not stop the other peers
            return PeerEnv(peer, reason=f"install failed: {type(exc).__name__}: {exc}")

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(names, pool.map(one, names), strict=True))
