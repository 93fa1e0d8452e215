"""The fully-async RL loop: a task, a torch policy of the engine's architecture, a GRPO-style trainer and a rollout.

Importing this package pulls in nothing heavy; torch is imported by ``weightbus.rl.policy`` and the trainer only.
Modules: ``task`` (prompts, tokenizer, reward; pluggable), ``batches`` (request/reply over NATS, chunked),
``rollout`` (the rollout process), ``policy`` and ``trainer`` (the trainer process).
"""

from __future__ import annotations

__all__: list[str] = []
