"""``make bench``: our figures, measured in one run on this machine (see docs/benchmarks.md)."""
