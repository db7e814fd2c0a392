"""Credentials never leak, and refused credentials are one final error.

Every failure mode a user can hit with a password in a backend URL (a mistyped scheme, an
unescaped special character, a wrong password, an ACL that denies, an unreachable server, and the
happy path of ``examples run``) is run through the command line, and everything it printed or
logged, and every exception raised or reported (``str``, ``repr``, attributes, the whole
``__cause__`` / ``__context__`` chain), is searched for the password.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

import durable_trio as dt
from _redis_server import _free_port
from durable_trio._redact import redact_url
from durable_trio._redis import RedisAuthError, parse_redis_url
from durable_trio.cli._main import main

if TYPE_CHECKING:
    from collections.abc import Iterator

    from _redis_server import RedisServer

#: The password every test writes into its URLs; no output may hold any piece of it.
PASSWORD = "S3cr3t-Pa55"
PIECES = ("s3cr3t", "pa55")  # compared case-insensitively: a split password leaks either half

#: ACL users made on the private auth server (its default user's password is another one).
GOOD_USER = "dt-secrets"  # may do everything, password PASSWORD
DENIED_USER = "dt-denied"  # right password, no command allowed (NOPERM)
DISABLED_USER = "dt-disabled"  # right password, user switched off (WRONGPASS)

APP_SOURCE = """
import durable_trio as dt

app = dt.App("secrets")


@app.step()
async def double(x):
    return 2 * x


@app.workflow()
async def flow(ctx, x):
    return await ctx.step("double", x)
"""


def _texts(exc: BaseException) -> Iterator[str]:
    """Every text an exception carries: str, repr, attributes, traceback, its whole chain."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        error = stack.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        yield str(error)
        yield repr(error)
        yield repr(vars(error))
        yield "".join(traceback.format_exception(error))
        if isinstance(error, BaseExceptionGroup):
            stack.extend(error.exceptions)
        stack.extend(e for e in (error.__cause__, error.__context__) if e is not None)


def _assert_secret_free(*texts: str) -> None:
    for text in texts:
        for piece in PIECES:
            assert piece not in text.lower(), f"{piece!r} leaked in: {text[:400]}"


def _assert_logs_secret_free(caplog: pytest.LogCaptureFixture) -> None:
    for record in caplog.records:
        _assert_secret_free(record.getMessage())
        if record.exc_info and record.exc_info[1] is not None:
            _assert_secret_free(*_texts(record.exc_info[1]))


@pytest.fixture(scope="module")
def acl_server(redis_auth_server: RedisServer) -> Iterator[RedisServer]:
    """The private auth server with this module's ACL users (removed afterwards)."""
    server = redis_auth_server
    server.start()
    server.command("ACL", "SETUSER", GOOD_USER, "on", f">{PASSWORD}", "~*", "&*", "+@all")
    server.command("ACL", "SETUSER", DENIED_USER, "on", f">{PASSWORD}", "~*", "&*", "-@all")
    server.command("ACL", "SETUSER", DISABLED_USER, "off", f">{PASSWORD}", "~*", "+@all")
    yield server
    server.start()
    server.command("ACL", "DELUSER", GOOD_USER, DENIED_USER, DISABLED_USER)


@pytest.fixture
def app_target(tmp_path: Path) -> str:
    path = tmp_path / "secrets_app.py"
    path.write_text(APP_SOURCE)
    return f"{path}:app"


def _failure_modes(port: int) -> dict[str, tuple[str, bool]]:
    """name -> (backend URL, whether the server refuses the credentials)."""
    address = f"127.0.0.1:{port}"
    return {
        "bad scheme": (f"rediss+x://:{PASSWORD}@{address}/0", False),
        "unescaped #": (f"redis://:S3cr3t#Pa55@{address}/0", False),
        "unescaped /": (f"redis://:S3cr3t/Pa55@{address}/0", False),
        "unescaped ?": (f"redis://:S3cr3t?Pa55@{address}/0", False),
        "unescaped @": (f"redis://:S3cr3t@Pa55@{address}/0", True),  # parsed: a wrong password
        "wrong password": (f"redis://:{PASSWORD}@{address}/0", True),
        "ACL denies": (f"redis://{DENIED_USER}:{PASSWORD}@{address}/0", True),
        "user disabled": (f"redis://{DISABLED_USER}:{PASSWORD}@{address}/0", True),
        "unreachable": (f"redis://:{PASSWORD}@127.0.0.1:{_free_port()}/0", False),
    }


@contextmanager
def _interrupted_after(seconds: float) -> Iterator[None]:
    """SIGINT this process after ``seconds`` (what a user's Ctrl-C does), unless done before."""

    def interrupt(_signum: int, _frame: object) -> None:
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


MODES = list(_failure_modes(1))
COMMANDS = ["run", "worker", "engine", "health", "examples"]


def _argv(command: str, target: str, url: str) -> list[str]:
    if command == "run":
        return ["run", target, "flow", "--with-worker", "--timeout", "5", "--backend", url]
    if command in ("worker", "engine"):
        return [command, target, "--backend", url]
    if command == "health":
        return ["health", "--backend", url]
    return ["examples", "run", "hello_step", "--backend", url]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("mode", MODES)
def test_the_cli_never_shows_the_password(
    mode: str,
    command: str,
    acl_server: RedisServer,
    app_target: str,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each failure mode, through each command: one error line, nothing secret, no "serving"."""
    caplog.set_level(logging.DEBUG)
    url, refused = _failure_modes(acl_server.port)[mode]
    start = time.perf_counter()
    with _interrupted_after(5.0):  # a worker that (wrongly) serves is stopped, not waited for
        status = main(_argv(command, app_target, url))
    elapsed = time.perf_counter() - start
    out, err = capsys.readouterr()
    _assert_secret_free(out, err)
    _assert_logs_secret_free(caplog)
    assert status != 0
    assert "serving" not in out
    assert "driving" not in out
    # exactly one line, no traceback (examples too: the backend is opened once, before any)
    (shown,) = err.splitlines()
    assert shown.startswith("error: ")
    if command == "examples":
        assert "✗" not in out  # no example was run
    if refused:
        # Final: one attempt, no retry loop behind it.
        assert "refused the credentials" in shown
        assert elapsed < 1.0
    if mode.startswith("unescaped") and not refused:
        assert "character " in shown
        assert "percent-encoded" in shown


@pytest.mark.chaos
def test_the_installed_command_refuses_a_wrong_password_in_one_line(
    acl_server: RedisServer, app_target: str
) -> None:
    """The real ``durable-trio worker`` process: one line, status 2, no traceback, at once."""
    command = Path(sys.executable).with_name("durable-trio")
    url = f"redis://:{PASSWORD}@127.0.0.1:{acl_server.port}/0"
    start = time.monotonic()
    done = subprocess.run(
        [str(command), "worker", app_target, "--backend", url],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert time.monotonic() - start < 10  # the interpreter's start included: not a retry loop
    assert done.returncode == 2
    _assert_secret_free(done.stdout, done.stderr)
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: Redis at 127.0.0.1:")
    assert "refused the credentials" in line


def test_examples_run_with_a_password_shows_it_masked(
    acl_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"redis://{GOOD_USER}:{PASSWORD}@127.0.0.1:{acl_server.port}/0"
    assert main(["examples", "run", "hello_step", "--backend", url]) == 0
    out, err = capsys.readouterr()
    _assert_secret_free(out, err)
    assert GOOD_USER not in out
    assert out.count(f"redis://***@127.0.0.1:{acl_server.port}/0") == 2  # the head and the tail


async def test_a_wrong_password_is_one_final_authentication_error(
    acl_server: RedisServer,
) -> None:
    """open_backend makes one connection, and raises AuthenticationError at once."""

    def connections() -> int:
        stats = acl_server.command("INFO", "stats").decode()
        (line,) = [s for s in stats.splitlines() if s.startswith("total_connections_received:")]
        return int(line.partition(":")[2])

    before = connections()
    start = trio.current_time()
    with pytest.raises(dt.AuthenticationError) as refused:
        async with dt.open_backend(f"redis://:{PASSWORD}@127.0.0.1:{acl_server.port}/0"):
            pytest.fail("the backend opened with a wrong password")
    assert trio.current_time() - start < 1.0
    assert connections() - before == 2  # the backend's one attempt, and this INFO
    error = refused.value
    assert isinstance(error, dt.ConfigError)
    assert not isinstance(error, dt.BrokerUnavailable)
    assert isinstance(error, RedisAuthError)
    assert error.code == "WRONGPASS"
    assert f"127.0.0.1:{acl_server.port}" in str(error)
    _assert_secret_free(*_texts(error))


@pytest.mark.parametrize(
    ("user", "code"), [(DENIED_USER, "NOPERM"), (DISABLED_USER, "WRONGPASS"), (None, "NOAUTH")]
)
async def test_an_acl_refusal_is_an_authentication_error(
    acl_server: RedisServer, user: str | None, code: str
) -> None:
    credentials = f"{user}:{PASSWORD}@" if user else ""
    with pytest.raises(RedisAuthError) as refused:
        async with dt.open_backend(f"redis://{credentials}127.0.0.1:{acl_server.port}/0"):
            pytest.fail("the backend opened")
    assert refused.value.code == code
    _assert_secret_free(*_texts(refused.value))


async def test_credentials_refused_while_running_are_reported_without_the_password(
    acl_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A password changed under a running transport: the refusals its loops report (through
    on_error, and logged) are authentication errors, never 'unavailable', and hold no secret."""
    caplog.set_level(logging.DEBUG)
    rotated = "dt-rotated"
    acl_server.command("ACL", "SETUSER", rotated, "on", f">{PASSWORD}", "~*", "&*", "+@all")
    reported: list[BaseException] = []
    refused = trio.Event()

    def on_error(exc: BaseException) -> None:
        reported.append(exc)
        if isinstance(exc, dt.AuthenticationError):
            refused.set()

    url = f"redis://{rotated}:{PASSWORD}@127.0.0.1:{acl_server.port}/0"
    try:
        async with (
            dt.open_backend(url) as backend,
            dt.open_queue_transport(
                backend,
                namespace="secrets-rotated",
                on_error=on_error,
                close_timeout=1.0,
                worker_heartbeat_interval=0.2,  # a beat soon after the rotation meets it
                stalled_check_interval=0.2,
            ) as transport,
        ):
            assert "***" in backend.url
            _assert_secret_free(backend.url, repr(backend))

            async def double(task: dt.RemoteTask) -> Any:
                return 2 * task.input

            transport.handle("double", double)
            await trio.sleep(0.2)
            acl_server.command("ACL", "SETUSER", rotated, "resetpass", ">another-one")
            acl_server.command("CLIENT", "KILL", "USER", rotated)
            with trio.fail_after(10):
                await refused.wait()
    finally:
        acl_server.command("ACL", "DELUSER", rotated)
    for exc in reported:
        _assert_secret_free(*_texts(exc))
        if "WRONGPASS" in str(exc):
            assert isinstance(exc, dt.AuthenticationError)
    _assert_logs_secret_free(caplog)


@pytest.mark.parametrize(
    ("url", "position", "problem"),
    [
        ("redis://:S3cr3t#Pa55@h:6379/0", 16, "the host part ends here"),
        ("redis://:S3cr3t/Pa55@h/0", 16, "the host part ends here"),
        ("redis://u:S3cr3t?Pa55@h", 17, "the host part ends here"),
        ("redis://h:S3cr3tPa55/0", 11, "the port is not a number"),
        ("redis://:S3cr3t-Pa55@h:99999/0", 24, "the port is out of range"),
        ("redis://:S3cr3t-Pa55@[::1/0", 22, "the host cannot be parsed"),
        ("redis://:S3cr3t-Pa55@h/S3cr3t", 24, "the path is a database number"),
        ("redis://:S3cr3t-Pa55@h/0?s3cr3t=1", 26, "an unknown option"),
        ("redis://S3cr3t-Pa55@h/0", 9, "a user name needs a password"),
        ("redis://:S3cr3t-Pa55@/0", 22, "no host"),
    ],
)
def test_url_errors_name_the_position_never_the_text(url: str, position: int, problem: str) -> None:
    with pytest.raises(dt.ConfigError) as bad:
        parse_redis_url(url)
    message = str(bad.value)
    assert f"character {position}: {problem}" in message
    assert bad.value.__cause__ is None
    assert bad.value.__context__ is None  # urllib's own message quotes the host part
    _assert_secret_free(*_texts(bad.value))


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://u:S3cr3t-Pa55@h:1/2", "redis://***@h:1/2"),
        ("rediss://:S3cr3t-Pa55@h/0?ssl_cert_reqs=none", "rediss://***@h/0?ssl_cert_reqs=none"),
        ("redis://:S3cr3t#Pa55@h/0", "redis://***@h/0"),
        ("redis://:S3cr3t/Pa55@h/0", "redis://***@h/0"),
        ("redis://:S3cr3t@Pa55@h/0", "redis://***@h/0"),
        ("rediss+x://:S3cr3t-Pa55@h", "rediss+x://***@h"),
        ("S3cr3t:Pa55@h", "***"),
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("sqlite:///data/a@b.db", "sqlite:///data/a@b.db"),
        ("memory://", "memory://"),
    ],
)
def test_redact_url_masks_credentials_even_in_malformed_urls(url: str, shown: str) -> None:
    assert redact_url(url) == shown


async def test_a_sqlite_parent_that_is_a_file_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(dt.ConfigError, match="a parent of it is a file") as bad:
        async with dt.open_backend(f"sqlite:///{blocker}/sub/x.db"):
            pytest.fail("opened")
    assert str(blocker / "sub" / "x.db") in str(bad.value)
    assert bad.value.__context__ is None
    with pytest.raises(dt.ConfigError, match="it is a folder"):
        async with dt.open_backend(f"sqlite:///{tmp_path}"):
            pytest.fail("opened")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
async def test_a_sqlite_folder_that_is_not_writable_is_a_config_error(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(dt.ConfigError, match="not writable"):
        async with dt.open_backend(f"sqlite:///{locked}/x.db"):
            pytest.fail("opened")


def test_the_cli_says_one_line_for_a_sqlite_parent_that_is_a_file(
    tmp_path: Path, app_target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for argv in (
        ["run", app_target, "flow", "--detach", "--backend", f"sqlite:///{blocker}/x.db"],
        ["worker", app_target, "--backend", f"sqlite:///{blocker}/x.db"],
    ):
        assert main(argv) == 2
        _, err = capsys.readouterr()
        (line,) = err.splitlines()
        assert line.startswith("error: cannot use ")
        assert "a parent of it is a file" in line


@settings(max_examples=300, deadline=None)
@given(
    middle=st.text(alphabet="@:/?#%&=[] +xyz09", max_size=12),
    user=st.sampled_from(["", "app"]),
    tail=st.sampled_from(["", ":6379", ":6379/0", "/0?client_name=w", "/x"]),
)
def test_no_password_survives_redaction_or_parsing(middle: str, user: str, tail: str) -> None:
    """Any password, escaped or not, in any URL: neither its shown form nor a parse error holds
    its beginning or its end."""
    password = f"Q7x{middle}Z9w"
    url = f"redis://{user}:{password}@127.0.0.1{tail}"
    shown = [redact_url(url)]
    try:
        shown.append(repr(parse_redis_url(url)))
    except dt.ConfigError as exc:
        shown.extend(_texts(exc))
    for text in shown:
        assert "Q7x" not in text
        assert "Z9w" not in text
