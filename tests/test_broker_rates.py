"""Rate limits (issue 33, item 3): the ``SupportsRateLimits`` half of the broker contract, one
suite for every broker (parametrized in conftest.py, as test_broker_limits.py). The memory
broker runs on a virtual clock (exact times); the others on the real one, with short windows
and bounds instead of exact times."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from durable_trio import ConfigError
from durable_trio.brokers import Job, SupportsRateLimits

Q = "t:tasks:rates"


def rated(broker: Any) -> SupportsRateLimits:
    assert isinstance(broker, SupportsRateLimits), type(broker).__name__
    return broker


async def test_a_queue_without_a_rate_grants_what_is_asked(
    broker: Any, contract_clock: object
) -> None:
    grant = await rated(broker).take_starts(Q, 7)
    assert (grant.granted, grant.retry_after) == (7, 0.0)
    stats = await broker.queue_stats(Q)
    assert (stats.rate, stats.rate_per, stats.window) == (None, None, 0)


async def test_no_window_starts_more_than_the_rate(broker: Any, contract_clock: object) -> None:
    b = rated(broker)
    await b.set_queue_rate(Q, 3, 30.0)
    assert (await b.take_starts(Q, 2)).granted == 2
    assert (await b.take_starts(Q, 5)).granted == 1
    full = await b.take_starts(Q, 1)
    assert full.granted == 0
    assert 29.0 < full.retry_after <= 30.0
    await broker.push_on(Q, Job("j", b"{}"))
    stats = await broker.queue_stats(Q)
    assert (stats.rate, stats.rate_per, stats.window, stats.ready) == (3, 30.0, 3, 1)


async def test_returned_starts_are_free_again(broker: Any, contract_clock: object) -> None:
    b = rated(broker)
    await b.set_queue_rate(Q, 3, 30.0)
    grant = await b.take_starts(Q, 3)
    assert grant.granted == 3
    await b.return_starts(Q, grant.at, 2)
    assert (await broker.queue_stats(Q)).window == 1
    assert (await b.take_starts(Q, 5)).granted == 2
    await b.return_starts(Q, grant.at - 1000.0, 1)  # nothing logged then: nothing removed
    assert (await b.take_starts(Q, 1)).granted == 0


async def test_the_window_slides(broker: Any, contract_clock: object) -> None:
    b = rated(broker)
    per = 0.5
    await b.set_queue_rate(Q, 2, per)
    first = await b.take_starts(Q, 1)
    await trio.sleep(0.2)
    assert (await b.take_starts(Q, 3)).granted == 1
    full = await b.take_starts(Q, 1)
    assert full.granted == 0
    assert 0.0 < full.retry_after <= per - 0.2 + 0.05
    await trio.sleep(full.retry_after + 0.02)
    # The first start left the window; the second (0.2 s later) has not.
    again = await b.take_starts(Q, 3)
    assert again.granted == 1
    if contract_clock is not None:  # memory: exact, on trio's clock
        assert (first.at, full.retry_after) == (0.0, 0.3)


async def test_changing_or_removing_the_rate(broker: Any, contract_clock: object) -> None:
    b = rated(broker)
    await b.set_queue_rate(Q, 1, 60.0)
    assert (await b.take_starts(Q, 2)).granted == 1
    await b.set_queue_rate(Q, 3, 60.0)  # the log is kept: two more fit
    assert (await b.take_starts(Q, 5)).granted == 2
    await b.set_queue_rate(Q, None)
    assert (await b.take_starts(Q, 9)).granted == 9
    assert (await broker.queue_stats(Q)).rate is None


@pytest.mark.parametrize(
    ("count", "per"), [(0, 1.0), (1.5, 1.0), (True, 1.0), (1, 0.0), (1, float("inf")), (1, -1)]
)
async def test_a_rate_is_checked(broker: Any, contract_clock: object, count: Any, per: Any) -> None:
    with pytest.raises(ConfigError):
        await rated(broker).set_queue_rate(Q, count, per)


async def test_each_key_has_its_own_log(broker: Any, contract_clock: object) -> None:
    """Per-key rates: one log per (queue, key), each held to the queue's rate, independent
    of the other keys and of the queue's keyless log; a return touches its key only."""
    b = rated(broker)
    await b.set_queue_rate(Q, 2, 30.0)
    a1 = await b.take_starts(Q, 5, key="a")
    assert a1.granted == 2
    full = await b.take_starts(Q, 1, key="a")
    assert full.granted == 0
    assert 29.0 < full.retry_after <= 30.0
    assert (await b.take_starts(Q, 1, key="b")).granted == 1  # "a" is full, "b" is not
    assert (await b.take_starts(Q, 3, key="b")).granted == 1
    assert (await b.take_starts(Q, 3)).granted == 2  # the keyless log: its own
    assert (await b.take_starts(Q, 1, key="c{x}:starts")).granted == 1  # any str is a key
    await b.return_starts(Q, a1.at, 1, key="b")  # nothing of "b" logged then
    assert (await b.take_starts(Q, 1, key="a")).granted == 0
    await b.return_starts(Q, a1.at, 1, key="a")
    assert (await b.take_starts(Q, 1, key="a")).granted == 1
    assert (await broker.queue_stats(Q)).window == 2  # (the keyless log only)


async def test_a_key_log_slides_and_a_queue_without_a_rate_grants(
    broker: Any, contract_clock: object
) -> None:
    b = rated(broker)
    assert (await b.take_starts(Q, 4, key="a")).granted == 4  # no rate stored
    per = 0.5
    await b.set_queue_rate(Q, 1, per)
    assert (await b.take_starts(Q, 1, key="a")).granted == 1
    wait = await b.take_starts(Q, 1, key="a")
    assert wait.granted == 0
    await trio.sleep(wait.retry_after + 0.05)
    assert (await b.take_starts(Q, 1, key="a")).granted == 1


async def test_a_per_key_rate_shows_its_keys_and_the_busiest(
    broker: Any, contract_clock: object
) -> None:
    """A rate stored ``per_key``: ``window`` is the busiest key's starts in its window and
    ``window_keys`` the keys with any (the keyless log is not counted); stored keyless again,
    the view counts the keyless log."""
    b = rated(broker)
    await b.set_queue_rate(Q, 3, 30.0, per_key=True)
    stats = await broker.queue_stats(Q)
    assert (stats.rate, stats.rate_per_key, stats.window, stats.window_keys) == (3, True, 0, 0)
    assert (await b.take_starts(Q, 2, key="a")).granted == 2
    assert (await b.take_starts(Q, 1, key="b")).granted == 1
    c = await b.take_starts(Q, 1, key="c")
    await b.return_starts(Q, c.at, 1, key="c")  # "c" has no start left in its window
    assert (await b.take_starts(Q, 1)).granted == 1  # (the keyless log: not a key)
    stats = await broker.queue_stats(Q)
    assert (stats.rate, stats.rate_per, stats.rate_per_key) == (3, 30.0, True)
    assert (stats.window, stats.window_keys) == (2, 2)
    await b.set_queue_rate(Q, 3, 30.0)  # keyless again: the keyless log
    stats = await broker.queue_stats(Q)
    assert (stats.rate_per_key, stats.window, stats.window_keys) == (False, 1, 0)


async def test_a_per_key_window_slides(broker: Any, contract_clock: object) -> None:
    b = rated(broker)
    per = 0.5
    await b.set_queue_rate(Q, 2, per, per_key=True)
    t0 = trio.current_time()
    assert (await b.take_starts(Q, 1, key="a")).granted == 1
    await trio.sleep_until(t0 + 0.25)
    assert (await b.take_starts(Q, 2, key="b")).granted == 2
    stats = await broker.queue_stats(Q)
    assert (stats.window, stats.window_keys) == (2, 2)
    await trio.sleep_until(t0 + 0.625)  # "a"'s start left its window, "b"'s did not
    stats = await broker.queue_stats(Q)
    assert (stats.window, stats.window_keys) == (2, 1)
    await trio.sleep_until(t0 + 1.0)
    stats = await broker.queue_stats(Q)
    assert (stats.window, stats.window_keys) == (0, 0)
    if contract_clock is not None:  # memory: exact, on trio's clock
        assert (t0, trio.current_time()) == (0.0, 1.0)
