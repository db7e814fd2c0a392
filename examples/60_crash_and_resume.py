"""Crash and resume: the engine process is SIGKILLed mid-run and restarted; no done step reruns.

The worker lives in this process; the engine runs in a child process started with
``sys.executable``, killed with SIGKILL once two steps are checkpointed, then started again under
the same engine id. The run completes, and every step ran exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from urllib.parse import urlsplit

import trio

import durable_trio as dt
from durable_trio import (
    App,
    StepState,
    WorkflowContext,
    open_engine,
    open_run_store,
    open_worker,
    step_info,
)

STEPS = 6
STEP_SECONDS = 0.25
KILL_AFTER = 2  # completed steps

app = App("crash-demo")

#: Step executions by idempotency key. The worker lives in THIS process, which is never killed,
#: so the count is exact.
EXECUTIONS: Counter[str] = Counter()


@app.step("work")
async def work(n: int) -> int:
    EXECUTIONS[step_info().idempotency_key] += 1
    await trio.sleep(STEP_SECONDS)
    return n * n


@app.workflow("pipeline")
async def pipeline(ctx: WorkflowContext, steps: int) -> list[int]:
    return [await ctx.step("work", n) for n in range(steps)]


# ---------------------------------------------------------------------------- the engine process


async def engine_process(
    url: str, namespace: str, engine_id: str, run_id: str, start: bool
) -> None:
    """What the child process runs: an engine (no worker) that drives the run to its end."""
    async with dt.open_backend(url) as backend:
        async with open_engine(
            app,
            backend,
            namespace=namespace,
            engine_id=engine_id,  # the same id after the restart: it takes its run back at once
            # A result the killed engine had claimed comes back after this (default 120 s).
            stalled_threshold=2.0,
            stalled_check_interval=0.5,
        ) as engine:
            if start:
                await engine.start("pipeline", STEPS, run_id=run_id)
            resumed = engine.statistics().runs_resumed
            output = await engine.result(run_id)
            stats = engine.statistics()
    print(
        json.dumps(
            {
                "output": output,
                "resumed": resumed,
                "redispatched": stats.redispatched,
                "duplicates": stats.duplicate_results,
            }
        )
    )


def _engine_command(namespace: str, engine_id: str, run_id: str, start: bool) -> list[str]:
    # The backend URL goes through the environment, not the command line: it may hold a
    # password, and a command line is visible to every user (ps) and quoted in errors.
    return [sys.executable, __file__, "engine", namespace, engine_id, run_id, str(int(start))]


def _engine_env(url: str) -> dict[str, str]:
    return {**os.environ, "DURABLE_TRIO_BACKEND": url}


# ---------------------------------------------------------------------------- the demo


async def main(backend_url: str) -> None:
    if urlsplit(backend_url).scheme == "memory":
        print("  skipped: a memory:// backend dies with the process; killing the engine process")
        print("  needs a backend shared by processes (run it on sqlite:///... or redis://...)")
        return
    namespace = f"crash-{uuid.uuid4().hex[:8]}"
    run_id = f"{namespace}-run"
    engine_id = f"{namespace}-engine"
    EXECUTIONS.clear()
    async with (
        dt.open_backend(backend_url) as backend,
        open_run_store(backend, namespace) as store,
    ):
        async with open_worker(app, backend, namespace=namespace, concurrency=4):
            # 1. An engine process starts the run.
            first = await trio.lowlevel.open_process(
                _engine_command(namespace, engine_id, run_id, True),
                env=_engine_env(backend_url),
                stdout=subprocess.DEVNULL,
            )
            with trio.fail_after(30):
                while True:
                    history = await store.get_steps(run_id)
                    done = [s.step_id for s in history if s.status is StepState.COMPLETED]
                    if len(done) >= KILL_AFTER:
                        break
                    await trio.sleep(0.02)
            # 2. Killed mid-run: no close, no release, nothing flushed.
            first.kill()
            await first.wait()
            history = await store.get_steps(run_id)
            completed = {s.step_id for s in history if s.status is StepState.COMPLETED}
            print(
                f"  engine process {first.pid} SIGKILLed with {len(completed)} of {STEPS} steps "
                f"checkpointed (steps {', '.join(sorted(completed, key=int))})"
            )
            # 3. Started again under the same engine id: it takes the run back and finishes it.
            with trio.fail_after(60):
                second = await trio.run_process(
                    _engine_command(namespace, engine_id, run_id, False),
                    env=_engine_env(backend_url),
                    capture_stdout=True,
                )
            report = json.loads(second.stdout.decode().strip().splitlines()[-1])
    print(f"  restarted engine resumed {report['resumed']} run; result: {report['output']}")
    rerun_completed = sum(EXECUTIONS[f"{run_id}:{step_id}"] - 1 for step_id in completed)
    in_flight_resent = report["redispatched"]
    print(f"  step executions: {sum(EXECUTIONS.values())} for {STEPS} steps")
    print(f"  re-run completed steps: {rerun_completed}")
    if in_flight_resent:
        print("  (steps in flight whose dispatch the killed engine never confirmed, re-sent:")
        print(f"   {in_flight_resent} — at-least-once, covered by their idempotency keys)")
    if report["output"] != [n * n for n in range(STEPS)] or rerun_completed:
        raise SystemExit("the run did not resume as it should")


if __name__ == "__main__":
    if sys.argv[1:2] == ["engine"]:
        namespace, engine_id, run_id, start = sys.argv[2:6]
        url = os.environ["DURABLE_TRIO_BACKEND"]
        trio.run(engine_process, url, namespace, engine_id, run_id, start == "1")
    else:
        trio.run(main, sys.argv[1] if len(sys.argv) > 1 else "sqlite:///.durable/demo.db")
