"""Worker liveness (T11), group health (T12), descriptors (T13), adaptive concurrency (T6); the
ids are sections of docs/spec.md."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
import trio
import trio.testing

import durable_trio as dt
from durable_trio._transport._adaptive import ConcurrencyController
from durable_trio.brokers.memory import MemoryBroker
from durable_trio.keys.memory import MemoryKeyStore

if TYPE_CHECKING:
    from collections.abc import Sequence

    from durable_trio.keys import KeyEntry


class RecordingKeys:
    """A memory key store that records writes and can be made slow."""

    def __init__(self, *, put_delay: float = 0.0) -> None:
        self.inner = MemoryKeyStore()
        self.puts: list[tuple[float, str, float]] = []
        self.put_delay = put_delay
        self.concurrent: dict[str, int] = {}
        self.peak = 0  # most writes of one key at once

    async def put(self, key: str, value: bytes, ttl: float) -> None:
        self.concurrent[key] = self.concurrent.get(key, 0) + 1
        self.peak = max(self.peak, self.concurrent[key])
        try:
            await trio.sleep(self.put_delay)
            self.puts.append((trio.current_time(), key, ttl))
            await self.inner.put(key, value, ttl)
        finally:
            self.concurrent[key] -= 1

    async def put_many(self, items: Sequence[tuple[str, bytes, float]]) -> None:
        # one write of the store: its keys land together
        for key, _, _ in items:
            self.concurrent[key] = self.concurrent.get(key, 0) + 1
            self.peak = max(self.peak, self.concurrent[key])
        try:
            await trio.sleep(self.put_delay)
            for key, value, ttl in items:
                self.puts.append((trio.current_time(), key, ttl))
                await self.inner.put(key, value, ttl)
        finally:
            for key, _, _ in items:
                self.concurrent[key] -= 1

    async def remove(self, keys: Sequence[str]) -> None:
        await self.inner.remove(keys)

    async def entries(self, prefix: str) -> list[KeyEntry]:
        return await self.inner.entries(prefix)

    async def aclose(self) -> None:
        await self.inner.aclose()


def backend(keys: Any = None, broker: Any = None) -> dt.Backend:
    return dt.Backend(url="test://", broker=broker or MemoryBroker(), keys=keys)


async def noop(task: dt.RemoteTask) -> None:
    return None


def beats(keys: RecordingKeys, token: str) -> list[tuple[float, float]]:
    return [(at, ttl) for at, key, ttl in keys.puts if f"-worker-heartbeat:{token}:" in key]


async def test_t11_first_beat_at_once_then_every_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    keys = RecordingKeys()
    async with dt.open_queue_transport(backend(keys), instance_id="w1", namespace="shop") as t:
        await trio.sleep(5)
        t.handle("charge", noop)  # serving starts at t=5: a beat at once
        await trio.sleep(30)
        (entry,) = await keys.entries("shop-worker-heartbeat:")
        assert entry.key == "shop-worker-heartbeat:charge:w1"
        value = orjson.loads(entry.value)
        assert value["status"]["mode"] == "fixed"
        assert value["status"]["limit"] == 1
    # the first beat at 5; then the shared timer's ticks at 10, 20, 30
    assert beats(keys, "charge") == [(5.0, 35.0), (10.0, 35.0), (20.0, 35.0), (30.0, 35.0)]


async def test_t11_ttl_is_three_intervals_when_that_is_longer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    keys = RecordingKeys()
    async with dt.open_queue_transport(backend(keys), worker_heartbeat_interval=20.0) as t:
        t.handle("charge", noop)
        await trio.sleep(1)
    assert beats(keys, "charge") == [(0.0, 60.0)]


async def test_t11_a_slow_key_store_never_piles_up_writes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    keys = RecordingKeys(put_delay=25.0)  # slower than the 10 s interval
    async with dt.open_queue_transport(backend(keys), close_timeout=0, cleanup_timeout=30) as t:
        t.handle("charge", noop)
        await trio.sleep(100)
        assert keys.peak == 1
        assert t._liveness is not None
        assert t._liveness.skipped > 0
    # writes landed at 25, 55 (started at 30: the beats due at 10 and 20 were skipped), 85
    assert [at for at, _ in beats(keys, "charge")][:3] == [25.0, 55.0, 85.0]


async def test_t11_keys_are_withdrawn_at_once_on_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    keys = RecordingKeys()
    async with dt.open_queue_transport(backend(keys), namespace="shop") as t:
        t.handle("a", noop)
        t.handle("b", noop)
        await trio.sleep(15)
        assert len(await keys.entries("shop-worker-heartbeat:")) == 2
        closing_at = trio.current_time()
    assert trio.current_time() == closing_at
    assert await keys.entries("shop-worker-heartbeat:") == []
    assert await keys.entries("shop-worker-descriptor:") == []


async def test_t11_a_process_that_only_dispatches_is_not_a_worker(
    autojump_clock: trio.testing.MockClock,
) -> None:
    keys = RecordingKeys()
    async with dt.open_queue_transport(backend(keys)) as t:
        t.defer_consumers()
        t.handle("charge", noop)
        await t.dispatch(dt.RemoteTask(run_id="r", step_id="s", attempt=1, name="charge"))
        await trio.sleep(60)
        assert keys.puts == []
        t.start_consumers()
        await trio.sleep(1)
        assert [at for at, _ in beats(keys, "charge")] == [60.0]


async def test_t12_group_health_depth_and_live_workers_with_headroom(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shared_keys = MemoryKeyStore()
    shared_broker = MemoryBroker()
    release = trio.Event()

    async def slow(task: dt.RemoteTask) -> None:
        await release.wait()

    async with (
        dt.open_queue_transport(
            backend(shared_keys, shared_broker), instance_id="w1", concurrency=3, prefetch=0
        ) as w1,
        dt.open_queue_transport(backend(shared_keys, shared_broker), instance_id="engine") as eng,
    ):
        w1.handle("resize", slow)
        for n in range(5):
            await eng.dispatch(dt.RemoteTask(run_id="r", step_id=f"s{n}", attempt=1, name="resize"))
        await trio.sleep(10.5)  # the 10 s beat carries the busy status
        health = await eng.health.group_health("resize")
        assert health is not None
        assert health.group == "resize"
        assert health.depth == 2
        (worker,) = health.live_workers
        assert worker.instance == "w1"
        assert worker.status is not None
        assert (worker.status.limit, worker.status.in_flight, worker.headroom) == (3, 3, 0)
        assert health.headroom == 0
        assert await eng.health.group_health("nobody-serves-this") == dt.GroupHealth(
            "nobody-serves-this", 0, ()
        )
        everything = await eng.health.worker_health()
        assert everything is not None
        assert [g.group for g in everything] == ["resize"]
        release.set()


async def test_t12_no_key_store_means_no_health_not_zero_workers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with dt.open_queue_transport(backend(keys=None)) as t:
        t.handle("charge", noop)
        assert await t.health.group_health("charge") is None
        assert await t.health.worker_health() is None


async def test_t13_descriptors_are_read_through_a_short_cache(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shared_keys = MemoryKeyStore()
    shared_broker = MemoryBroker()
    async with dt.open_queue_transport(backend(shared_keys, shared_broker)) as reader:
        assert await reader.health.list_worker_descriptors("charge") == []  # cached at t=0
        async with dt.open_queue_transport(
            backend(shared_keys, shared_broker), instance_id="w9"
        ) as worker:
            worker.handle("charge", noop)
            worker.handle("refund", noop)
            await trio.sleep(4)
            assert await reader.health.list_worker_descriptors("charge") == []  # still cached
            await trio.sleep(1)
            (descriptor,) = await reader.health.list_worker_descriptors("charge")
            assert descriptor.instance == "w9"
            assert descriptor.tokens == ("charge", "refund")
            assert descriptor.steps == ("charge", "refund")


async def test_t6_fixed_concurrency_stays_fixed(autojump_clock: trio.testing.MockClock) -> None:
    async with dt.open_queue_transport(backend(MemoryKeyStore()), concurrency=8) as t:
        t.handle("charge", noop)
        await trio.sleep(120)
        status = t.health.worker_status()
        assert (status.mode, status.limit) == ("fixed", 8)


async def test_t6_a_fixed_limit_reads_its_pressure_figures_at_each_snapshot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """No ticks for a fixed limit: the snapshot reads RSS, and CPU over the time since the
    previous reading (at least 1 s ago; a closer snapshot keeps the figure it has)."""
    cpu_seconds = [0.0]
    rss = [1000]
    controller = ConcurrencyController(
        8, read_rss=lambda: rss[0], read_cpu_time=lambda: cpu_seconds[0]
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(controller.run)
        assert not nursery.child_tasks  # returned at once: nothing ticks
    first = controller.snapshot()
    assert (first.mode, first.limit, first.rss_bytes, first.cpu) == ("fixed", 8, 1000, None)
    await trio.sleep(10)
    cpu_seconds[0], rss[0] = 2.5, 2000
    second = controller.snapshot()
    assert (second.rss_bytes, second.cpu) == (2000, 0.25)  # 2.5 CPU s over 10 s
    await trio.sleep(0.5)
    cpu_seconds[0] = 3.0
    assert controller.snapshot().cpu == 0.25  # half a second: too short a window to measure
    await trio.sleep(0.5)
    assert controller.snapshot().cpu == 0.5  # 0.5 CPU s over the 1 s since the last reading


async def test_t6_adaptive_finds_the_downstreams_capacity(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A downstream of capacity C=8: 50 ms per call up to 8 at once, slower in proportion past
    that (it shares itself). The limit settles near C instead of the 64 allowed, and p95 stays
    within 1.5x the unloaded latency."""
    calls = 0
    async with dt.open_queue_transport(
        backend(MemoryKeyStore()),
        concurrency=dt.Adaptive(min=1, max=64, tick=1.0),
        result_concurrency=64,
    ) as t:

        async def call_downstream(task: dt.RemoteTask) -> None:
            nonlocal calls
            calls += 1
            try:
                await trio.sleep(0.05 * max(1.0, calls / 8))
            finally:
                calls -= 1

        async def ignore(result: dt.StepResult) -> None:
            return None

        t.handle("call", call_downstream)
        t.on_result(ignore)

        async def keep_queue_full() -> None:
            n = 0
            while True:
                if await t.health.queue_depth("call") or 0 < 200:
                    for _ in range(100):
                        n += 1
                        await t.dispatch(
                            dt.RemoteTask(run_id="r", step_id=f"{n}", attempt=1, name="call")
                        )
                await trio.sleep(0.5)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep_queue_full)
            limits = []
            for _ in range(60):
                await trio.sleep(1)
                limits.append(t.health.worker_status().limit)
            nursery.cancel_scope.cancel()
        status = t.health.worker_status()
    assert status.mode == "adaptive"
    assert status.last_adjustment is not None
    assert max(limits) > 8  # it probed above the capacity ...
    assert all(6 <= limit <= 14 for limit in limits[-20:])  # ... and settled near it
    assert status.p95_ms is not None
    assert status.p95_ms <= 1.5 * 50


def test_t6_a_limit_move_is_reported() -> None:
    moves: list[int] = []
    controller = ConcurrencyController(
        dt.Adaptive(min=1, max=10),
        on_limit=moves.append,
        read_rss=lambda: 0,
        read_cpu_time=lambda: 0.0,
    )

    async def main() -> None:
        for _ in range(5):
            controller.on_start()
            controller.on_start()
            controller.on_settle(0.0, 0.01)
        controller.adjust(1.0)

        for _ in range(10):
            controller.on_settle(0.0, 0.01)
            controller.on_start()
            controller.adjust(1.0)

    trio.run(main)
    assert moves
    assert moves[-1] == controller.limit > 1
