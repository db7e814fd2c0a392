"""``durable_trio``'s public names are imported on first use (PEP 562), and each still works.

``import durable_trio`` loads none of the engine, the transport or a backend; every name of
``__all__`` resolves (``from durable_trio import X``), is listed by ``dir()``, and is the object
its defining module holds. Run in fresh interpreters: this process has long imported everything.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import durable_trio

SRC = str(Path(durable_trio.__file__).resolve().parent.parent)


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": SRC},
        timeout=60,
    )
    return done.stdout


def test_every_public_name_imports_and_is_listed() -> None:
    for name in durable_trio.__all__:
        assert getattr(durable_trio, name) is not None, name
    assert set(durable_trio.__all__) <= set(dir(durable_trio))
    assert set(durable_trio.__all__) == set(durable_trio._EXPORTS)  # one table, no stragglers
    assert durable_trio.__version__


def test_from_import_of_each_name_in_a_fresh_process() -> None:
    names = ", ".join(durable_trio.__all__)
    out = _run(f"from durable_trio import {names}\nimport durable_trio as d\nprint(len(dir(d)))")
    assert int(out) >= len(durable_trio.__all__)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchName"):
        durable_trio.NoSuchName  # type: ignore[attr-defined]  # noqa: B018


def test_import_loads_no_engine_transport_or_backend() -> None:
    out = _run(
        "import sys, durable_trio\n"
        "print(sorted(m for m in sys.modules if m.startswith('durable_trio.')))"
    )
    assert out.strip() == "[]"


def test_a_redis_worker_loads_no_engine_console_cli_operations_or_postgres() -> None:
    out = _run(
        "import sys, durable_trio as dt\n"
        "dt.open_backend, dt.open_queue_transport, dt.RemoteTask\n"
        "import durable_trio.backends.redis, durable_trio.backends.sqlite\n"
        "print('\\n'.join(sorted(sys.modules)))"
    )
    loaded = set(out.split())
    for heavy in (
        "durable_trio._engine._engine",
        "durable_trio._engine._stores.redis",
        "durable_trio._engine._stores.sqlite",
        "durable_trio._ops",
        "durable_trio.console",
        "durable_trio.cli",
        "durable_trio.backends.postgres",
        "durable_trio._postgres",
    ):
        assert heavy not in loaded, heavy
