"""Leading callers (issue 35, item 1): a caller reads its own reply from the socket.

A connection over one end of a socket pair, the test playing the server at the other end, in
virtual time: replies come exactly when the test sends them. An instrument counts the steps of
the connection's reader task, to tell who read a reply.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
from typing import TYPE_CHECKING, Any

import hiredis
import pytest
import trio
import trio.testing

from durable_trio._errors import BrokerUnavailable, TransportClosed
from durable_trio._redis import RedisCommandTimeout, parse_redis_url
from durable_trio._redis._connection import _HANGUP, _REPLIES, Connection

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.skipif(not _HANGUP, reason="leading callers need select.epoll")


class _ReaderSteps(trio.abc.Instrument):
    """Counts the steps of connections' reader tasks."""

    def __init__(self) -> None:
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith("._watch_loop"):
            self.steps += 1


class _Server:
    """The far end of the pair: reads the client's commands, answers as the test says."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.parser = hiredis.Reader()
        self.queued: list[list[bytes]] = []

    async def commands(self, count: int) -> list[list[bytes]]:
        """The next ``count`` commands, in the order they came."""
        while len(self.queued) < count:
            self.parser.feed(await self.stream.receive_some(65536))
            while (command := self.parser.gets()) is not False:
                self.queued.append(command)
        got, self.queued = self.queued[:count], self.queued[count:]
        return got

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def echo(self, commands: list[list[bytes]]) -> None:
        """Answer ``ECHO`` commands (in one write)."""
        await self.send(b"".join(b"$%d\r\n%s\r\n" % (len(c[1]), c[1]) for c in commands))


@contextlib.asynccontextmanager
async def _connection(**options: Any) -> AsyncIterator[tuple[Connection, _Server, _ReaderSteps]]:
    left, right = trio.socket.socketpair()
    steps = _ReaderSteps()
    trio.lowlevel.add_instrument(steps)
    async with trio.open_nursery() as nursery:
        conn = Connection(
            trio.SocketStream(left),
            parse_redis_url("redis://127.0.0.1:1"),
            command_timeout=options.pop("command_timeout", 10.0),
            **options,
        )
        assert conn._watch is not None  # the path under test
        nursery.start_soon(conn._run)
        server = _Server(trio.SocketStream(right))
        await trio.testing.wait_all_tasks_blocked()
        steps.steps = 0
        try:
            yield conn, server, steps
        finally:
            conn.close()
            await server.stream.aclose()
    trio.lowlevel.remove_instrument(steps)


async def _answer_later(server: _Server, count: int, delay: float = 1.0) -> None:
    commands = await server.commands(count)
    await trio.sleep(delay)
    await server.echo(commands)


async def test_a_lone_callers_reply_is_read_by_the_caller(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with _connection() as (conn, server, steps):
        for j in range(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_answer_later, server, 1)
                start = trio.current_time()
                assert await conn.execute("ECHO", f"j{j}") == f"j{j}".encode()
                assert trio.current_time() == start + 1
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_answer_later, server, 3)
            assert await conn.pipeline([("ECHO", "a"), ("ECHO", "b"), ("ECHO", "c")]) == [
                b"a",
                b"b",
                b"c",
            ]
        assert steps.steps == 0  # the reader task never ran: the caller read its replies
        assert conn._lead is None
        assert conn._watching == _HANGUP
        assert conn.stats.replies == 8
        assert conn.stats.dropped == 0


async def test_many_callers_one_leader(autojump_clock: trio.testing.MockClock) -> None:
    async with _connection() as (conn, server, steps):
        got: dict[int, Any] = {}

        async def caller(i: int) -> None:
            got[i] = await conn.execute("ECHO", str(i))

        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(caller, i)
            commands = await server.commands(5)
            assert conn._lead is conn._pending[0]  # the oldest pending command's caller leads
            await server.echo(commands)
        assert got == {i: str(i).encode() for i in range(5)}
        assert steps.steps == 0  # one read by the leader served everyone
        assert conn._lead is None
        assert conn._watching == _HANGUP
        assert conn.stats.replies == 5


async def test_the_reader_takes_over_when_the_leaders_reply_is_in(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with _connection() as (conn, server, steps):
        got: dict[int, Any] = {}

        async def caller(i: int) -> None:
            got[i] = await conn.execute("ECHO", str(i))

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(caller, i)
            commands = await server.commands(3)
            first = int(commands[0][1])
            await server.echo(commands[:1])  # the leader's reply alone
            await trio.sleep(1)
            assert got == {first: str(first).encode()}
            assert conn._lead is None
            assert conn._watching == _REPLIES  # the reader reads the rest
            await server.echo(commands[1:])
        assert got == {i: str(i).encode() for i in range(3)}
        assert steps.steps > 0
        assert conn._watching == _HANGUP  # nothing pending: the next caller leads
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_answer_later, server, 1)
            assert await conn.execute("ECHO", "next") == b"next"
        assert conn.stats.dropped == 0


async def test_a_cancelled_leaders_reply_is_drained_and_the_others_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with _connection() as (conn, server, _):
        got: dict[int | str, Any] = {}
        leader_scope = trio.CancelScope()

        async def caller(i: int) -> None:
            got[i] = await conn.execute("ECHO", str(i))

        async def leader() -> None:
            with leader_scope:
                got["leader"] = await conn.execute("ECHO", "leader")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(leader)
            await trio.testing.wait_all_tasks_blocked()
            for i in range(3):
                nursery.start_soon(caller, i)
            commands = await server.commands(4)
            assert commands[0] == [b"ECHO", b"leader"]
            await trio.sleep(1)
            leader_scope.cancel()
            await trio.sleep(1)
            assert leader_scope.cancelled_caught
            assert conn._lead is None
            assert conn._watching == _REPLIES  # the reader reads what is still due
            # Half of the leader's reply, then the rest with the others'.
            await server.send(b"$6\r\nlea")
            await trio.sleep(1)
            await server.send(b"der\r\n")
            await server.echo(commands[1:])
        assert got == {i: str(i).encode() for i in range(3)}
        assert conn.stats.dropped == 1
        assert conn.healthy
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_answer_later, server, 1)
            assert await conn.execute("ECHO", "after") == b"after"


async def test_a_leader_cancelled_with_a_partial_pipeline_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The leader has read (and kept) the first of its pipeline's replies when it is cancelled:
    # the rest is drained, and the next caller gets its own.
    async with _connection() as (conn, server, _):
        start = trio.current_time()
        with trio.move_on_after(5) as scope:
            async with trio.open_nursery() as nursery:

                async def first_reply_only() -> None:
                    commands = await server.commands(2)
                    await server.echo(commands[:1])

                nursery.start_soon(first_reply_only)
                await conn.pipeline([("ECHO", "x"), ("ECHO", "y")])
        assert scope.cancelled_caught
        assert trio.current_time() == start + 5
        assert conn._watching == _REPLIES
        await server.echo([[b"ECHO", b"y"]])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_answer_later, server, 1)
            assert await conn.execute("ECHO", "after") == b"after"
        assert conn.stats.dropped == 1
        assert conn.stats.replies == 3


async def test_a_cancelled_leader_discards_a_dedicated_connection(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with _connection(discard_on_cancel=True) as (conn, server, _):
        with trio.move_on_after(1) as scope:
            await conn.execute("BLPOP", "q", 0, reply_timeout=math.inf)
        assert scope.cancelled_caught
        assert not conn.healthy
        with pytest.raises(BrokerUnavailable, match="cancelled before its reply"):
            await conn.execute("PING")
        assert len(await server.commands(1)) == 1


async def test_an_end_of_stream_seen_by_the_leader(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with _connection() as (conn, server, _):

        async def close_later() -> None:
            await server.commands(1)
            await trio.sleep(1)
            await server.stream.send_eof()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(close_later)
            start = trio.current_time()
            with pytest.raises(BrokerUnavailable, match="closed the connection"):
                await conn.execute("PING")
            assert trio.current_time() == start + 1
        assert not conn.healthy


async def test_a_reply_then_the_end_of_stream(autojump_clock: trio.testing.MockClock) -> None:
    # The server answers, then hangs up: the leader gets its reply, and the reader (watching for
    # a hang-up once the connection is idle) marks the connection dead without a command.
    async with _connection() as (conn, server, _):

        async def answer_and_close() -> None:
            await server.echo(await server.commands(1))
            await server.stream.send_eof()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer_and_close)
            assert await conn.execute("ECHO", "last") == b"last"
        await trio.testing.wait_all_tasks_blocked()
        assert not conn.healthy
        with pytest.raises(BrokerUnavailable, match="closed the connection"):
            await conn.execute("PING")


async def test_an_idle_connection_notices_the_server_closing_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with _connection() as (conn, server, steps):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_answer_later, server, 1)
            assert await conn.execute("ECHO", "x") == b"x"
        await trio.sleep(10)
        assert conn.healthy
        assert steps.steps == 0
        await server.stream.send_eof()
        await trio.testing.wait_all_tasks_blocked()
        assert not conn.healthy
        assert steps.steps > 0  # woken by the hang-up (then cancelled)


async def test_a_hang_up_while_a_caller_leads_is_left_to_the_leader(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The reply and the hang-up come together: the reader, woken by the hang-up, stands aside;
    # the leader reads its reply, and the end of the stream after it fails the connection.
    async with _connection() as (conn, server, _):

        async def answer_and_close() -> None:
            commands = await server.commands(2)
            await trio.sleep(1)
            await server.echo(commands[:1])
            await server.stream.send_eof()

        got: list[Any] = []

        async def leader() -> None:
            got.append(await conn.execute("ECHO", "leader"))

        async def follower() -> None:
            with pytest.raises(BrokerUnavailable, match="closed the connection"):
                await conn.execute("ECHO", "follower")
            got.append("follower failed")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer_and_close)
            nursery.start_soon(leader)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(follower)
            await trio.testing.wait_all_tasks_blocked()
            assert conn._lead is conn._pending[0]
        assert sorted(got, key=str) == sorted([b"leader", "follower failed"], key=str)
        assert not conn.healthy


async def test_a_connection_closed_while_a_caller_leads(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with _connection() as (conn, server, _):
        async with trio.open_nursery() as nursery:

            async def close_later() -> None:
                await server.commands(1)
                await trio.sleep(1)
                conn.close()

            nursery.start_soon(close_later)
            start = trio.current_time()
            with pytest.raises(TransportClosed):
                await conn.execute("PING")
            assert trio.current_time() == start + 1
        assert not conn.healthy


async def test_a_leaders_command_timeout(autojump_clock: trio.testing.MockClock) -> None:
    async with _connection(command_timeout=3.0) as (conn, server, _):
        start = trio.current_time()
        with pytest.raises(RedisCommandTimeout, match="within 3s"):
            await conn.execute("PING")
        assert trio.current_time() == start + 3
        assert not conn.healthy
        assert len(await server.commands(1)) == 1


@pytest.mark.parametrize("seed", range(8))
async def test_cancellation_fuzz_with_leaders(
    autojump_clock: trio.testing.MockClock, seed: int
) -> None:
    # Callers come and go, some cancelled at random moments (while leading, following, or
    # before their command is sent); the server answers in random pieces after random delays.
    # Every caller that completes gets its own replies, and the connection stays in step.
    rng = random.Random(seed)
    async with _connection() as (conn, server, _):

        async def serve() -> None:
            while True:
                commands = await server.commands(1)
                data = b"".join(b"$%d\r\n%s\r\n" % (len(c[-1]), c[-1]) for c in commands)
                while data:
                    cut = rng.randint(1, len(data))
                    await trio.sleep(rng.choice([0, 0, 0.001, 0.01]))
                    await server.send(data[:cut])
                    data = data[cut:]

        outcomes = {"completed": 0, "cancelled": 0}

        async def caller(i: int) -> None:
            for j in range(30):
                tag = f"{i}-{j}"
                with trio.move_on_after(rng.choice([0, 0.0005, 0.002, 0.01, 1.0])):
                    if rng.random() < 0.3:
                        replies = await conn.pipeline([("ECHO", tag), ("ECHO", tag + "b")])
                        assert replies == [tag.encode(), (tag + "b").encode()]
                    else:
                        assert await conn.execute("ECHO", tag) == tag.encode()
                    outcomes["completed"] += 1
                    continue
                outcomes["cancelled"] += 1
                await trio.sleep(rng.choice([0, 0.001]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            async with trio.open_nursery() as callers:
                for i in range(rng.randint(1, 6)):
                    callers.start_soon(caller, i)
            assert conn.healthy
            assert await conn.execute("ECHO", "after") == b"after"
            nursery.cancel_scope.cancel()
        assert outcomes["completed"] > 0
        assert outcomes["cancelled"] > 0
        assert conn.stats.replies == conn.stats.commands
        assert conn._lead is None
        assert conn._watching == _HANGUP


async def test_a_leader_cancelled_with_its_reply_already_in_the_socket(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The reply is in the socket (not yet seen by Trio's epoll) when the leader is cancelled:
    # the reader, handed the role, finds it there at once and drains it.
    async with _connection() as (conn, server, steps):
        scope = trio.CancelScope()

        async def leader() -> None:
            with scope:
                await conn.execute("ECHO", "gone")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(leader)
            await server.commands(1)
            await trio.testing.wait_all_tasks_blocked()
            # In the socket, and no checkpoint till the cancel:
            os.write(server.stream.socket.fileno(), b"$4\r\ngone\r\n")
            scope.cancel()
        assert scope.cancelled_caught
        await trio.testing.wait_all_tasks_blocked()
        assert conn.stats.dropped == 1
        assert conn._watching == _HANGUP
        assert steps.steps > 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_answer_later, server, 1)
            assert await conn.execute("ECHO", "after") == b"after"


async def test_a_leaders_next_command_leaves_with_those_of_the_callers_it_woke(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Five callers in lockstep: one read by the leader wakes the four others; the leader's next
    # command, sent before they run, is held one pass and leaves in the same write as theirs.
    async with _connection() as (conn, server, _):

        async def serve() -> None:
            for _ in range(4):
                await server.echo(await server.commands(5))

        async def caller(i: int) -> None:
            for j in range(4):
                assert await conn.execute("ECHO", f"{i}:{j}") == f"{i}:{j}".encode()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            for i in range(5):
                nursery.start_soon(caller, i)
        assert conn.stats.commands == 20
        # The first round in two writes (its leader's command at once, the four queued behind
        # it at the pass's end), then one write a round.
        assert conn.stats.batches == 5
