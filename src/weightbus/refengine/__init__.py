"""The CPU reference engine: a strict stand-in for an SGLang 0.5.23 server, for tests, the demo and the RL loop.

Importing it pulls in nothing heavy: ``reference``, ``serve``, ``tiny_model`` and ``policy_model`` are imported apart.
"""

from __future__ import annotations

__all__: list[str] = []
