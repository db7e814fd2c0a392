"""durable_trio: durable execution for Trio.

Workflows whose steps survive crashes, carried between engine and worker processes by a queue
transport over a pluggable broker (in-memory, SQLite, Redis).
"""

from __future__ import annotations

from ._adaptive import Adaptive
from ._backend import Backend, open_backend
from ._codec import json_schema
from ._errors import (
    BrokerError,
    BrokerUnavailable,
    ConfigError,
    DurableTrioError,
    JobError,
    LeaseLost,
    PayloadError,
    PayloadTooLarge,
    TransportClosed,
)
from ._liveness import GroupHealth, LiveWorker, WorkerDescriptor
from ._options import TransportOptions
from ._transport import QueueTransport, TransportStatistics, open_queue_transport
from ._wire import (
    ControlMessage,
    DecisionStatus,
    InboxRegistration,
    JobKind,
    JSONValue,
    RemoteTask,
    RunReply,
    RunRequest,
    StartRunMessage,
    StepError,
    StepEvent,
    StepEventKind,
    StepHeartbeat,
    StepResult,
    StepStatus,
    TenantEvent,
    WorkerStatus,
    WorkflowDecision,
    WorkflowTask,
)

__version__ = "0.1.0"

__all__ = [
    "Adaptive",
    "Backend",
    "BrokerError",
    "BrokerUnavailable",
    "ConfigError",
    "ControlMessage",
    "DecisionStatus",
    "DurableTrioError",
    "GroupHealth",
    "InboxRegistration",
    "JSONValue",
    "JobError",
    "JobKind",
    "LeaseLost",
    "LiveWorker",
    "PayloadError",
    "PayloadTooLarge",
    "QueueTransport",
    "RemoteTask",
    "RunReply",
    "RunRequest",
    "StartRunMessage",
    "StepError",
    "StepEvent",
    "StepEventKind",
    "StepHeartbeat",
    "StepResult",
    "StepStatus",
    "TenantEvent",
    "TransportClosed",
    "TransportOptions",
    "TransportStatistics",
    "WorkerDescriptor",
    "WorkerStatus",
    "WorkflowDecision",
    "WorkflowTask",
    "json_schema",
    "open_backend",
    "open_queue_transport",
]
