"""Duplicates explained: a completed result for an attempt that had already completed, recorded
with its cause (which lease was lost, whose, when), from the delivery evidence the results carry
(``StepResult.delivery``; the windows are in docs/concepts.md, "At-least-once windows")."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._wire import JSONValue
    from ._duplicate_result import DuplicateResult

__all__ = ["DuplicateLog", "explain"]

#: Duplicates kept per engine (the newest; ``duplicate_completions`` counts them all).
MAX_DUPLICATES = 1_000
#: Deliveries of applied completed results kept to compare a later copy against (the newest).
MAX_DELIVERIES = 10_000


def _stalls(delivery: JSONValue) -> list[JSONValue]:
    stalls = delivery.get("stalls") if isinstance(delivery, dict) else None
    return list(stalls) if isinstance(stalls, list) else []


def _count(delivery: JSONValue) -> int:
    count = delivery.get("stalledCount") if isinstance(delivery, dict) else None
    return count if type(count) is int else 0


def _who(delivery: JSONValue) -> str:
    if not isinstance(delivery, dict):
        return "an unknown worker"
    worker = delivery.get("worker") or "an unknown worker"
    return f"{worker} (delivery {_count(delivery) + 1}, lease {delivery.get('lease')})"


def _lost_words(lost: list[JSONValue]) -> str:
    return ", ".join(
        f"{s.get('worker') or 'an unknown worker'} at {s.get('at')}"
        for s in lost
        if isinstance(s, dict)
    )


def explain(applied: JSONValue, duplicate: JSONValue) -> tuple[str, tuple[JSONValue, ...]]:
    """The cause of a duplicate completed result and the leases lost, from the evidence of the
    applied result (``None`` if unknown) and of the copy.

    - Both from one claim (one lease token): one delivery's result arrived twice — its push
      was retried after a reply was lost, or the result job was redelivered to an engine
      after it had been applied (the engine's claim on it lost before it was acknowledged).
    - From two jobs: the attempt was dispatched twice (a task push retried, an engine re-sent
      it).
    - The applied one's evidence not known here: the copy's own stall history names the leases
      lost before it; with none, the copy is either the first delivery (its lease lost) or the
      applied result delivered again, and the cause says both.
    - From two claims of one job: the job was reclaimed in between; the later delivery's
      stall history says whose leases were lost and when (``stalls`` past the earlier one's
      history, the stalls not counted included).
    """
    if isinstance(applied, dict) and isinstance(duplicate, dict):
        if applied.get("lease") == duplicate.get("lease"):
            return (
                f"one delivery's result arrived twice ({_who(duplicate)}): its publish was "
                f"retried, or the result job was redelivered after it had been applied",
                (),
            )
        if applied.get("job") != duplicate.get("job"):
            return (
                f"the attempt was dispatched twice (jobs {applied.get('job')} and "
                f"{duplicate.get('job')}): its task push was retried after a lost reply, or "
                f"an engine sent it again (a dispatch not checkpointed before that engine "
                f"stopped, two engines applying one decision), and both jobs ran",
                (),
            )
        # Past the earlier delivery's history: a stall not counted (a claim that never
        # started) is in the history too, so its length, not the count, marks the place.
        earlier, later = sorted((applied, duplicate), key=lambda d: (len(_stalls(d)), _count(d)))
        lost = _stalls(later)[len(_stalls(earlier)) :]
    elif isinstance(duplicate, dict):
        later = duplicate
        lost = _stalls(duplicate)
        if not lost:
            noticed = duplicate.get("leaseLostAt")
            if noticed is not None:
                return (
                    f"the lease of {_who(duplicate)} was lost while its handler ran (it noticed "
                    f"at {noticed}, its clock): the job was reclaimed and another delivery's "
                    f"result was applied first",
                    (),
                )
            return (
                f"the applied result's evidence is not known here (another engine, or this one "
                f"before a restart, applied it): either the lease of {_who(duplicate)} was lost "
                f"while its handler ran and another delivery's result was applied first, or "
                f"this same result was delivered again (its publish retried, its result job "
                f"redelivered)",
                (),
            )
    else:
        return (
            "a completed result came again with no delivery evidence (a worker that sends "
            "none): a lease lost, or a result published twice",
            (),
        )
    lost_tuple = tuple(lost)
    if not lost_tuple:
        return (
            f"two deliveries completed ({_who(applied)} and {_who(duplicate)}) and no stall "
            f"between them was recorded: the job was handed back (a close past its deadline) "
            f"and delivered again",
            (),
        )
    return (
        f"the lease of {_lost_words(lost)} was lost (the job reclaimed by the stalled sweep) "
        f"and {_who(later)} ran it again; both completed",
        lost_tuple,
    )


class DuplicateLog:
    """One engine's duplicates (the newest :data:`MAX_DUPLICATES`), and the deliveries of the
    completed results it applied (the newest :data:`MAX_DELIVERIES`) to explain a later copy."""

    def __init__(self) -> None:
        self.entries: collections.deque[DuplicateResult] = collections.deque(
            maxlen=MAX_DUPLICATES
        )
        self._deliveries: collections.OrderedDict[tuple[str, str, int], JSONValue] = (
            collections.OrderedDict()
        )

    def applied(self, run_id: str, step_id: str, attempt: int, delivery: JSONValue) -> None:
        """A completed result with this evidence was applied."""
        if delivery is None:
            return
        deliveries = self._deliveries
        deliveries[(run_id, step_id, attempt)] = delivery
        if len(deliveries) > MAX_DELIVERIES:
            deliveries.popitem(last=False)  # the oldest

    def record(
        self, run_id: str, step_id: str, attempt: int, delivery: JSONValue, at: float
    ) -> DuplicateResult:
        """A completed copy with evidence ``delivery`` came for a completed attempt."""
        from ._duplicate_result import DuplicateResult  # (imported with the first duplicate)

        applied = self._deliveries.get((run_id, step_id, attempt))
        cause, lost = explain(applied, delivery)
        entry = DuplicateResult(
            run_id, step_id, attempt, at, cause, lost, applied=applied, duplicate=delivery
        )
        self.entries.append(entry)
        return entry

    def of_run(self, run_id: str | None) -> list[DuplicateResult]:
        """The entries kept, oldest first (of one run, or all)."""
        return [e for e in self.entries if run_id is None or e.run_id == run_id]
