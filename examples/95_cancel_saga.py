"""A saga that compensates on cancel: the trip is cancelled while the hotel is being booked;
the workflow catches ``RunCancelled``, releases the flight it had booked, and ends cancelled."""

from __future__ import annotations

import uuid
from typing import Any

import trio

import durable_trio as dt
from durable_trio import App, RunCancelled, WorkflowContext, open_engine, open_worker

SEATS: dict[str, str] = {}
"""The airline's bookings: the compensation must leave none behind."""
BOOKED: dict[str, trio.Event] = {}


def travel(name: str) -> App:
    app = App(name)

    @app.step("book-flight")
    async def book_flight(trip: str) -> str:
        SEATS[trip] = "booked"
        BOOKED.setdefault(trip, trio.Event()).set()
        return f"seat for {trip}"

    @app.step("book-hotel")
    async def book_hotel(trip: str) -> str:
        await trio.sleep(60)  # the hotel's API is slow today
        return f"room for {trip}"

    @app.step("release-flight")
    async def release_flight(trip: str) -> str:
        SEATS.pop(trip, None)
        return f"released the seat of {trip}"

    @app.workflow("trip")
    async def trip(ctx: WorkflowContext, trip: str) -> Any:
        try:
            seat = await ctx.step("book-flight", trip)
            room = await ctx.step("book-hotel", trip)
        except RunCancelled:
            # Runs shielded from the cancel, bounded by the engine's cancel_grace. The release
            # is idempotent: it also undoes a booking the cancel interrupted mid-flight.
            await ctx.step("release-flight", trip)
            raise
        return [seat, room]

    return app


async def main(backend_url: str) -> None:
    app = travel(f"saga-cancel-{uuid.uuid4().hex[:8]}")
    async with (
        dt.open_backend(backend_url) as backend,
        open_worker(app, backend),
        open_engine(app, backend, cancel_grace=10.0) as engine,
    ):
        run_id = await engine.start("trip", "lisbon")
        with trio.fail_after(30):
            # The flight is booked; the hotel is pending.
            await BOOKED.setdefault("lisbon", trio.Event()).wait()
            await engine.cancel(run_id, reason="the customer changed plans")
            run = await engine.get(run_id)
        steps = [step.name for step in await engine.history(run_id) if step.step_id.isdigit()]
    print(f"  run {run.status} ({run.error['message']}); steps: {steps}")
    if run.status is not dt.RunStatus.CANCELLED or "lisbon" in SEATS:
        raise SystemExit(f"the saga did not compensate: {run}, seats {SEATS}")
