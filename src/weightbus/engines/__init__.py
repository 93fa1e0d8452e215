"""SGLang engines: an async HTTP client per engine and worker discovery behind a router.

It imports only httpx and msgspec; the CPU reference engine is ``weightbus.refengine``.
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
