"""A hello-step round trip: an engine dispatches a task, a worker runs it, the result comes back."""

from __future__ import annotations

import uuid

import trio

import durable_trio as dt


async def main(backend_url: str) -> None:
    # A fresh namespace per run: what an interrupted earlier run left in a reused file stays out.
    namespace = f"hello-{uuid.uuid4().hex[:8]}"
    async with dt.open_backend(backend_url) as backend:
        # The worker side: serves the step "greet".
        async with dt.open_queue_transport(backend, namespace=namespace) as worker:

            async def greet(task: dt.RemoteTask) -> str:
                return f"hello, {task.input['name']}!"

            worker.handle("greet", greet)

            # The engine side: dispatches a task and waits for its result.
            async with dt.open_queue_transport(backend, namespace=namespace) as engine:
                answer: list[dt.StepResult] = []
                arrived = trio.Event()

                async def on_result(result: dt.StepResult) -> None:
                    answer.append(result)
                    arrived.set()

                engine.on_result(on_result)
                task = dt.RemoteTask(
                    run_id="run-1",
                    step_id="greet-1",
                    attempt=1,
                    name="greet",
                    input={"name": "Trio"},
                )
                start = trio.current_time()
                await engine.dispatch(task)
                with trio.fail_after(10):
                    await arrived.wait()
                elapsed_ms = (trio.current_time() - start) * 1000
    (result,) = answer
    print(f"  dispatched step 'greet' for run {task.run_id}; a worker ran it and answered:")
    print(f"  {result.status.value}: {result.output!r} ({elapsed_ms:.1f} ms round trip)")


if __name__ == "__main__":
    trio.run(main, "memory://")
