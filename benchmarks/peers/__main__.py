"""``python -m benchmarks.peers [--quick] [--scenarios S1,S3] [--peers saq,rq]``: the peers alone.

Starts its own private ``redis-server`` and prints the peers' table (``make bench`` prints it
beside our own figures).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .. import redis_server
from . import PEERS, SCENARIOS, format_table, run_peers


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers")
    parser.add_argument("--quick", action="store_true", help="1 run, 1,000 jobs, 3 s windows")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--json", metavar="FILE", help="also write the rows there")
    args = parser.parse_args()
    started = time.monotonic()
    with redis_server.private_redis() as server:
        version = redis_server.redis_version(server.url)
        rows = run_peers(
            server.url,
            quick=args.quick,
            scenarios=args.scenarios.split(","),
            peers=args.peers.split(","),
        )
    print(f"peers on a private redis-server {version} ({time.monotonic() - started:.0f} s):")
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
