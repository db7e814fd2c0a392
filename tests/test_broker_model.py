"""A hypothesis model test of the broker contract: random programs of operations run against a
plain Python model and against each broker, and every answer must agree."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import attrs
import hypothesis.strategies as st
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings

from durable_trio.brokers import Job

if TYPE_CHECKING:
    from conftest import BrokerFactory

QUEUES = ("a", "b")


@attrs.define
class Model:
    """The contract in a few lines: ready jobs ordered by (priority, sequence)."""

    seq: int = 0
    ready: dict[str, list[tuple[int, int, str]]] = attrs.Factory(dict)
    active: dict[str, tuple[str, str, int]] = attrs.Factory(dict)  # token -> (queue, id, attempts)
    attempts: dict[str, int] = attrs.Factory(dict)
    failed: dict[str, list[str]] = attrs.Factory(dict)

    priority_of: dict[str, int] = attrs.Factory(dict)
    seq_of: dict[str, int] = attrs.Factory(dict)

    def push(self, queue: str, job_id: str, priority: int) -> None:
        self.seq += 1
        self.seq_of[job_id] = self.seq
        self.ready.setdefault(queue, []).append((priority, self.seq, job_id))
        self.attempts.setdefault(job_id, 0)

    def pop(self, queue: str) -> str | None:
        jobs = self.ready.get(queue)
        if not jobs:
            return None
        jobs.sort()
        return jobs.pop(0)[2]

    def requeue(self, queue: str, job_id: str, *, keep_place: bool) -> None:
        """A retry goes to the back; an attempt-neutral handback keeps its place."""
        if not keep_place:
            self.seq += 1
            self.seq_of[job_id] = self.seq
        entry = (self.priority_of[job_id], self.seq_of[job_id], job_id)
        self.ready.setdefault(queue, []).append(entry)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.sampled_from(QUEUES), st.integers(-2, 2)),
        st.tuples(st.just("pop"), st.sampled_from(QUEUES), st.just(0)),
        st.tuples(
            st.sampled_from(["complete", "fail", "retry", "handback", "renew"]),
            st.integers(0, 7),
            st.booleans(),
        ),
        st.tuples(st.just("size"), st.sampled_from(QUEUES), st.just(0)),
    ),
    max_size=40,
)


async def run_program(broker: Any, program: list[tuple[Any, ...]]) -> None:
    prefix = uuid.uuid4().hex[:8]
    model = Model()
    leases: list[tuple[str, Any]] = []  # every lease ever issued, live or dead: (queue, lease)
    pushed = 0
    for op, arg, flag in program:
        if op == "push":
            queue = f"{prefix}:{arg}"
            pushed += 1
            job_id = f"j{pushed}"
            model.priority_of[job_id] = flag
            model.push(queue, job_id, flag)
            await broker.push_on(queue, Job(job_id, job_id.encode()), priority=flag)
        elif op == "pop":
            queue = f"{prefix}:{arg}"
            expected = model.pop(queue)
            claimed = await broker.pop_from(queue)
            assert (claimed.id if claimed else None) == expected
            if claimed is not None:
                assert expected is not None
                assert claimed.data == expected.encode()
                assert claimed.attempts == model.attempts[expected]
                model.active[claimed.lease.token] = (queue, expected, claimed.attempts)
                leases.append((queue, claimed.lease))
        elif op == "size":
            queue = f"{prefix}:{arg}"
            assert await broker.size_of(queue) == len(model.ready.get(queue, []))
        elif leases:
            queue, lease = leases[arg % len(leases)]
            live = lease.token in model.active
            if op == "renew":
                outcome = await broker.renew_jobs(queue, [lease])
                assert outcome.renewed == (1 if live else 0)
                continue
            if op == "complete":
                answer = await broker.complete_job(lease, queue)
            elif op == "fail":
                answer = await broker.fail_job(lease, queue, "failed")
            else:
                count = op == "retry"
                answer = await broker.retry_job(lease, queue, count_attempt=count)
            assert answer is live
            if not live:
                continue
            _, job_id, _ = model.active.pop(lease.token)
            if op == "fail":
                model.failed.setdefault(queue, []).insert(0, job_id)
            elif op in ("retry", "handback"):
                if op == "retry":
                    model.attempts[job_id] += 1
                model.requeue(queue, job_id, keep_place=op == "handback")
    for queue in {f"{prefix}:{q}" for q in QUEUES}:
        failed = await broker.failed_jobs(queue)
        assert [f.id for f in failed] == model.failed.get(queue, [])


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(program=operations)
def test_broker_agrees_with_the_model(
    broker_factory: BrokerFactory, contract_clock: trio.testing.MockClock | None, program: Any
) -> None:
    async def main() -> None:
        async with broker_factory() as broker:
            await run_program(broker, program)

    trio.run(main, clock=contract_clock)
