"""A saga that compensates on cancel: the trip is cancelled while the hotel is being booked;
the workflow catches ``RunCancelled``, releases the flight it had booked, and ends cancelled.

A second trip is cancelled by an operator from another process (``durable-trio runs cancel``):
the command writes the cancel into the run's history, the engine driving it delivers
``RunCancelled`` inside the workflow (it looks for such cancels every ``run_lease / 3``), the
same compensation runs, and the command returns once the run ended.
"""

from __future__ import annotations

import os
import sys
import uuid
from typing import Any
from urllib.parse import urlsplit

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
    namespace = f"saga-cancel-{uuid.uuid4().hex[:8]}"
    app = travel(namespace)
    async with (
        dt.open_backend(backend_url) as backend,
        open_worker(app, backend),
        open_engine(app, backend, cancel_grace=10.0, run_lease=3.0) as engine,
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

        other = await engine.start("trip", "porto")
        with trio.fail_after(30):
            await BOOKED.setdefault("porto", trio.Event()).wait()
            if urlsplit(backend_url).scheme != "memory":
                command = [sys.executable, "-m", "durable_trio", "runs", "cancel", other,
                           "--reason", "the operator cancelled it",
                           "--namespace", namespace]  # fmt: skip
                env = {**os.environ, "DURABLE_TRIO_BACKEND": backend_url}
                done = await trio.run_process(command, env=env, capture_stdout=True)
                print(f"  another process: {done.stdout.decode().strip()}")
            else:
                print("  (memory:// lives in this process only: the operator cancels in-process)")
                async with dt.open_operations(backend, namespace=namespace) as ops:
                    await ops.cancel_run(other, reason="the operator cancelled it")
            run = await engine.get(other)
        steps = [step.name for step in await engine.history(other) if step.step_id.isdigit()]
    print(f"  run {run.status} ({run.error['message']}); steps: {steps}")
    if run.status is not dt.RunStatus.CANCELLED or "porto" in SEATS:
        raise SystemExit(f"the operator's cancel did not compensate: {run}, seats {SEATS}")
