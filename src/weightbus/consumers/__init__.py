"""Rollout-side consumers: the staleness rule, the staleness stage, the fully-async buffer,
their Prometheus metrics and drain reports.

``judge_groups`` is the one-call entry point for host frameworks with their own buffer;
``FullyAsyncBuffer`` is the drop-in for miles' fully-async data buffer.
"""

from weightbus.consumers.buffer import CurrentSource, Drain, FullyAsyncBuffer, buffer_capacity, resolve_current
from weightbus.consumers.metrics import STALENESS_BUCKETS, DrainMetrics, StalenessMetrics
from weightbus.consumers.reports import DrainReporter, to_drain_report
from weightbus.consumers.stage import Action, Decision, DrainStats, Judgement, OnStale, StalenessStage, judge_groups
from weightbus.consumers.staleness import (
    GroupVersions,
    Reason,
    UnknownPolicy,
    Verdict,
    group_versions,
    judge,
    min_fresh_version,
    staleness,
)
from weightbus.consumers.tracker import VersionChange, VersionTracker
from weightbus.consumers.tracker_metrics import LAG_BUCKETS, PolicyTrackerMetrics, TrackerMetrics
from weightbus.consumers.tracker_state import RegressionMode, TrackerAction, TrackerDecision, TrackerState

__all__ = [
    "LAG_BUCKETS",
    "STALENESS_BUCKETS",
    "Action",
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
    "min_fresh_version",
    "resolve_current",
    "staleness",
    "to_drain_report",
]
