"""``durable-trio worker --processes N``: a Trio supervisor of N worker processes.

::

    async with open_worker_processes("shop.flows:app", url, processes=2) as supervisor:
        await supervisor.wait()        # every slot gave up (crash loop), or cancel / leave

Each child is ``python -m durable_trio worker MODULE:app ...`` with the same options and its
own ``--instance-id`` (so its own liveness keys). A child that exits is started again after an
exponential backoff (:class:`RestartPolicy`); a slot whose child died ``crash_limit`` times
within ``crash_window`` seconds is given up, logged, and makes the exit status
:data:`CRASH_LOOP_EXIT`. Leaving the block is the close: SIGTERM to every child (each runs its
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
import logging
import math
import os
import signal
import sys
import uuid
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import attrs
import trio
from trio_util import RepeatedEvent

from ._backoff import Backoff
from ._errors import ConfigError
from ._transport._options import DEFAULT_CLEANUP_TIMEOUT, DEFAULT_CLOSE_TIMEOUT

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence

__all__ = [
    "CRASH_LOOP_EXIT",
    "RestartPolicy",
    "WorkerProcess",
    "WorkerProcesses",
    "open_worker_processes",
    "resolve_processes",
    "run_worker_processes",
    "watch_parent",
]

_log = logging.getLogger("durable_trio")

#: The supervisor's exit status when at least one slot was given up (crash loop).
CRASH_LOOP_EXIT = 3
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
    """When a dead child is started again, and when its slot is given up.

    The n-th death of a slot within ``crash_window`` seconds waits
    ``min(backoff_initial * 2 ** (n - 1), backoff_max)`` before the restart; the
    ``crash_limit``-th gives the slot up (reported: a log line and :data:`CRASH_LOOP_EXIT`).
    A child that ran longer than ``crash_window`` starts the count afresh.
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

    def record(self, now: float) -> float | None:
        """A death at ``now``: seconds to wait before the restart (``None``: give up)."""
        policy = self.policy
        self.times.append(now)
        while self.times and self.times[0] <= now - policy.crash_window:
            self.times.popleft()
        recent = len(self.times)
        if recent >= policy.crash_limit:
            return None
        return self.backoff.delay(recent)


@attrs.define
class WorkerProcess:
    """One slot's current (or last) child."""

    slot: int
    pid: int
    instance_id: str
    generation: int
    """0 for the first child of the slot, then one more per restart."""
    returncode: int | None = None


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
        given_up: the slots given up after a crash loop, in order.
        restarts: children started again after a death, over all slots.
        close_bound: seconds the close waits for the children before SIGKILL.
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
        self.given_up: list[int] = []
        self.restarts = 0
        self.close_bound = close_bound
        self._argv = argv
        self._policy = policy
        self._env = env
        self._live: dict[int, trio.Process] = {}
        self._signalled: set[int] = set()
        """Pids already sent a signal (the close does not send them a second one)."""
        self._stopping = False
        self._all_given_up = trio.Event()
        self._changed = RepeatedEvent()

    @property
    def exit_status(self) -> int:
        """:data:`CRASH_LOOP_EXIT` if a slot was given up, else 0."""
        return CRASH_LOOP_EXIT if self.given_up else 0

    async def wait(self) -> None:
        """Return once every slot was given up (the supervisor has nothing left to run)."""
        await self._all_given_up.wait()

    async def wait_changed(self) -> None:
        """Return at the next start or death of a child (for tests and monitors)."""
        await self._changed.wait()

    def _touch(self) -> None:
        self._changed.set()

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
        deaths = _Deaths(self._policy)
        generation = 0
        started = False
        while not self._stopping:
            instance_id = f"{uuid.uuid4().hex[:12]}-p{slot}"
            process = await trio.lowlevel.open_process(
                self._argv(instance_id), env=self._env, start_new_session=True
            )
            self._live[slot] = process
            if self._stopping:  # the close began while it started
                self.forward(signal.SIGTERM, once=True)
            child = WorkerProcess(slot, process.pid, instance_id, generation)
            self.children[slot] = child
            _log.info("worker process %d started: pid %d, instance %s", slot, process.pid,
                      instance_id)  # fmt: skip
            self._touch()
            if not started:
                started = True
                task_status.started()
            try:
                child.returncode = await process.wait()
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
            delay = deaths.record(trio.current_time())
            if delay is None:
                _log.error(
                    "worker process %d: crash loop (%d deaths within %g s, the last with "
                    "status %s): not restarted",
                    slot, self._policy.crash_limit, self._policy.crash_window, child.returncode,
                )  # fmt: skip
                self.given_up.append(slot)
                if len(self.given_up) == self.processes:
                    self._all_given_up.set()
                return
            _log.warning(
                "worker process %d (pid %d) exited with status %s: restarting in %g s",
                slot, child.pid, child.returncode, delay,
            )  # fmt: skip
            await trio.sleep(delay)
            generation += 1
            self.restarts += 1

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
) -> int:
    """``durable-trio worker --processes N``, from Python: supervise the children until
    SIGTERM / SIGINT (forwarded to every child, which closes gracefully; a second one is
    forwarded too: the children close now), or until every slot was given up.

    Takes the arguments of :func:`open_worker_processes`; ``announce`` is called with a line
    per signal (default: a warning on the ``durable_trio`` logger).

    Returns:
        the exit status: 0, :data:`CRASH_LOOP_EXIT` if a slot was given up, or
        ``128 + signum`` if a second signal forced the close.
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

                async def given_up() -> None:
                    await supervisor.wait()
                    first.set()

                await nursery.start(forward)
                nursery.start_soon(given_up)
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
