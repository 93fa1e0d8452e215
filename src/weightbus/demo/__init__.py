"""``weightbus demo``: a supervisor that runs the fully-async RL loop as separate processes and checks it.

Every child is a command a user could launch alone; every process it starts is stopped by pid on any exit, and its
temporary directory removed. Why: docs/rl-loop.md.
"""

from __future__ import annotations

from weightbus.demo.config import FAULTS, DemoConfig
from weightbus.demo.supervisor import run_demo

__all__ = ["FAULTS", "DemoConfig", "run_demo"]
