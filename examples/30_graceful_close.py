"""A graceful close: a closing worker hands long jobs back at once; a second one finishes them."""

from __future__ import annotations

import uuid

import trio

import durable_trio as dt


async def main(backend_url: str) -> None:
    # A fresh namespace per run: what an interrupted earlier run left in a reused file stays out.
    namespace = f"graceful-{uuid.uuid4().hex[:8]}"
    async with dt.open_backend(backend_url) as backend:
        finished_by: dict[str, str] = {}
        done = trio.Event()

        async with dt.open_queue_transport(backend, namespace=namespace) as engine:

            async def on_result(result: dt.StepResult) -> None:
                finished_by[result.step_id] = result.output
                if len(finished_by) == 3:
                    done.set()

            engine.on_result(on_result)
            for n, seconds in enumerate([0.1, 5.0, 5.0]):
                await engine.dispatch(
                    dt.RemoteTask(
                        run_id="report",
                        step_id=f"chunk-{n}",
                        attempt=1,
                        name="crunch",
                        input=seconds,
                    )
                )

            # Worker A takes all three, then is asked to stop with a 0.5 s close budget.
            async with dt.open_queue_transport(
                backend, namespace=namespace, concurrency=3, close_timeout=0.5
            ) as worker_a:
                started = trio.Event()

                async def crunch_a(task: dt.RemoteTask) -> str:
                    if task.step_id == "chunk-2":
                        started.set()
                    await trio.sleep(task.input)
                    return "worker A"

                worker_a.handle("crunch", crunch_a)
                with trio.fail_after(10):
                    await started.wait()
                close_started = trio.current_time()
            close_took = trio.current_time() - close_started
            print(
                f"  worker A closed in {close_took:.2f} s (budget 0.5 s): the short job finished,"
            )
            print(
                "  the two 5-second jobs were cancelled and handed back for immediate redelivery."
            )

            # Worker B starts and finishes the handed-back jobs right away (no stall wait).
            async with dt.open_queue_transport(
                backend, namespace=namespace, concurrency=3
            ) as worker_b:

                async def crunch_b(task: dt.RemoteTask) -> str:
                    await trio.sleep(0.2)  # worker B is faster
                    return "worker B"

                worker_b.handle("crunch", crunch_b)
                with trio.fail_after(10):
                    await done.wait()
    for step_id, who in sorted(finished_by.items()):
        print(f"  {step_id}: finished by {who}")
    if sorted(finished_by.values()) != ["worker A", "worker B", "worker B"]:
        raise SystemExit("the handback did not go as expected")


if __name__ == "__main__":
    trio.run(main, "memory://")
