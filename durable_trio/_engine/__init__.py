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

Layers, bottom up: a module imports only modules of its own layer or of the layers below it
(``tests/test_engine_layers.py`` checks it, and that every module of the package is named here):

1. values: ``_records`` (runs, steps), ``_errors``, ``_retry``, ``_stored_retry`` (a
   checkpoint's retry policy), ``_duplicates``,
   ``_duplicate_result`` (one duplicate explained),
   ``_statistics``, ``_counters`` (the names of its counters), ``_snapshots`` (those
   values and a duplicate's, by name, on first use), ``_wall_clock``,
   ``_step_timeouts``, ``_options``, ``_replay`` (a run's history, consumed in call order),
   ``_debounce`` (debounce and dedup keys),
   ``_tags`` (a run's tags, checked), ``_rate`` (a step's rate limit),
   ``_payloads`` (typed payloads: the cattrs converter), ``_generations`` (continue-as-new's
   values)
2. stores: ``_stores`` (the run store: ``_contract``, ``memory``, ``sqlite``, ``redis``,
   ``_paging``, ``_shard_paging``, ``_wakes``)
3. store operations: ``_new_run`` (recording a run), ``_reopen`` (an operator's retry),
   ``_schedule_overlap`` (schedules' overlap policies), ``_schedule_defs`` (a schedule's
   definition), ``_schedules``,
   ``_debounced`` (starting the debounced runs due)
4. workflow code: ``_context`` (what a workflow sees), ``_app`` (the registry),
   ``_versioning`` (blocked runs)
5. services: ``_drivers`` (the registry of the engine's drivers, their one owner), ``_waits``
   (the owners of the steps waited on, the results being applied, the decision locks),
   ``_services`` (what the drivers get from the engine), ``_advert`` (the engine's key in the
   key store: the workflows it runs)
6. a run's pieces: ``_cancel``, ``_children``, ``_signals``, ``_heartbeats``, ``_deadline``,
   and the engine's loops: ``_step_watch``, ``_audit`` (the loss audit), ``_timers`` (leases,
   reconcile, the store watch), ``_control`` (the control plane of tenant pods),
   ``_retention`` (deleting finished runs past their retention), ``_stream`` (a run's stream:
   emits appended, ``engine.stream`` read), ``_updates`` (a run's updates: ``ctx.on_update``,
   ``engine.update``), ``_update_desk`` (when a run's updates begin to be served)
7. drivers: ``_runtime`` (a run driven here), ``_continue`` (continue-as-new), ``_remote_run``
   (a remote run, driven turn by turn), ``_turn`` (a remote workflow's turn, on a workflow
   worker), ``_adoption`` (taking over runs nobody drives), ``_cancel_delivery``, ``_results``
   (result application)
8. facades: ``_engine`` (the public API), ``_tree`` (the engine's nurseries and its close),
   ``_open`` (``open_engine``), ``_worker`` (``open_worker``), ``_tenant`` (a pod's client)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_getattr

if TYPE_CHECKING:  # the real imports, for type checkers; at run time: _EXPORTS
    from ._app import App, StepDefinition, WorkflowDefinition
    from ._audit import StepLost
    from ._children import ChildDepthExceeded, ChildFailed
    from ._context import StepHandle, StepInfo, WorkflowContext, step_info
    from ._debounce import Debounce
    from ._duplicate_result import DuplicateResult
    from ._engine import Engine
    from ._errors import (
        EngineClosed,
        EngineError,
        NonDeterminismError,
        RunCancelled,
        RunDataError,
        RunFailed,
        RunNotFound,
        RunNotRetryable,
        RunTimedOut,
        StepFailed,
        StreamError,
        StreamFull,
        StreamValueTooLarge,
        UnknownWorkflow,
        UpdateError,
        UpdateFailed,
        UpdateRejected,
        UpdateTimeout,
    )
    from ._open import open_engine
    from ._options import EngineOptions
    from ._payloads import PayloadTypeError, payload_converter
    from ._rate import Rate
    from ._records import (
        Applied,
        DamagedRun,
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
    from ._statistics import EngineStatistics, WorkerStatistics
    from ._step_timeouts import StepTimeouts, UnknownStep
    from ._step_watch import StepNotStarted, StepWait
    from ._stores import RunStore, open_run_store
    from ._stream import StreamEntry
    from ._tenant import RunView, TenantClient, open_tenant_client
    from ._worker import Worker, open_worker

#: Each public name -> its module, imported on first use (PEP 562): a process that only
#: needs a store or the records does not load the engine's drivers and loops.
_EXPORTS: dict[str, str] = {
    "App": "._app",
    "StepDefinition": "._app",
    "WorkflowDefinition": "._app",
    "StepLost": "._audit",
    "ChildDepthExceeded": "._children",
    "ChildFailed": "._children",
    "StepHandle": "._context",
    "StepInfo": "._context",
    "WorkflowContext": "._context",
    "step_info": "._context",
    "Debounce": "._debounce",
    "Rate": "._rate",
    "PayloadTypeError": "._payloads",
    "payload_converter": "._payloads",
    "DuplicateResult": "._duplicate_result",
    "Engine": "._engine",
    "EngineClosed": "._errors",
    "EngineError": "._errors",
    "NonDeterminismError": "._errors",
    "RunCancelled": "._errors",
    "RunDataError": "._errors",
    "RunFailed": "._errors",
    "RunNotFound": "._errors",
    "RunNotRetryable": "._errors",
    "RunTimedOut": "._errors",
    "StepFailed": "._errors",
    "UnknownWorkflow": "._errors",
    "UpdateError": "._errors",
    "UpdateFailed": "._errors",
    "UpdateRejected": "._errors",
    "UpdateTimeout": "._errors",
    "open_engine": "._open",
    "EngineOptions": "._options",
    "Applied": "._records",
    "DamagedRun": "._records",
    "RunPage": "._records",
    "RunRecord": "._records",
    "RunState": "._records",
    "RunStatus": "._records",
    "StepKind": "._records",
    "StepRecord": "._records",
    "StepState": "._records",
    "Retry": "._retry",
    "EventTimeout": "._signals",
    "RunNotSignalable": "._signals",
    "SignalDataError": "._signals",
    "SignalTimeout": "._signals",
    "EngineStatistics": "._statistics",
    "StepTimeouts": "._step_timeouts",
    "UnknownStep": "._step_timeouts",
    "StepNotStarted": "._step_watch",
    "StepWait": "._step_watch",
    "StreamEntry": "._stream",
    "StreamError": "._errors",
    "StreamFull": "._errors",
    "StreamValueTooLarge": "._errors",
    "RunStore": "._stores",
    "open_run_store": "._stores",
    "RunView": "._tenant",
    "TenantClient": "._tenant",
    "open_tenant_client": "._tenant",
    "Worker": "._worker",
    "WorkerStatistics": "._statistics",
    "open_worker": "._worker",
}


# Hidden from type checkers: with a module __getattr__ in sight, mypy would accept any
# name (a typo included) as an attribute of the package.
if not TYPE_CHECKING:
    __getattr__ = lazy_getattr(globals(), _EXPORTS)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "App",
    "Applied",
    "ChildDepthExceeded",
    "ChildFailed",
    "DamagedRun",
    "Debounce",
    "DuplicateResult",
    "Engine",
    "EngineClosed",
    "EngineError",
    "EngineOptions",
    "EngineStatistics",
    "EventTimeout",
    "NonDeterminismError",
    "PayloadTypeError",
    "Rate",
    "Retry",
    "RunCancelled",
    "RunDataError",
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
    "StreamEntry",
    "StreamError",
    "StreamFull",
    "StreamValueTooLarge",
    "TenantClient",
    "UnknownStep",
    "UnknownWorkflow",
    "UpdateError",
    "UpdateFailed",
    "UpdateRejected",
    "UpdateTimeout",
    "Worker",
    "WorkerStatistics",
    "WorkflowContext",
    "WorkflowDefinition",
    "open_engine",
    "open_run_store",
    "open_tenant_client",
    "open_worker",
    "payload_converter",
    "step_info",
]
