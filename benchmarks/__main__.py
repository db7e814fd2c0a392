"""Run every benchmark section and print one table."""

from __future__ import annotations

import argparse
import platform
import sys

import trio

from . import memory


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("--quick", action="store_true", help="smaller runs (a smoke test)")
    args = parser.parse_args()
    print(f"durable_trio benchmarks — Python {platform.python_version()}, {platform.machine()}")
    rows: list[tuple[str, float, str]] = []
    for name, value in trio.run(memory.run, args.quick).items():
        rows.append((name, value, ""))
    width = max(len(name) for name, _, _ in rows)
    for name, value, note in rows:
        print(f"  {name:<{width}}  {value:>12,.2f}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
