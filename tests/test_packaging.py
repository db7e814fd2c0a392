"""What ``pip install .`` ships: the library alone, and an ``examples`` command that says where
the examples are when they are not on the machine.

The wheel is built by pip from a copy of the checkout without its build leftovers (what a fresh
clone holds), with the build backend pyproject.toml names, as ``pip install .`` does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.chaos  # pip builds a wheel in a subprocess (about 5 s)

REPOSITORY = Path(__file__).resolve().parent.parent
PACKAGE = REPOSITORY / "durable_trio"

# Left behind by a checkout's own builds, installs and runs; a fresh clone has none of them.
_NOT_IN_A_CLONE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".durable", "*.db*"
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    shutil.copytree(REPOSITORY, source, ignore=_NOT_IN_A_CLONE)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work / "dist"), "."],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    (path,) = (work / "dist").glob("durable_trio-*.whl")
    return path


def test_the_wheel_ships_the_library_and_nothing_else(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        top_level = archive.read(next(n for n in names if n.endswith("/top_level.txt")))
    assert top_level.decode().split() == ["durable_trio"]
    shipped = {name for name in names if not name.startswith("durable_trio-0.1.0.dist-info/")}
    assert not [name for name in shipped if "bench" in name]
    assert "durable_trio/_docs.py" not in shipped
    assert "durable_trio/testing_strategies.py" not in shipped
    assert {
        "durable_trio/py.typed",
        "durable_trio/__init__.py",
        "durable_trio/brokers/memory.py",
        "durable_trio/brokers/sqlite/__init__.py",
        "durable_trio/brokers/redis/__init__.py",
        "durable_trio/keys/redis.py",
        "durable_trio/testing/strategies.py",
        "durable_trio/testing/fixtures.py",
        "durable_trio/testing/faults.py",
        "durable_trio/testing/simulation.py",
    } <= shipped
    # and exactly the package's own files: nothing dropped, nothing from beside it
    in_source = {
        path.relative_to(PACKAGE.parent).as_posix()
        for path in PACKAGE.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    assert shipped == in_source


def test_examples_from_the_wheel_say_where_the_examples_are(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    # PYTHONPATH comes before the editable install's path entry: the wheel's copy is imported.
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("DURABLE_TRIO_EXAMPLES", None)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    where = cli("-c", "import durable_trio.cli._main as cli; print(cli.__file__)")
    assert where.stdout.strip() == str(site / "durable_trio" / "cli" / "_main.py"), where.stderr
    for action in (["list"], ["run", "--all"], ["run", "hello_step"]):
        done = cli("-m", "durable_trio", "examples", *action)
        assert done.returncode == 2, (action, done.stdout, done.stderr)
        assert done.stdout == ""
        (line,) = done.stderr.splitlines()
        assert "not installed with the package" in line
        assert "examples/ folder of the durable_trio repository" in line
        assert "DURABLE_TRIO_EXAMPLES" in line


@pytest.mark.redis
def test_the_wheel_installs_with_the_redis_extra_and_serves_a_step_over_redis(
    wheel: Path, tmp_path: Path, redis_url: str
) -> None:
    """``pip install "durable_trio[redis]"`` from the built wheel, into a fresh venv: hiredis
    comes with it and one step round-trips over a private redis-server (README, deployment)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", f"durable_trio[redis] @ {wheel.as_uri()}"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert installed.returncode == 0, installed.stderr
    probe = (
        "import sys, trio, hiredis, durable_trio as dt\n"
        "async def main():\n"
        "    async with dt.open_backend(sys.argv[1]) as backend:\n"
        "        async with dt.open_queue_transport(backend, namespace='wheel') as t:\n"
        "            done = trio.Event()\n"
        "            got = []\n"
        "            async def double(task): return task.input * 2\n"
        "            async def on_result(result):\n"
        "                got.append(result.output); done.set()\n"
        "            t.handle('double', double)\n"
        "            t.on_result(on_result)\n"
        "            await t.dispatch(dt.RemoteTask(run_id='r', step_id='s', attempt=1,\n"
        "                                           name='double', input=21))\n"
        "            with trio.fail_after(30):\n"
        "                await done.wait()\n"
        "    print(got[0], dt.__file__)\n"
        "trio.run(main)\n"
    )
    used = subprocess.run(
        [str(python), "-c", probe, redis_url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert used.returncode == 0, used.stderr
    output, location = used.stdout.split()
    assert output == "42"
    assert location.startswith(str(venv))
