"""``durable-trio worker --processes N``: a Trio supervisor of N worker processes.

::

    async with open_worker_processes("shop.flows:app", url, processes=2) as supervisor:
        await trio.sleep_forever()     # until cancelled, or leave the block

Each child is ``python -m durable_trio worker MODULE:app ...`` with the same options and its
own ``--instance-id`` (so its own liveness keys). A child that exits is started again after an
exponential backoff (:class:`RestartPolicy`), bounded by ``backoff_max``: a slot is never given
up (issue 30, item 10: one poison step must not halve a worker for good). A slot whose child
died ``crash_limit`` times within ``crash_window`` seconds is *crash-looping*: logged, restarted
every ``backoff_max``, shown by ``durable-trio health`` and the console with its last exit
status (the supervisor's key in the key store, when given a namespace: :func:`read_supervisors`),
and it makes the exit status :data:`CRASH_LOOP_EXIT` if it still is at the close. Leaving the
block is the close: SIGTERM to every child (each runs its
own bounded close: ``close_timeout`` for running steps, the rest handed back), a wait bounded by
:attr:`WorkerProcesses.close_bound`, then SIGKILL for what remains (its claims come back through
the stalled sweep of the others, as after a crash).

Children run in their own session, so a terminal's Ctrl-C reaches only the supervisor, which
forwards it once: a child never takes one keypress for two signals ("close now"). A child whose
supervisor vanished (kill -9) notices within a second and closes gracefully
(:func:`watch_parent`).
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import signal
import socket
import sys
import time
import uuid
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import attrs
import orjson
import trio

from ._backoff import Backoff
from ._errors import BrokerError, ConfigError, DurableTrioError
from ._logs import get_logger
from ._naming import QueueNames
from ._transport._options import DEFAULT_CLEANUP_TIMEOUT, DEFAULT_CLOSE_TIMEOUT
from ._transport._supervised import (
    SupervisedSlot,
    crash_loop_lines,
    read_supervisors,
    supervisor_key,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence


__all__ = [
    "CRASH_LOOP_EXIT",
    "RestartPolicy",
    "SupervisedSlot",
    "WorkerProcess",
    "WorkerProcesses",
    "crash_loop_lines",
    "open_worker_processes",
    "read_supervisors",
    "resolve_processes",
    "run_worker_processes",
    "watch_parent",
]

_log = get_logger("durable_trio")

#: The supervisor's exit status when a slot was crash-looping at the close.
CRASH_LOOP_EXIT = 3
#: Seconds between two writes of the supervisor's key (also written at every start and death).
STATE_INTERVAL = 10.0
#: Its time to live: it goes with a supervisor killed with -9.
STATE_TTL = 35.0
#: Seconds, beyond a child's own close bound, that the supervisor waits before SIGKILL.
CLOSE_MARGIN = 2.0
#: The environment variable a child reads its supervisor's pid from (see :func:`watch_parent`).
PARENT_ENV = "DURABLE_TRIO_SUPERVISOR_PID"


def resolve_processes(value: int | str) -> int:
    """``value`` (a positive int, its decimal string, or ``"auto"``: ``os.cpu_count()``) as a
    number of worker processes.

    Raises:
        ConfigError: anything else.
    """
    if value == "auto":
        return os.cpu_count() or 1
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"processes must be a positive integer or 'auto', got {value!r}")
    return value


@attrs.frozen
class RestartPolicy:
    """When a dead child is started again, and when its slot counts as crash-looping.

    The n-th death of a slot within ``crash_window`` seconds waits
    ``min(backoff_initial * 2 ** (n - 1), backoff_max)`` before the restart: never longer than
    ``backoff_max``, and never given up. From the ``crash_limit``-th the slot is
    *crash-looping* (a log line, a mark in ``durable-trio health`` and the console, and
    :data:`CRASH_LOOP_EXIT` if it still is at the close) until its deaths fall out of the
    window. A child that ran longer than ``crash_window`` starts the count afresh.
    """

    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    crash_limit: int = 5
    crash_window: float = 60.0

    def __attrs_post_init__(self) -> None:
        for name in ("backoff_initial", "backoff_max", "crash_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"RestartPolicy.{name} must be positive, got {value!r}")
        if not math.isfinite(self.backoff_max):  # refused here, not by a slot's first restart
            raise ConfigError(f"RestartPolicy.backoff_max must be finite, got {self.backoff_max!r}")
        if isinstance(self.crash_limit, bool) or not isinstance(self.crash_limit, int):
            raise ConfigError(f"RestartPolicy.crash_limit must be an int, got {self.crash_limit!r}")
        if self.crash_limit < 1:
            raise ConfigError(f"RestartPolicy.crash_limit must be >= 1, got {self.crash_limit}")


class _Deaths:
    """One slot's recent deaths: what the next restart waits, or that the slot gives up."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.times: collections.deque[float] = collections.deque()
        # An initial above the cap waits the cap from the first death, as the policy's
        # formula says; Backoff wants initial <= maximum, so it is clipped, not refused.
        self.backoff = Backoff(min(policy.backoff_initial, policy.backoff_max), policy.backoff_max)

    def record(self, now: float) -> tuple[float, bool]:
        """A death at ``now``: seconds to wait before the restart (at most ``backoff_max``),
        and whether the slot is crash-looping (``crash_limit`` deaths within the window)."""
        policy = self.policy
        self.times.append(now)
        recent = self.recent(now)
        return self.backoff.delay(recent), recent >= policy.crash_limit

    def recent(self, now: float) -> int:
        """Deaths within the window that ends at ``now``."""
        while self.times and self.times[0] <= now - self.policy.crash_window:
            self.times.popleft()
        return len(self.times)

    def looping(self, now: float) -> bool:
        """Whether the slot is crash-looping at ``now``."""
        return self.recent(now) >= self.policy.crash_limit


@attrs.define
class WorkerProcess:
    """One slot's current (or last) child."""

    slot: int
    pid: int
    instance_id: str
    generation: int
    """0 for the first child of the slot, then one more per restart."""
    returncode: int | None = None
    last_exit: int | None = None
    """The exit status of the slot's previous child (``None`` for its first)."""
    last_exit_at: float | None = None
    """When it exited (Unix time)."""
    crash_looping: bool = False
    """Whether the slot was crash-looping when this child started (see :class:`RestartPolicy`)."""


def _child_argv(
    target: str, backend_url: str, instance_id: str, worker_args: Sequence[str]
) -> list[str]:
    return [
        sys.executable, "-m", "durable_trio", "worker", target,
        "--backend", backend_url, "--processes", "1", "--instance-id", instance_id,
        *worker_args,
    ]  # fmt: skip


class WorkerProcesses:
    """N supervised worker processes. Open with :func:`open_worker_processes`.

    Attributes:
        processes: the number of slots.
        children: each slot's current child (``None`` before its first start).
        crash_looping: the slots crash-looping now (restarted every ``backoff_max``).
        restarts: children started again after a death, over all slots.
        close_bound: seconds the close waits for the children before SIGKILL.
        state_writes: the supervisor's key writes (``durable-trio health`` reads them).
    """

    def __init__(
        self,
        argv: Callable[[str], list[str]],
        processes: int,
        policy: RestartPolicy,
        close_bound: float,
        env: dict[str, str],
    ) -> None:
        self.processes = processes
        self.children: list[WorkerProcess | None] = [None] * processes
        self.restarts = 0
        self.state_writes = 0
        self.supervisor_id = f"{socket.gethostname()}:{os.getpid()}"
        self._deaths: dict[int, _Deaths] = {}
        self.close_bound = close_bound
        self._argv = argv
        self._policy = policy
        self._env = env
        self._live: dict[int, trio.Process] = {}
        self._signalled: set[int] = set()
        """Pids already sent a signal (the close does not send them a second one)."""
        self._stopping = False
        # Swapped by hand, not a RepeatedEvent: the key writer takes the event before a write,
        # so a start or death during that write still wakes it at once after.
        self._changed = trio.Event()

    @property
    def crash_looping(self) -> set[int]:
        """The slots crash-looping now (``crash_limit`` deaths within ``crash_window``)."""
        now = trio.current_time()
        return {slot for slot, deaths in self._deaths.items() if deaths.looping(now)}

    @property
    def exit_status(self) -> int:
        """:data:`CRASH_LOOP_EXIT` if a slot is crash-looping, else 0."""
        return CRASH_LOOP_EXIT if self.crash_looping else 0

    def slots(self) -> list[SupervisedSlot]:
        """Every slot now (what the supervisor's key holds)."""
        out = []
        now = trio.current_time()
        for slot, child in enumerate(self.children):
            deaths = self._deaths.get(slot)
            if child is None or deaths is None:
                continue
            running = child.returncode is None
            out.append(
                SupervisedSlot(
                    supervisor=self.supervisor_id,
                    slot=slot,
                    pid=child.pid if running else None,
                    instance_id=child.instance_id,
                    restarts=child.generation,
                    crash_looping=deaths.looping(now),
                    last_exit=child.last_exit if running else child.returncode,
                    last_exit_at=child.last_exit_at,
                    deaths=deaths.recent(now),
                    window=self._policy.crash_window,
                )
            )
        return out

    async def wait_changed(self) -> None:
        """Return at the next start or death of a child (for tests and monitors)."""
        await self._changed.wait()

    def _touch(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def forward(self, signum: int, *, once: bool = False) -> None:
        """Send ``signum`` to every running child (``once``: only to those not signalled
        yet, so a child that closes gracefully is not told to close now)."""
        for process in list(self._live.values()):
            if process.returncode is None and not (once and process.pid in self._signalled):
                self._signalled.add(process.pid)
                process.send_signal(signum)

    async def _run_slot(
        self, slot: int, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        deaths = self._deaths[slot] = _Deaths(self._policy)
        generation = 0
        started = False
        last_exit: int | None = None
        last_exit_at: float | None = None
        while not self._stopping:
            instance_id = f"{uuid.uuid4().hex[:12]}-p{slot}"
            process = await trio.lowlevel.open_process(
                self._argv(instance_id), env=self._env, start_new_session=True
            )
            self._live[slot] = process
            if self._stopping:  # the close began while it started
                self.forward(signal.SIGTERM, once=True)
            child = WorkerProcess(
                slot,
                process.pid,
                instance_id,
                generation,
                last_exit=last_exit,
                last_exit_at=last_exit_at,
                crash_looping=deaths.looping(trio.current_time()),
            )
            self.children[slot] = child
            _log.info("worker process %d started: pid %d, instance %s", slot, process.pid,
                      instance_id)  # fmt: skip
            self._touch()
            if not started:
                started = True
                task_status.started()
            try:
                child.returncode = await process.wait()
                last_exit, last_exit_at = child.returncode, time.time()
                child.last_exit_at = last_exit_at
            finally:
                # cancelled (a hard stop): the child must not outlive its supervisor
                if process.returncode is None:
                    process.kill()
                    with trio.CancelScope(shield=True):
                        await process.wait()
                self._live.pop(slot, None)
            self._touch()
            if self._stopping:
                return
            delay, looping = deaths.record(trio.current_time())
            if looping:
                _log.error(
                    "worker process %d: crash loop (%d deaths within %g s, the last with "
                    "status %s): restarting every %g s",
                    slot, len(deaths.times), self._policy.crash_window, child.returncode, delay,
                )  # fmt: skip
            _log.warning(
                "worker process %d (pid %d) exited with status %s: restarting in %g s",
                slot, child.pid, child.returncode, delay,
            )  # fmt: skip
            await trio.sleep(delay)
            generation += 1
            self.restarts += 1

    def _state(self) -> bytes:
        return orjson.dumps(
            {
                "supervisor": self.supervisor_id,
                "at": time.time(),
                "slots": [
                    {
                        "slot": s.slot,
                        "pid": s.pid,
                        "instance": s.instance_id,
                        "restarts": s.restarts,
                        "crashLooping": s.crash_looping,
                        "lastExit": s.last_exit,
                        "lastExitAt": s.last_exit_at,
                        "deaths": s.deaths,
                        "window": s.window,
                    }
                    for s in self.slots()
                ],
            }
        )

    async def _publish(self, backend_url: str, namespace: str) -> None:
        """Keep the supervisor's key (its slots: restarts, crash loops, last exits) in the
        backend's key store, for ``durable-trio health`` and the console: at every start and
        death of a child and every :data:`STATE_INTERVAL`; removed at the close. Best-effort:
        a backend that cannot be opened, or a write that fails, is logged once."""
        from .backends import open_backend

        key = supervisor_key(QueueNames(namespace), self.supervisor_id)
        warned = False
        try:
            async with open_backend(backend_url) as backend:
                keys = backend.keys
                if keys is None:
                    return
                try:
                    while True:
                        changed = self._changed
                        try:
                            await keys.put_many([(key, self._state(), STATE_TTL)])
                            self.state_writes += 1
                        except (BrokerError, DurableTrioError) as exc:
                            if not warned:
                                warned = True
                                _log.warning("the supervisor's key was not written: %s", exc)
                        with trio.move_on_after(STATE_INTERVAL):
                            await changed.wait()
                finally:
                    with (
                        trio.move_on_after(2.0, shield=True),
                        contextlib.suppress(BrokerError, DurableTrioError),  # it expires
                    ):
                        await keys.remove([key])
        except (BrokerError, DurableTrioError, OSError) as exc:
            _log.warning("the supervisor's key store is not available: %s", exc)

    async def _close(self, nursery: trio.Nursery) -> None:
        """SIGTERM every child, wait ``close_bound`` (shielded), SIGKILL what remains."""
        self._stopping = True
        self.forward(signal.SIGTERM, once=True)
        with trio.move_on_after(self.close_bound, shield=True) as bound:
            while self._live:
                await self.wait_changed()
        if bound.cancelled_caught and self._live:
            _log.error(
                "worker process(es) %s did not close within %g s: killed",
                sorted(self._live), self.close_bound,
            )  # fmt: skip
            self.forward(signal.SIGKILL)
        nursery.cancel_scope.cancel()  # backoff sleeps; a killed child is reaped by its slot


@asynccontextmanager
async def open_worker_processes(
    target: str,
    backend_url: str,
    *,
    processes: int | str = "auto",
    worker_args: Sequence[str] = (),
    close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
    restart: RestartPolicy | None = None,
    namespace: str | None = None,
) -> AsyncIterator[WorkerProcesses]:
    """Run ``processes`` worker processes of ``target`` (``MODULE:app``) on ``backend_url``,
    restarting a dead one, until the block is left (then close them all, bounded).

    Args:
        target: the App, as ``durable-trio worker`` takes it (``MODULE:app`` or
            ``path/file.py:app``), importable from the current directory.
        backend_url: the backend URL every child opens.
        processes: how many (``"auto"``: ``os.cpu_count()``).
        worker_args: more ``durable-trio worker`` options for every child, e.g.
            ``["--concurrency", "16"]``.
        close_timeout: the children's ``close_timeout`` (passed as ``--close-timeout``); the
            close waits ``close_timeout + cleanup_timeout +`` :data:`CLOSE_MARGIN` seconds
            before SIGKILL.
        restart: backoff and crash-loop limit (default :class:`RestartPolicy()`).
        namespace: the children's namespace: the supervisor then keeps its slots (restarts,
            crash loops, last exit statuses) in the backend's key store, where
            ``durable-trio health`` and the console show them (``None``: it does not).

    Raises:
        ConfigError: a bad ``processes`` or ``close_timeout``.

    Cancellation:
        Cancelling the block's body runs the same bounded close (shielded); a child is never
        left running once the block is left.
    """
    count = resolve_processes(processes)
    if isinstance(close_timeout, bool) or not isinstance(close_timeout, int | float):
        raise ConfigError(f"close_timeout must be a number of seconds, got {close_timeout!r}")
    if close_timeout < 0:
        raise ConfigError(f"close_timeout must be >= 0, got {close_timeout!r}")
    args = [*worker_args, "--close-timeout", repr(float(close_timeout))]
    env = {**os.environ, PARENT_ENV: str(os.getpid())}
    supervisor = WorkerProcesses(
        lambda instance_id: _child_argv(target, backend_url, instance_id, args),
        count,
        restart or RestartPolicy(),
        close_timeout + DEFAULT_CLEANUP_TIMEOUT + CLOSE_MARGIN,
        env,
    )
    async with trio.open_nursery() as nursery:
        try:
            for slot in range(count):
                await nursery.start(supervisor._run_slot, slot)
            if namespace is not None:
                nursery.start_soon(supervisor._publish, backend_url, namespace)
            yield supervisor
        finally:
            await supervisor._close(nursery)


def run_worker_processes(
    target: str,
    backend_url: str,
    *,
    processes: int | str = "auto",
    worker_args: Sequence[str] = (),
    close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
    restart: RestartPolicy | None = None,
    announce: Callable[[str], object] | None = None,
    namespace: str | None = None,
) -> int:
    """``durable-trio worker --processes N``, from Python: supervise the children until
    SIGTERM / SIGINT (forwarded to every child, which closes gracefully; a second one is
    forwarded too: the children close now). A crash-looping slot is restarted every
    ``backoff_max``, never given up.

    Takes the arguments of :func:`open_worker_processes`; ``announce`` is called with a line
    per signal (default: a warning on the ``durable_trio`` logger).

    Returns:
        the exit status: 0, :data:`CRASH_LOOP_EXIT` if a slot was crash-looping at the close,
        or ``128 + signum`` if a second signal forced the close.
    """
    say = announce or (lambda line: _log.warning("%s", line))

    async def main() -> int:
        received: list[int] = []
        async with trio.open_nursery() as nursery:
            first = trio.Event()
            async with open_worker_processes(
                target,
                backend_url,
                processes=processes,
                worker_args=worker_args,
                close_timeout=close_timeout,
                restart=restart,
                namespace=namespace,
            ) as supervisor:

                async def forward(*, task_status: trio.TaskStatus[None]) -> None:
                    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                        task_status.started()
                        async for signum in signals:
                            received.append(signum)
                            name = signal.Signals(signum).name
                            if len(received) == 1:
                                say(
                                    f"{name}: closing {supervisor.processes} worker "
                                    "process(es) gracefully (send it again to close now)"
                                )
                            else:
                                say(f"{name} again: the worker processes close now")
                            supervisor.forward(signum)
                            first.set()

                await nursery.start(forward)
                await first.wait()
            nursery.cancel_scope.cancel()
        if len(received) >= 2:
            return 128 + received[1]
        return supervisor.exit_status

    return trio.run(main)


async def watch_parent(parent: int, on_gone: Callable[[], object], interval: float = 1.0) -> None:
    """Call ``on_gone()`` once this process's parent is no longer ``parent`` (it died and the
    process was re-parented), checking every ``interval`` seconds; then return."""
    while os.getppid() == parent:  # noqa: ASYNC110  (no event tells a re-parenting)
        await trio.sleep(interval)
    on_gone()
