"""``make bench``: our figures, measured in one run on this machine (see docs/benchmarks.md).

Importing this package first compiles ``durable_trio``'s bytecode (and the harness's own), as
``pip install`` compiles an installed package's: where ``PYTHONDONTWRITEBYTECODE`` is set (this
machine, CI) nothing else writes it, and every worker process a benchmark spawns would compile
each module it imports from source, 0.05-0.1 s of each start-up that the peers, installed by
pip and npm, do not pay. Files already compiled and unchanged are only looked at.
"""

import compileall
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
for _folder in ("durable_trio", "benchmarks"):
    compileall.compile_dir(_ROOT / _folder, quiet=1)
