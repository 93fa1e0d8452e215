"""weightbus: tells asynchronous RL rollouts how stale their data is.

Trainers publish ``WeightUpdated`` after each engine push over NATS JetStream; rollout consumers
follow the current version in memory and a staleness stage keeps, recycles or drops drained groups.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
