"""weightbus: tells asynchronous RL rollouts how stale their data is.

Trainers announce each engine push over NATS JetStream; rollouts follow the current version and judge drained groups.
"""

import logging

__version__ = "0.1.0"

# Quiet by default: the library never configures logging; applications (and the CLI) do.
logging.getLogger("weightbus").addHandler(logging.NullHandler())

__all__ = ["__version__"]
