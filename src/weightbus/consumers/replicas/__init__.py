"""The replica view fed live (``ReplicaFollower``) and its convergence metrics (``ConvergenceMetrics``).

The view itself is the pure rule ``rules.replicas``; this package only subscribes, folds and measures.
"""

from weightbus.consumers.replicas.follower import ReplicaFollower, read_replicas
from weightbus.consumers.replicas.metrics import (
    CONVERGENCE_BUCKETS,
    ConvergenceMetrics,
    PolicyConvergenceMetrics,
    share_label,
)

__all__ = [
    "CONVERGENCE_BUCKETS",
    "ConvergenceMetrics",
    "PolicyConvergenceMetrics",
    "ReplicaFollower",
    "read_replicas",
    "share_label",
]
