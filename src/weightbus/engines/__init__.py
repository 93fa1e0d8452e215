"""SGLang engines: an async HTTP client per engine and worker discovery behind a router.

Importing this package pulls in only httpx and msgspec. The CPU reference engine that serves this API in tests,
the demo and the RL loop lives in its own package, ``weightbus.refengine``.
"""

from __future__ import annotations

from weightbus.engines.router import discover_workers
from weightbus.engines.sglang import SGLangClient
from weightbus.engines.wire import (
    FinishReason,
    GenerateMetaInfo,
    GenerateOutput,
    LoraResult,
    ModelInfo,
    PauseMode,
    UpdateResult,
    WeightVersionSpan,
)

__all__ = [
    "FinishReason",
    "GenerateMetaInfo",
    "GenerateOutput",
    "LoraResult",
    "ModelInfo",
    "PauseMode",
    "SGLangClient",
    "UpdateResult",
    "WeightVersionSpan",
    "discover_workers",
]
