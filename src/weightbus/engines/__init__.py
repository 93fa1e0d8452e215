"""SGLang engines: an async client per engine, the lean HTTP/1.1 client a fleet gives it, and worker discovery.

It imports only httpx, msgspec and the standard library; the CPU reference engine is ``weightbus.refengine``.
"""

from __future__ import annotations

from weightbus.engines._http import httpx_request
from weightbus.engines.keepalive import HttpReply, KeepAliveHttp
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
    "HttpReply",
    "KeepAliveHttp",
    "LoraResult",
    "ModelInfo",
    "PauseMode",
    "SGLangClient",
    "UpdateResult",
    "WeightVersionSpan",
    "discover_workers",
    "httpx_request",
]
