"""Determinism of a simulation: trio's own scheduler, seeded for the length of a run."""

from __future__ import annotations

import contextlib
import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["seeded_scheduler"]


@contextlib.contextmanager
def seeded_scheduler(seed: str) -> Iterator[None]:
    """Make trio's scheduler deterministic for the duration of the block, then restore it.

    Trio runs each batch of ready tasks in an order drawn from a module-level generator, and
    breaks ties between equal deadlines by object address: two runs of one program can
    interleave differently. Trio has a switch for exactly this (its Hypothesis integration
    turns it on): sort each batch by task creation order, then shuffle it with the seeded
    generator. Private API of trio; where it moved, scheduling stays trio's own (histories may
    then differ from run to run, which the determinism test would show).
    """
    try:
        from trio._core import _run as trio_run

        generator: random.Random | None = trio_run._r
        switch: bool = trio_run._ALLOW_DETERMINISTIC_SCHEDULING
    except (ImportError, AttributeError):  # pragma: no cover - a future trio
        generator = None
    if not isinstance(generator, random.Random):  # pragma: no cover
        yield
        return
    state = generator.getstate()
    generator.seed(seed)
    trio_run._ALLOW_DETERMINISTIC_SCHEDULING = True  # type: ignore[misc]
    try:
        yield
    finally:
        trio_run._ALLOW_DETERMINISTIC_SCHEDULING = switch  # type: ignore[misc]
        generator.setstate(state)
