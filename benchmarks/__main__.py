"""``make bench``: every benchmark section, one table, with the issues' targets checked."""

from __future__ import annotations

import argparse
import platform
import sys
import time
from typing import TYPE_CHECKING

import trio

from . import adaptive, memory

if TYPE_CHECKING:
    from collections.abc import Callable

Figures = dict[str, float]


def _memory(quick: bool) -> Figures:
    return trio.run(memory.run, quick)


def _adaptive(quick: bool) -> Figures:
    return adaptive.run()


SECTIONS: dict[str, Callable[[bool], Figures]] = {
    "memory": _memory,
    "adaptive": _adaptive,
}


def _targets(f: Figures) -> list[tuple[str, bool]]:
    """The must-show figures of the issues, checked against this run."""
    checks: list[tuple[str, bool]] = []
    rt = f.get("memory round trips/s, concurrency 32")
    if rt is not None:
        checks.append(
            (f"memory, 1 worker, concurrency 32: {rt:,.0f} >= 25,000 round trips/s", rt >= 25_000)
        )
    idle = f.get("memory idle polls/s, 10 names")
    if idle is not None:
        checks.append((f"idle transport, 10 names: {idle:g} periodic polls/s (want 0)", idle == 0))
    a_rt = f.get("downstream C=8, adaptive 1..64: calls/s")
    if a_rt is not None:
        best = max(
            v
            for k, v in f.items()
            if k.startswith("downstream C=8, fixed") and k.endswith("calls/s")
        )
        a_p95 = f["downstream C=8, adaptive 1..64: p95 ms"]
        base = f["downstream unloaded latency ms"]
        wide = f["downstream C=8, fixed 8C=64: p95 ms"]
        checks.append(
            (
                f"adaptive throughput {a_rt / best:.0%} of the best fixed limit (want >= 90%)",
                a_rt >= 0.9 * best,
            )
        )
        checks.append(
            (
                f"adaptive p95 {a_p95 / base:.2f}x the unloaded latency (want <= 1.5x)",
                a_p95 <= 1.5 * base,
            )
        )
        checks.append(
            (
                f"adaptive p95 {wide / a_p95:.1f}x lower than fixed 8C's (want >= 3x)",
                wide >= 3 * a_p95,
            )
        )
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("--quick", action="store_true", help="smaller runs (a smoke test)")
    parser.add_argument(
        "sections", nargs="*", help=f"sections to run (default: all of {list(SECTIONS)})"
    )
    args = parser.parse_args()
    chosen = args.sections or list(SECTIONS)
    print(
        f"durable_trio benchmarks — Python {platform.python_version()}, {platform.machine()}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )
    figures: Figures = {}
    for name in chosen:
        start = time.perf_counter()
        section = SECTIONS[name](args.quick)
        figures.update(section)
        print(f"\n[{name}] ({time.perf_counter() - start:.1f} s)")
        width = max(map(len, section))
        for key, value in section.items():
            print(f"  {key:<{width}}  {value:>14,.2f}")
    checks = _targets(figures)
    if checks:
        print("\n[targets]")
        for text, ok in checks:
            print(f"  {'PASS' if ok else 'MISS'}  {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
