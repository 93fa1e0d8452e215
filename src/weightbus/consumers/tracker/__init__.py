"""The version follower: a ``VersionTracker`` holds a policy's current version from the bus.

It applies ``rules.chain.decide`` to every weights event, alerts what it refuses and exports metrics; no groups here.
"""

from weightbus.consumers.tracker.changes import VersionChange
from weightbus.consumers.tracker.heap import freeze_startup_heap
from weightbus.consumers.tracker.metrics import LAG_BUCKETS, PolicyTrackerMetrics, TrackerMetrics
from weightbus.consumers.tracker.tracker import TrackerStatus, VersionTracker

__all__ = [
    "LAG_BUCKETS",
    "PolicyTrackerMetrics",
    "TrackerMetrics",
    "TrackerStatus",
    "VersionChange",
    "VersionTracker",
    "freeze_startup_heap",
]
