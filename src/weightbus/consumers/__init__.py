"""The rollout side: the version follower (``tracker/``), the drain (``drain/``), the admission gate (``admission/``),
the replica view fed live (``replicas/``).

The four do not import each other; ``monitor`` is the operators' view. ``judge_groups`` is the entry point for hosts
with their own buffer, ``FullyAsyncBuffer`` the drop-in for miles' fully-async data buffer.
"""

from weightbus.consumers.admission import AcceptedGroups, Admission, SharedBudget, Slot
from weightbus.consumers.drain import (
    STALENESS_BUCKETS,
    Action,
    CurrentSource,
    Decision,
    Drain,
    DrainMetrics,
    DrainReporter,
    DrainStats,
    FullyAsyncBuffer,
    Judgement,
    OnStale,
    StalenessMetrics,
    StalenessStage,
    buffer_capacity,
    judge_groups,
    resolve_current,
    to_drain_report,
)
from weightbus.consumers.replicas import ConvergenceMetrics, ReplicaFollower
from weightbus.consumers.tracker import LAG_BUCKETS, PolicyTrackerMetrics, TrackerMetrics, VersionChange, VersionTracker
from weightbus.rules.chain import RegressionMode, TrackerAction, TrackerDecision, TrackerState
from weightbus.rules.staleness import (
    GroupVersions,
    Reason,
    UnknownPolicy,
    Verdict,
    group_versions,
    judge,
    staleness,
)

__all__ = [
    "LAG_BUCKETS",
    "STALENESS_BUCKETS",
    "AcceptedGroups",
    "Action",
    "Admission",
    "ConvergenceMetrics",
    "CurrentSource",
    "Decision",
    "Drain",
    "DrainMetrics",
    "DrainReporter",
    "DrainStats",
    "FullyAsyncBuffer",
    "GroupVersions",
    "Judgement",
    "OnStale",
    "PolicyTrackerMetrics",
    "Reason",
    "RegressionMode",
    "ReplicaFollower",
    "SharedBudget",
    "Slot",
    "StalenessMetrics",
    "StalenessStage",
    "TrackerAction",
    "TrackerDecision",
    "TrackerMetrics",
    "TrackerState",
    "UnknownPolicy",
    "Verdict",
    "VersionChange",
    "VersionTracker",
    "buffer_capacity",
    "group_versions",
    "judge",
    "judge_groups",
    "resolve_current",
    "staleness",
    "to_drain_report",
]
