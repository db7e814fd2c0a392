"""The durable engine: workflows as code, checkpointed steps, retries, durable timers,
deterministic replay, run stores.

::

    app = dt.App("shop")

    @app.step("charge-card", retry=dt.Retry(max_attempts=5))
    async def charge(order: dict) -> dict: ...

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, order: dict) -> dict:
        receipt = await ctx.step("charge-card", order)
        await ctx.sleep(10)
        return {"receipt": receipt}

    async with dt.open_worker(app, backend), dt.open_engine(app, backend) as engine:
        run_id = await engine.start("order", {"id": 1})
        outcome = await engine.result(run_id)

Layers (imports go down): ``_app`` / ``_retry`` / ``_records`` / ``_errors`` -> ``_stores`` ->
``_replay`` / ``_context`` -> ``_services`` (what drivers get from the engine) -> ``_runtime``
(runs driven here), ``_turn`` (a remote workflow's turn, on a workflow worker) ->
``_remote_run`` (remote runs, driven turn by turn) -> ``_results`` (result application),
``_timers`` (the periodic loops), ``_control`` (the control plane of tenant pods) -> ``_engine``
(the public facade, with ``_options``, ``_statistics``) -> ``_open`` (builds the pieces),
``_worker``, ``_tenant`` (a pod's client) -> ``cli``.
"""

from __future__ import annotations

from ._app import App, StepDefinition, WorkflowDefinition
from ._audit import StepLost
from ._children import ChildDepthExceeded, ChildFailed
from ._context import StepHandle, StepInfo, WorkflowContext, step_info
from ._duplicates import DuplicateResult
from ._engine import Engine
from ._errors import (
    EngineClosed,
    EngineError,
    NonDeterminismError,
    RunCancelled,
    RunFailed,
    RunNotFound,
    RunNotRetryable,
    RunTimedOut,
    StepFailed,
    UnknownWorkflow,
)
from ._open import open_engine
from ._options import EngineOptions
from ._records import (
    Applied,
    RunPage,
    RunRecord,
    RunState,
    RunStatus,
    StepKind,
    StepRecord,
    StepState,
)
from ._retry import Retry
from ._signals import EventTimeout, RunNotSignalable, SignalDataError, SignalTimeout
from ._statistics import EngineStatistics
from ._step_timeouts import StepTimeouts, UnknownStep
from ._step_watch import StepNotStarted, StepWait
from ._stores import RunStore, open_run_store
from ._tenant import RunView, TenantClient, open_tenant_client
from ._worker import Worker, WorkerStatistics, open_worker

__all__ = [
    "App",
    "Applied",
    "ChildDepthExceeded",
    "ChildFailed",
    "DuplicateResult",
    "Engine",
    "EngineClosed",
    "EngineError",
    "EngineOptions",
    "EngineStatistics",
    "EventTimeout",
    "NonDeterminismError",
    "Retry",
    "RunCancelled",
    "RunFailed",
    "RunNotFound",
    "RunNotRetryable",
    "RunNotSignalable",
    "RunPage",
    "RunRecord",
    "RunState",
    "RunStatus",
    "RunStore",
    "RunTimedOut",
    "RunView",
    "SignalDataError",
    "SignalTimeout",
    "StepDefinition",
    "StepFailed",
    "StepHandle",
    "StepInfo",
    "StepKind",
    "StepLost",
    "StepNotStarted",
    "StepRecord",
    "StepState",
    "StepTimeouts",
    "StepWait",
    "TenantClient",
    "UnknownStep",
    "UnknownWorkflow",
    "Worker",
    "WorkerStatistics",
    "WorkflowContext",
    "WorkflowDefinition",
    "open_engine",
    "open_run_store",
    "open_tenant_client",
    "open_worker",
    "step_info",
]
