"""The Redis client's auto-pipelining (issue 35, item 1): the commands queued during one pass of
Trio's scheduler leave in one write per connection, written by an instrument at the end of the
pass (but for a leading caller's, which found the connection idle: it leaves at once), and a
caller cancelled in that pass still leaves the connection in step.

The real clock throughout, on a private redis-server over real sockets.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import trio

from _redis_server import *  # noqa: F403  (the fixtures; harmless once conftest imports them too)
from durable_trio._redis import open_redis
from durable_trio.redis import open_redis as public_open_redis

pytestmark = pytest.mark.redis


def _flusher_users() -> int:
    from durable_trio._redis._connection import _FLUSHER

    return _FLUSHER.get()._users


async def test_the_commands_of_one_pass_leave_in_one_write(redis_url: str) -> None:
    async with open_redis(redis_url, pool_size=1) as client:
        await client.execute("PING")
        (conn,) = client.connections
        before = conn.stats.batches
        replies: dict[int, bytes] = {}

        async def caller(i: int) -> None:
            replies[i] = await client.execute("ECHO", f"one-pass:{i}")

        async with trio.open_nursery() as nursery:
            for i in range(25):
                nursery.start_soon(caller, i)  # all 25 run in the same pass
        assert replies == {i: f"one-pass:{i}".encode() for i in range(25)}
        # The first found the connection idle: it leads, and its command left at once; the
        # 24 queued behind it in the pass left together in one write at the pass's end.
        assert conn.stats.batches - before == 2


async def test_callers_in_lockstep_share_every_write(redis_url: str) -> None:
    # Ten callers, each sending its next command as soon as its reply comes: the replies come
    # back together, so the ten next commands go out together too.
    async with open_redis(redis_url, pool_size=1) as client:
        await client.execute("PING")
        (conn,) = client.connections
        before_commands, before_batches = conn.stats.commands, conn.stats.batches

        async def caller(i: int) -> None:
            for j in range(50):
                assert await client.execute("ECHO", f"{i}:{j}") == f"{i}:{j}".encode()

        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(caller, i)
        commands = conn.stats.commands - before_commands
        batches = conn.stats.batches - before_batches
    assert commands == 500
    # Ten a write while the replies come back in one read; when a read splits them, the
    # callers fall into two or three groups that write apart (seen: 129 writes). One write a
    # command would be 500.
    assert batches <= commands / 3, (commands, batches)


async def test_callers_cancelled_before_the_flush_leave_the_connection_in_step(
    redis_url: str,
) -> None:
    # One pass runs keepers, victims, a canceller in the middle of the victims, more victims and
    # keepers: the victims that ran before the canceller queued their command and are cancelled
    # before the pass ends, so their bytes are still written and their replies drained (but for
    # one whose command was the last queued: it takes it back, unsent); those after it never
    # queue one. The keepers, and the next caller, get their own replies. Trio
    # may run a pass's tasks in any order (it shuffles them under hypothesis), so the canceller
    # can run before every victim: the pass is tried again until some victim had queued.
    async with open_redis(redis_url, pool_size=1) as client:
        await client.execute("PING")
        (conn,) = client.connections
        for _ in range(30):
            before = (conn.stats.commands, conn.stats.dropped)
            victims = [trio.CancelScope() for _ in range(20)]
            got: dict[str, bytes] = {}

            async def caller(name: str, scope: trio.CancelScope | None = None) -> None:
                with scope or trio.CancelScope():
                    got[name] = await client.execute("ECHO", name)  # noqa: B023

            async def canceller() -> None:
                for scope in victims:  # noqa: B023
                    scope.cancel()

            async with trio.open_nursery() as nursery:
                for i in range(5):
                    nursery.start_soon(caller, f"keeper:{i}")
                for i in range(10):
                    nursery.start_soon(caller, f"victim:{i}", victims[i])
                nursery.start_soon(canceller)
                for i in range(10, 20):
                    nursery.start_soon(caller, f"victim:{i}", victims[i])
                for i in range(5, 10):
                    nursery.start_soon(caller, f"keeper:{i}")
            assert got == {f"keeper:{i}": f"keeper:{i}".encode() for i in range(10)}
            assert await client.execute("ECHO", "after") == b"after"
            stats = conn.stats
            assert stats.commands == stats.replies
            commands, dropped = stats.commands - before[0], stats.dropped - before[1]
            assert dropped == commands - 1 - 10  # all but "after" and the keepers
            if dropped >= 1:  # some victims had queued their command (10 in spawn order)
                break
        else:
            raise AssertionError("no victim ever queued its command before the canceller ran")


@pytest.mark.parametrize("dedicated", [False, True])
async def test_a_caller_cancelled_behind_a_leader_takes_its_unsent_command_back(
    redis_url: str, dedicated: bool
) -> None:
    # A leader waits on the socket for its BLPOP's reply, so the next caller does not lead: it
    # queues its command with no cancellation check first, is cancelled at its wait (its scope
    # was cancelled already) and takes the command back before the pass's write. Nothing was
    # sent: nothing to drain, and a dedicated connection is kept.
    async with open_redis(redis_url, pool_size=1) as client:
        async with contextlib.AsyncExitStack() as stack:
            if dedicated:
                conn = await stack.enter_async_context(client.dedicated())
                execute = conn.execute
            else:
                execute = client.execute
            await execute("DEL", "pipelining:ghost")
            if not dedicated:
                (conn,) = client.connections
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(execute, "BLPOP", "pipelining:none", 0.3))
                await trio.testing.wait_all_tasks_blocked()
                assert conn.load == 1  # the BLPOP, its caller reading the socket
                commands, dropped = conn.stats.commands, conn.stats.dropped
                with trio.CancelScope() as scope:
                    scope.cancel()
                    await execute("SET", "pipelining:ghost", "1")
                assert scope.cancelled_caught
                assert (conn.stats.commands, conn.load) == (commands, 1)  # taken back
            assert conn.healthy
            assert await execute("GET", "pipelining:ghost") is None
            assert conn.stats.dropped == dropped
            assert conn.stats.commands == conn.stats.replies


async def test_the_flusher_is_uninstalled_when_the_last_connection_closes(redis_url: str) -> None:
    async with open_redis(redis_url, pool_size=2) as client:
        async with client.dedicated() as conn:
            await conn.execute("PING")
            await client.execute("PING")
            assert _flusher_users() == 2
        await trio.testing.wait_all_tasks_blocked()
        assert _flusher_users() == 1
    assert _flusher_users() == 0
    from durable_trio._redis._connection import _FLUSHER

    with pytest.raises(KeyError):  # no longer installed
        trio.lowlevel.remove_instrument(_FLUSHER.get())


async def test_the_public_module_is_the_same_client(redis_url: str) -> None:
    assert public_open_redis is open_redis
    async with public_open_redis(redis_url) as client:
        assert await client.execute("ECHO", "public") == b"public"


async def test_a_leading_callers_command_leaves_in_its_own_task_step(redis_url: str) -> None:
    # A caller that finds the connection idle leads (reads its reply itself). Nothing is queued
    # before its command to share a write with, so it is written in the caller's own task step
    # (the server works on it while the pass runs on), not by the flusher at the pass's end.
    async with open_redis(redis_url, pool_size=1) as client:
        await client.execute("PING")
        (conn,) = client.connections
        before = conn.stats.batches
        caller_task: list[trio.lowlevel.Task] = []
        after_first_step: list[int] = []

        class AfterStep(trio.abc.Instrument):
            def after_task_step(self, task: trio.lowlevel.Task) -> None:
                if caller_task and task is caller_task[0] and not after_first_step:
                    after_first_step.append(conn.stats.batches)

        async def caller() -> None:
            caller_task.append(trio.lowlevel.current_task())
            assert await client.execute("ECHO", "lead") == b"lead"

        instrument = AfterStep()
        trio.lowlevel.add_instrument(instrument)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(caller)
        finally:
            trio.lowlevel.remove_instrument(instrument)
        assert after_first_step == [before + 1]  # written before the step ended
        assert conn.stats.batches == before + 1


async def test_callers_woken_with_their_slot_get_replies_and_errors_of_their_own(
    redis_url: str,
) -> None:
    # A waiting caller is rescheduled with its request's slot as the outcome (no outcome.Value
    # a reply): replies reach their callers in order, and when the connection dies each caller
    # still waiting gets an error object of its own, not one instance shared by all.
    from durable_trio._errors import TransportClosed

    async with open_redis(redis_url, pool_size=1) as client:
        await client.execute("PING")
        (conn,) = client.connections
        replies: dict[int, object] = {}

        async def caller(i: int) -> None:
            replies[i] = await conn.execute("ECHO", f"slot:{i}")

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(caller, i)
        assert replies == {i: f"slot:{i}".encode() for i in range(8)}

        errors: list[BaseException] = []

        async def blocked() -> None:
            try:
                await conn.execute("BLPOP", "slot:never", 0, reply_timeout=float("inf"))
            except TransportClosed as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(blocked)
            await trio.sleep(0.05)
            conn.close()
        assert len(errors) == 4
        assert len({id(error) for error in errors}) == 4
