"""The fully-async RL loop: a task, a torch policy of the engine's architecture, a GRPO-style trainer and a rollout.

Importing it pulls in nothing heavy; torch is imported by ``policy`` and the trainer only.
"""

from __future__ import annotations

__all__: list[str] = []
