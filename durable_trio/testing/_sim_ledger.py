"""What a simulation saw: its history of events, the violations found, every fault injected
(and the window of time each one explains), every error reported and every step execution.

The engines, the worker slots, the fault schedule and the workload each write what they do
here; the invariant checks and the report read it.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Final

import attrs
import orjson
import trio

from .._engine import App, StepLost, step_info

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._engine._app import StepFunction
    from .faults import Injector

__all__ = ["Execution", "Ledger"]

#: The calls between a rate's grant and a step's body: one held back delays the body past the
#: start the broker logged (rate_peaks does not count such a start).
_STARTING_CALLS: Final = frozenset(
    {"take_starts", "pop_from", "pop_many", "pop_ahead", "finish_and_claim", "mark_started"}
)


@attrs.define(eq=False)
class Execution:
    """One execution of one step attempt, by one worker."""

    worker: str
    start: float
    end: float | None = None
    outcome: str = "running"
    output: bytes | None = None
    step: str = ""
    """The step's name."""
    key: str | None = None
    """Its concurrency key (``@app.step(concurrency_key=...)``), ``None`` without one."""


class Ledger:
    """The record of one simulated run, its times relative to its start (``t0``).

    Args:
        transport_options: the transport keywords of the engines and workers (a call late by
            half the ``stalled_threshold`` can cost its process its claims: a fault window).
    """

    def __init__(self, *, transport_options: dict[str, Any]) -> None:
        self.transport_options = transport_options
        self.t0 = 0.0
        self.history: list[dict[str, Any]] = []
        self.violations: list[str] = []
        self.fault_counts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.executions: dict[tuple[str, str, int], list[Execution]] = {}
        self.fault_windows: dict[str, list[tuple[float, float]]] = {}
        self.late_starts: dict[str, list[tuple[float, float]]] = {}
        """Per process: when a call between a rate's grant and the body was held back."""
        """Per process: the times during which a fault could cost it its claims."""
        self.duplicate_pushes: Counter[tuple[str, str, int]] = Counter()
        """Step attempts pushed again (a lost reply, a dispatch the engine did not record)."""
        self.damaged: list[tuple[str, float, dict[str, Any]]] = []
        self.task_pushers: dict[tuple[str, str, int], Counter[str]] = {}
        """How often each engine pushed each step attempt (several engines: see the checks)."""
        self.poisoned_runs: set[str] = set()
        """Runs one of whose steps is poison (``Faults.poison_probability``): failed, rightly."""
        self.lost_writes: list[tuple[str, tuple[str, str, int], float]] = []
        """Step tasks and results a broker acknowledged and lost: (``"task"`` or
        ``"result"``, the step attempt, when)."""
        self.landed_results: set[tuple[str, str, int]] = set()
        """Step results a push put in the broker whose reply was lost (its retry may then be
        lost: the result got through all the same)."""
        self.detected_losses: set[tuple[str, str, int]] = set()
        """The step attempts an engine reported lost (``StepLost``) and dispatched again."""
        self.engine_kills: list[float] = []
        """When an engine was killed (its beats and checks stop until its replacement)."""
        self.end = 0.0

    @property
    def _threshold(self) -> float:
        threshold = self.transport_options.get("stalled_threshold")
        return float(threshold) if threshold is not None else 120.0

    def start(self) -> None:
        """The simulation starts now: times are counted from here."""
        self.t0 = trio.current_time()

    def now(self) -> float:
        return trio.current_time() - self.t0

    def event(self, event: str, /, **fields: Any) -> None:
        self.history.append({"t": self.now(), "ev": event, **fields})

    def violation(self, message: str) -> None:
        self.violations.append(message)

    def window(self, process: str, start: float, end: float) -> None:
        """A fault (or a close) that explains a redelivery of ``process``'s claims."""
        self.fault_windows.setdefault(process, []).append((start, end))

    def faulted(self, worker: str, start: float, end: float) -> bool:
        return any(a <= end and b >= start for a, b in self.fault_windows.get(worker, ()))

    def _late(self, worker: str, start: float, end: float) -> bool:
        """A call that grants or claims starts was answered late to ``worker`` meanwhile."""
        return any(a <= end and b >= start for a, b in self.late_starts.get(worker, ()))

    # ------------------------------------------------------------------ hooks

    def fault_recorder(self, process: str) -> Callable[[str, dict[str, Any]], None]:
        """The ``record`` of ``process``'s injector: every per-call fault it injects."""

        def record(kind: str, details: dict[str, Any]) -> None:
            self.fault_counts[kind] += 1
            self.event("fault", kind=kind, **details)
            now = self.now()
            if kind in ("drop", "lost-reply"):
                self.window(process, now, now)
            elif kind == "delay" and (
                details["op"] == "renew_jobs" or details["seconds"] >= self._threshold / 2
            ):
                # A late renewal (or any call late by half the stalled threshold) can cost
                # the process its claims.
                self.window(process, now, now + details["seconds"])
            if kind == "delay" and details["op"] in _STARTING_CALLS:
                # A grant (or a claim) answered late: the body starts after the broker logged
                # its start, so starts can bunch past the rate by the delay (rate_peaks).
                self.late_starts.setdefault(process, []).append((now, now + details["seconds"]))
            if kind == "damage":
                self.damaged.append((process, now, details))
            for run_id, step_id, attempt in details.get("tasks", ()):
                self.duplicate_pushes[(run_id, step_id, attempt)] += 1
            for run_id, step_id, attempt in details.get("results", ()):
                # A result claimed with its reply lost waits out the stalled threshold: its
                # engine may declare the step lost and send the attempt once more meanwhile.
                self.duplicate_pushes[(run_id, step_id, attempt)] += 1
            for run_id, step_id, attempt in details.get("landed_results", ()):
                self.landed_results.add((run_id, step_id, attempt))
            for run_id, step_id, attempt in details.get("lost_tasks", ()):
                self.lost_writes.append(("task", (run_id, step_id, attempt), now))
            for run_id, step_id, attempt in details.get("lost_results", ()):
                # The attempt runs again once the loss is found: one redelivery explained.
                self.duplicate_pushes[(run_id, step_id, attempt)] += 1
                self.lost_writes.append(("result", (run_id, step_id, attempt), now))

        return record

    def error_hook(self, process: str) -> Callable[[BaseException], None]:
        """The ``on_error`` of ``process``: every error it reports, by type."""

        def hook(exc: BaseException) -> None:
            name = type(exc).__name__
            self.errors[name] += 1
            self.event("error", process=process, type=name)
            if isinstance(exc, StepLost):
                self.detected_losses.add((exc.run_id, exc.step_id, exc.attempt))

        return hook

    def pushes_observer(self, engine_id: str) -> Callable[[list[list[Any]]], None]:
        """The ``pushed`` of an engine's injector: the step attempts each push carried."""

        def pushed(tasks: list[list[Any]]) -> None:
            for run_id, step_id, attempt in tasks:
                key = (run_id, step_id, attempt)
                self.task_pushers.setdefault(key, Counter())[engine_id] += 1

        return pushed

    # ------------------------------------------------------------------ the step recorder

    def instrumented(
        self,
        app: App,
        worker_id: str,
        injector: Injector,
        *,
        poison: Callable[[str, str], bool] | None = None,
    ) -> App:
        """``app`` as one worker serves it: every step recorded (who ran which attempt, when,
        with what outcome), and held while the worker is stalled. ``poison(run_id, step_id)``
        says whether a step is poison, and if so has killed this worker."""
        shadow = App(app.name)
        for name, definition in app.steps.items():
            shadow.step(
                name,
                retry=definition.retry,
                priority=definition.priority,
                heartbeat_timeout=definition.heartbeat_timeout,
                max_concurrency=definition.max_concurrency,
                concurrency_key=definition.concurrency_key,
                rate_limit=definition.rate_limit,
            )(
                self._recorded(
                    definition.fn,
                    worker_id,
                    injector,
                    poison,
                    definition.concurrency_key
                    or (None if definition.rate_limit is None else definition.rate_limit.key),
                )
            )
        for name, workflow in app.workflows.items():
            if workflow.fn is None:
                shadow.remote_workflow(name)
            else:  # a remote workflow's turns are served by the workers too
                shadow.workflow(name, remote=workflow.remote)(workflow.fn)
        return shadow

    def _recorded(
        self,
        fn: StepFunction,
        worker_id: str,
        injector: Injector,
        poison: Callable[[str, str], bool] | None,
        key_fn: Callable[[Any], str] | None = None,
    ) -> StepFunction:
        async def step(value: Any) -> Any:
            info = step_info()
            key = (info.run_id, info.step_id, info.attempt)
            execution = Execution(worker_id, self.now(), step=info.name)
            if key_fn is not None:
                execution.key = _concurrency_key(key_fn, value)
            self.executions.setdefault(key, []).append(execution)
            where = {"run": info.run_id, "step": info.step_id, "attempt": info.attempt}
            self.event("exec", **where, worker=worker_id)
            try:
                if poison is not None and poison(info.run_id, info.step_id):
                    self.poisoned_runs.add(info.run_id)
                    self._check_alone(key, execution)
                    self.event("poison", **where, worker=worker_id)
                    await trio.sleep_forever()  # (its worker is killed: cancelled at once)
                output = await fn(value)
                await injector.wait_out_stall()  # a frozen process finishes nothing
            except BaseException as exc:
                execution.end = self.now()
                execution.outcome = (
                    "cancelled" if isinstance(exc, trio.Cancelled) else type(exc).__name__
                )
                self.event("exec-end", **where, worker=worker_id, outcome=execution.outcome)
                raise
            execution.end = self.now()
            execution.outcome = "ok"
            try:
                execution.output = orjson.dumps(output)
            except TypeError:
                execution.output = None
            self.event("exec-end", **where, worker=worker_id, outcome="ok")
            return output

        return step

    def limit_peaks(self, app: App) -> dict[str, int]:
        """Invariant: no step with ``max_concurrency=N`` ran more than N attempts at once (per
        key with ``concurrency_key``), counted over the executions a fault leaves no doubt
        about. An execution whose worker was faulted meanwhile (killed, stalled, its renewal
        paused, a call dropped) may have lost its claim while it ran, and its job run again
        beside it: that one is not counted (the broker's slot was the reclaimed lease's).
        Returns the most attempts seen at once per step (``"step"``) or key
        (``"step[key]"``)."""
        peaks: dict[str, int] = {}
        for name, definition in sorted(app.steps.items()):
            limit = definition.max_concurrency
            if limit is None:
                continue
            edges: dict[str, list[tuple[float, int]]] = {}
            for runs in self.executions.values():
                for e in runs:
                    end = self.end if e.end is None else e.end
                    if e.step != name or self.faulted(e.worker, e.start, end):
                        continue
                    group = name if definition.concurrency_key is None else f"{name}[{e.key}]"
                    # (an end before a start at one time: the slot is freed after the end)
                    edges.setdefault(group, []).extend(((e.start, 1), (end, -1)))
            for group, points in sorted(edges.items()):
                running = peak = 0
                for at, change in sorted(points):
                    running += change
                    if running > limit and running > peak:  # (reported at each new peak)
                        self.violation(
                            f"{running} attempts of {group} at once at {at:.3f}, more than its "
                            f"max_concurrency {limit}"
                        )
                    peak = max(peak, running)
                peaks[group] = peak
        return peaks

    def rate_peaks(self, app: App) -> dict[str, int]:
        """Invariant: no window of ``per`` seconds holds more than ``count`` starts of a step
        with ``rate_limit=Rate(count, per)`` (of one key value with ``Rate(..., key=...)``),
        counted over the executions a fault leaves no doubt about (a worker faulted in the
        ``per`` seconds before a start, or answered late by a call that grants or claims
        starts, may have started it late, after the broker logged its start: the broker bounds
        the starts it grants, docs/concurrency.md).
        Returns the most starts seen in one window per step (``"step"``) or key
        (``"step[key]"``)."""
        peaks: dict[str, int] = {}
        for name, definition in sorted(app.steps.items()):
            rate = definition.rate_limit
            if rate is None:
                continue
            groups: dict[str, list[float]] = {}
            for runs in self.executions.values():
                for e in runs:
                    if e.step == name and not self.faulted(
                        e.worker, e.start - rate.per, e.start
                    ) and not self._late(e.worker, e.start - rate.per, e.start):
                        group = name if rate.key is None else f"{name}[{e.key}]"
                        groups.setdefault(group, []).append(e.start)
            for group, starts in sorted(groups.items()):
                peaks[group] = self._rate_peak(group, sorted(starts), rate.count, rate.per)
        return peaks

    def _rate_peak(self, name: str, starts: list[float], count: int, per: float) -> int:
        """The most of ``starts`` (sorted) in one window of ``per``; a violation past ``count``."""
        peak = 0
        first = 0
        for last, at in enumerate(starts):  # (a window [s, s + per) from each start)
            while starts[first] <= at - per:
                first += 1
            n = last - first + 1
            if n > count and n > peak:
                self.violation(
                    f"{n} starts of {name} within {per:g} s at {at:.3f}, more than "
                    f"its rate_limit {count}"
                )
            peak = max(peak, n)
        return peak

    def _check_alone(self, key: tuple[str, str, int], execution: Execution) -> None:
        """Invariant 10: a poison step that ran before (its job stalled, counted, when it
        killed that worker) is a suspect, and runs alone: no other step runs in its worker.
        Not checked for an attempt pushed twice (the second job is no suspect)."""
        earlier = self.executions[key][:-1]
        pushes = sum(self.task_pushers.get(key, {}).values())
        if not earlier or self.duplicate_pushes[key] or pushes > 1:
            return
        beside = [
            (other, e.start)
            for other, runs in self.executions.items()
            for e in runs
            if e.worker == execution.worker and e.end is None and e is not execution
        ]
        if beside:
            self.violation(
                f"suspect {key} (run {len(earlier) + 1}) started at {execution.start:.3f} in "
                f"{execution.worker} beside {len(beside)} running step(s): {beside[:5]}"
            )


def _concurrency_key(key_fn: Callable[[Any], str], value: Any) -> str | None:
    """The key ``key_fn`` gives ``value`` (as the engine computed it at dispatch), ``None``
    if it fails (the engine fails such a step before any worker runs it)."""
    try:
        key = key_fn(value)
    except Exception:  # (the engine fails the step: code concurrency_key)
        return None
    return key if isinstance(key, str) else None
