"""The one backoff every retry loop uses."""

from __future__ import annotations

import random

import pytest

import durable_trio as dt
from durable_trio._backoff import Backoff


def test_exponential_capped_and_never_overflowing() -> None:
    backoff = Backoff(initial=0.5, maximum=4.0)
    assert [backoff.delay(n) for n in range(0, 6)] == [0.0, 0.5, 1.0, 2.0, 4.0, 4.0]
    assert backoff.delay(10**9) == 4.0


def test_jitter_shortens_within_its_fraction_and_is_reproducible() -> None:
    backoff = Backoff(initial=1.0, maximum=8.0, jitter=0.5)
    delays = [backoff.delay(4, rng=random.Random(7)) for _ in range(3)]
    assert delays[0] == delays[1] == delays[2]
    for seed in range(200):
        assert 4.0 <= backoff.delay(4, rng=random.Random(seed)) <= 8.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial": -1.0, "maximum": 1.0},
        {"initial": 2.0, "maximum": 1.0},
        {"initial": 1.0, "maximum": float("inf")},
        {"initial": 1.0, "maximum": 2.0, "multiplier": 0.5},
        {"initial": 1.0, "maximum": 2.0, "jitter": 1.5},
    ],
)
def test_settings_that_cannot_work_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(dt.ConfigError):
        Backoff(**kwargs)
