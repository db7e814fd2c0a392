"""Queue brokers: the contract (:mod:`._contract`) and its interchangeable implementations."""

from __future__ import annotations

from ._contract import (
    ClaimedJob,
    FailedJob,
    Job,
    Lease,
    QuarantinedEntry,
    QueueBroker,
    Recovery,
    RenewOutcome,
    Stall,
    SupportsBatchFinalize,
    SupportsBatchPop,
    SupportsClaimAhead,
    SupportsFailedJobs,
    SupportsQuarantine,
    SupportsRecovery,
    SupportsRenewal,
    SupportsSize,
    SupportsSweepHint,
    SupportsWakeup,
)

__all__ = [
    "ClaimedJob",
    "FailedJob",
    "Job",
    "Lease",
    "QuarantinedEntry",
    "QueueBroker",
    "Recovery",
    "RenewOutcome",
    "Stall",
    "SupportsBatchFinalize",
    "SupportsBatchPop",
    "SupportsClaimAhead",
    "SupportsFailedJobs",
    "SupportsQuarantine",
    "SupportsRecovery",
    "SupportsRenewal",
    "SupportsSize",
    "SupportsSweepHint",
    "SupportsWakeup",
]
