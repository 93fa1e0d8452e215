"""weightbus: tells asynchronous RL rollouts how stale their data is.

Trainers publish ``WeightUpdated`` after each engine push over NATS JetStream; rollout consumers
follow the current version in memory and a staleness stage keeps, recycles or drops drained groups.
"""

import logging

__version__ = "0.1.0"

# Quiet by default: the library never configures logging; applications (and the CLI) do.
logging.getLogger("weightbus").addHandler(logging.NullHandler())

__all__ = ["__version__"]
