"""The replica view fed live (``ReplicaFollower``), its convergence metrics, and version-constrained requests.

The view itself is the pure rule ``rules.replicas``; this package only subscribes, folds, measures and picks
(``VersionRouter``: an engine the view knows serves a version a request allows).
"""

from weightbus.consumers.replicas.follower import ReplicaFollower, read_replicas
from weightbus.consumers.replicas.metrics import (
    CONVERGENCE_BUCKETS,
    VERSION_BUCKETS,
    ConvergenceMetrics,
    PolicyConvergenceMetrics,
    PolicyRequestMetrics,
    RequestMetrics,
    share_label,
)
from weightbus.consumers.replicas.route import PickedEngine, VersionConstraint, VersionRouter

__all__ = [
    "CONVERGENCE_BUCKETS",
    "VERSION_BUCKETS",
    "ConvergenceMetrics",
    "PickedEngine",
    "PolicyConvergenceMetrics",
    "PolicyRequestMetrics",
    "ReplicaFollower",
    "RequestMetrics",
    "VersionConstraint",
    "VersionRouter",
    "read_replicas",
    "share_label",
]
