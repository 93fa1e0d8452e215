"""The CPU reference engine: a strict stand-in for an SGLang 0.5.23 server, for tests, the demo and the RL loop.

Importing this package pulls in nothing heavy. Its modules are imported explicitly by those who need them:
``reference`` (the Starlette app, needs starlette), ``engine_state`` (state and generation loop), ``serve``
(uvicorn runner), ``model`` (the shared vocabulary and the pure-Python hash model), ``tiny_model`` and
``policy_model`` (torch models; ``policy_model`` is the architecture the RL trainer trains).
"""

from __future__ import annotations

__all__: list[str] = []
