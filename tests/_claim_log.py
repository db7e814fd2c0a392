"""Observation (no fault) of every claim a worker's broker hands over: the pops' and the
ones a finalize makes for the next jobs (``SupportsFinishAndClaim``). Standard library and
durable_trio only: the worker processes of the crash tests import it as a script's sibling."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from durable_trio.brokers import ClaimedJob


def observe_claims(broker: Any, seen: Callable[[str, list[ClaimedJob], bool], None]) -> None:
    """Call ``seen(queue, claims, by_finalize)`` for every batch of claims ``broker`` hands
    over, by ``pop_many`` (``by_finalize`` false) or ``finish_and_claim`` (true); both are
    wrapped on the instance, before a transport uses it."""
    pop_many, finish_and_claim = broker.pop_many, broker.finish_and_claim

    async def observed_pop_many(queue: str, count: int, *, worker: str = "") -> Any:
        jobs = await pop_many(queue, count, worker=worker)
        seen(queue, jobs, False)
        return jobs

    async def observed_finish_and_claim(
        push_queue: str, jobs: Any, queue: str, leases: Any, count: int, *, worker: str = ""
    ) -> Any:
        answers, claimed = await finish_and_claim(
            push_queue, jobs, queue, leases, count, worker=worker
        )
        seen(queue, claimed, True)
        return answers, claimed

    broker.pop_many, broker.finish_and_claim = observed_pop_many, observed_finish_and_claim
