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


def test_a_one_node_redis_worker_loads_no_cluster_sentinel_or_cattrs() -> None:
    # What benchmarks/_redis_worker.py touches (python -m benchmarks startup, "a worker's
    # imports"): the Cluster and Sentinel code comes with such a URL, cattrs with the first
    # message (the codec's converters) or typed payload.
    out = _run(
        "import sys, durable_trio as dt\n"
        "dt.open_backend, dt.open_queue_transport, dt.RemoteTask\n"
        "import durable_trio.backends.redis\n"
        "print('\\n'.join(sorted(sys.modules)))"
    )
    loaded = set(out.split())
    assert "durable_trio._redis._client" in loaded
    for lazy in (
        "durable_trio._redis._cluster",
        "durable_trio._redis._cluster_nodes",
        "durable_trio._redis._topology",
        "durable_trio._redis._sentinel",
        "durable_trio._redis._sentinel_url",
        "durable_trio._redis._sharded",
        "durable_trio.brokers.redis._cluster",
        "cattrs",
    ):
        assert lazy not in loaded, lazy


def test_an_apps_imports_load_no_cattrs_cronsim_or_difflib() -> None:
    out = _run(
        "import sys\n"
        "from durable_trio import App, Retry, WorkflowContext, open_backend, open_engine,"
        " open_worker\n"
        "print('\\n'.join(sorted(sys.modules)))"
    )
    loaded = set(out.split())
    assert "durable_trio._engine._engine" in loaded
    for lazy in ("cattrs", "cronsim", "difflib"):
        assert lazy not in loaded, lazy


def test_the_lazy_redis_names_resolve_to_their_modules() -> None:
    out = _run(
        "import importlib, durable_trio._redis as r, durable_trio.brokers.redis as b\n"
        "for name, module in r._LAZY.items():\n"
        "    assert getattr(r, name) is getattr("
        "importlib.import_module('durable_trio._redis.' + module), name), name\n"
        "    assert name in dir(r) and name in r.__all__, name\n"
        "from durable_trio.brokers.redis import RedisClusterBroker\n"
        "from durable_trio.brokers.redis._cluster import RedisClusterBroker as C\n"
        "assert RedisClusterBroker is C and 'RedisClusterBroker' in dir(b)\n"
        "from durable_trio._redis import RedisClusterClient, is_cluster_client\n"
        "assert not is_cluster_client(object())\n"
        "import durable_trio as dt\n"
        "from durable_trio._engine._payloads import converter\n"
        "assert dt.payload_converter is converter\n"
        "from durable_trio._codec import converter as wire\n"
        "assert wire is not converter\n"
        "print('ok')"
    )
    assert out.strip() == "ok"
    with pytest.raises(subprocess.CalledProcessError):
        _run("import durable_trio._redis as r\nr.NoSuchName")


def test_the_wire_messages_shared_methods_behave_as_attrs_own() -> None:
    import attrs

    from durable_trio._wire import RemoteTask, StepError, StepResult

    task = RemoteTask(run_id="r", step_id="s", attempt=1, name="n", task_id="t")
    same = RemoteTask(run_id="r", step_id="s", attempt=1, name="n", task_id="t")
    assert task == same
    assert (task != same) is False
    assert hash(task) == hash(same)
    assert task != attrs.evolve(task, attempt=2)
    assert task != StepError("m")
    assert (task == "r") is False
    assert len({task, same}) == 1

    @attrs.frozen
    class Plain:  # attrs' own methods, for the repr's format
        message: str
        code: str | None = None
        retryable: bool = True
        details: object = None

    error = StepError("m", details={"a": [1]})
    assert repr(error) == repr(Plain("m", details={"a": [1]})).replace("Plain", "StepError")
    with pytest.raises(TypeError):  # a dict field is not hashable, as with attrs
        hash(error)
    assert StepResult.failure(task, StepError("x")) == StepResult.failure(same, StepError("x"))


def test_the_shared_methods_go_only_where_they_match_attrs_own() -> None:
    # shared_repr reads every field declared repr=True, shared_eq/shared_hash every field
    # declared eq=True: a class using them must have no field that attrs would treat otherwise
    # (a repr function, an eq function or key, a hash flag of its own).
    import importlib
    import pkgutil

    import attrs

    from durable_trio import _attrs_shared as shared

    for info in pkgutil.walk_packages(durable_trio.__path__, "durable_trio."):
        if info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional extra (opentelemetry, ...) not installed
            continue
        for cls in vars(module).values():
            if not (isinstance(cls, type) and attrs.has(cls) and cls.__module__ == info.name):
                continue
            uses = {
                kind
                for kind in ("repr", "eq", "hash")
                if getattr(cls, f"__{kind}__") is getattr(shared, f"shared_{kind}")
            }
            if not uses:
                continue
            for field in attrs.fields(cls):
                if "repr" in uses:
                    assert field.repr is True or field.repr is False, (cls, field.name)
                if uses & {"eq", "hash"}:
                    assert field.eq is True or field.eq is False, (cls, field.name)
                    assert field.eq_key is None, (cls, field.name)
                    assert field.hash is None, (cls, field.name)
            if "hash" in uses:  # hashable by value: frozen
                assert "eq" in uses, cls
                with pytest.raises(attrs.exceptions.FrozenInstanceError):
                    object.__new__(cls).__setattr__(attrs.fields(cls)[0].name, None)
