"""A fan-out of 1,000 tasks with priorities: urgent ones (priority 0) run before bulk (9)."""

from __future__ import annotations

import time
import uuid

import trio
import trio.lowlevel

import durable_trio as dt

TASKS = 1000
URGENT_EVERY = 10  # every tenth task is urgent
SLOTS = 16


async def main(backend_url: str) -> None:
    # A fresh namespace per run: what an interrupted earlier run left in a reused file stays out.
    namespace = f"fanout-{uuid.uuid4().hex[:8]}"
    async with dt.open_backend(backend_url) as backend:
        order: list[bool] = []  # True for an urgent task, in the order workers ran them
        finished = trio.Event()
        results = 0

        async with dt.open_queue_transport(backend, namespace=namespace) as engine:

            async def on_result(result: dt.StepResult) -> None:
                nonlocal results
                results += 1
                if results == TASKS:
                    finished.set()

            engine.on_result(on_result)
            # Enqueue everything before a worker exists, so priority has something to reorder.
            for n in range(TASKS):
                urgent = n % URGENT_EVERY == URGENT_EVERY - 1
                await engine.dispatch(
                    dt.RemoteTask(
                        run_id="fan-out",
                        step_id=f"item-{n}",
                        attempt=1,
                        name="resize-image",
                        input={"n": n, "urgent": urgent},
                        priority=0 if urgent else 9,
                    )
                )
            start = time.perf_counter()
            async with dt.open_queue_transport(
                backend, namespace=namespace, concurrency=SLOTS
            ) as worker:

                async def resize(task: dt.RemoteTask) -> int:
                    order.append(task.input["urgent"])
                    await trio.lowlevel.checkpoint()
                    return int(task.input["n"])

                worker.handle("resize-image", resize)
                with trio.fail_after(60):
                    await finished.wait()
            elapsed = time.perf_counter() - start
    urgent_total = TASKS // URGENT_EVERY
    # Jobs claimed in one batch run side by side, so "first" means claimed first: every urgent
    # task must have started before the bulk tasks claimed with the last urgent batch finished.
    last_urgent = max(i for i, urgent in enumerate(order) if urgent)
    urgent_first = last_urgent < urgent_total + SLOTS
    print(f"  {TASKS} tasks fanned out to a worker with {SLOTS} slots; all {results} results came")
    print(f"  back in {elapsed:.2f} s ({TASKS / elapsed:,.0f} round trips/s).")
    print(
        f"  the {urgent_total} urgent tasks (priority 0) were interleaved with the bulk ones "
        f"(priority 9) yet all started among the first {last_urgent + 1}: "
        f"{'yes' if urgent_first else 'NO'}"
    )
    if not urgent_first:
        raise SystemExit("priority order was not respected")


if __name__ == "__main__":
    trio.run(main, "memory://")
