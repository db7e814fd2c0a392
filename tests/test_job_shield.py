"""The job worker's shield toggle (``_jobs._set_shield``): Trio's own setter's behaviour, with
the recalculation skipped only where it cannot change anything."""

from __future__ import annotations

import trio

from durable_trio._transport._jobs import _set_shield


async def test_a_shield_set_on_a_quiet_scope_holds_off_an_outer_cancel_until_it_is_off() -> None:
    reached: list[str] = []
    with trio.CancelScope() as outer:
        with trio.CancelScope() as scope:
            _set_shield(scope, True)
            assert scope.shield
            outer.cancel()
            await trio.lowlevel.checkpoint()  # shielded: no Cancelled
            reached.append("shielded")
            _set_shield(scope, False)  # the parent is cancelled now: Trio's setter
            assert not scope.shield
            await trio.lowlevel.checkpoint()
            reached.append("unreachable")
    assert reached == ["shielded"]
    assert outer.cancelled_caught


async def test_a_shield_set_under_an_outer_cancel_stops_it() -> None:
    reached: list[str] = []
    with trio.CancelScope() as outer:
        outer.cancel()
        with trio.CancelScope() as scope:
            _set_shield(scope, True)  # effectively cancelled: Trio's setter un-cancels it
            await trio.lowlevel.checkpoint()
            reached.append("shielded")
            _set_shield(scope, False)
            await trio.lowlevel.checkpoint()
            reached.append("unreachable")
    assert reached == ["shielded"]
    assert outer.cancelled_caught


async def test_the_scopes_own_cancel_and_deadline_still_reach_it_while_shielded() -> None:
    with trio.CancelScope() as scope:
        _set_shield(scope, True)
        scope.cancel()
        await trio.lowlevel.checkpoint()
    assert scope.cancelled_caught
    with trio.CancelScope() as timed:
        _set_shield(timed, True)
        timed.deadline = trio.current_time() + 1
        _set_shield(timed, False)  # (a deadline: Trio's setter)
        _set_shield(timed, True)
        await trio.sleep(2)
    assert timed.cancelled_caught


async def test_the_fast_path_leaves_trio_state_as_its_setter_would() -> None:
    with trio.CancelScope() as scope:
        _set_shield(scope, True)
        status = scope._cancel_status
        assert status is not None
        assert not status.effectively_cancelled
        assert scope.shield
        _set_shield(scope, False)
        assert not status.effectively_cancelled
        assert not scope.shield
        await trio.lowlevel.checkpoint()
    assert not scope.cancelled_caught
