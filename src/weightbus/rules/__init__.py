"""The rules both sides share, as pure functions: no I/O, no clock, no bus.

They import only ``weightbus.schemas`` and ``weightbus.errors``.
"""

from weightbus.rules.abort import certain_stale, oldest_bound
from weightbus.rules.chain import RegressionMode, TrackerAction, TrackerDecision, TrackerState, WeightsEvent, decide
from weightbus.rules.history import RejectedEvent, StoredEvent, WeightsHistory, fold_history
from weightbus.rules.marks import MarkJudge, UnexplainedMark, chain_seen, mark_explained, unexplained_mark_alert_id
from weightbus.rules.replicas import (
    DEFAULT_SHARES,
    Activation,
    Convergence,
    EngineReplica,
    ReplicaEvent,
    ReplicaView,
    VersionRollout,
    fold_replicas,
    newly_activated,
    newly_converged,
    observe,
)
from weightbus.rules.staleness import (
    UNKNOWN_POLICIES,
    GroupVersions,
    Reason,
    UnknownPolicy,
    Verdict,
    group_versions,
    judge,
    raw_scan,
    scan_group,
    staleness,
)
from weightbus.rules.standing import outranks, owner_claim, owner_standing

__all__ = [
    "DEFAULT_SHARES",
    "UNKNOWN_POLICIES",
    "Activation",
    "Convergence",
    "EngineReplica",
    "GroupVersions",
    "MarkJudge",
    "Reason",
    "RegressionMode",
    "RejectedEvent",
    "ReplicaEvent",
    "ReplicaView",
    "StoredEvent",
    "TrackerAction",
    "TrackerDecision",
    "TrackerState",
    "UnexplainedMark",
    "UnknownPolicy",
    "Verdict",
    "VersionRollout",
    "WeightsEvent",
    "WeightsHistory",
    "certain_stale",
    "chain_seen",
    "decide",
    "fold_history",
    "fold_replicas",
    "group_versions",
    "judge",
    "mark_explained",
    "newly_activated",
    "newly_converged",
    "observe",
    "oldest_bound",
    "outranks",
    "owner_claim",
    "owner_standing",
    "raw_scan",
    "scan_group",
    "staleness",
    "unexplained_mark_alert_id",
]
