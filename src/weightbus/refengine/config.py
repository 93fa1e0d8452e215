"""What ``weightbus engine`` serves: one typed config object, from the command's flags or a JSON file.

The API key is not a field (``--api-key`` or ``WEIGHTBUS_API_KEY`` only), so it never lands in a file.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

__all__ = ["EngineConfig"]


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One reference engine."""

    port: Annotated[int, Meta(ge=1, le=65535)] = 30000
    """HTTP port (SGLang's default is 30000)."""
    host: str = "127.0.0.1"
    """Interface to bind."""
    model: Literal["hash", "torch", "policy"] = "hash"
    """hash: pure-Python; torch: tiny torch LM; policy: the RL loop's WindowLM (safetensors, sampling)."""
    seed: int = 0
    """Initial weights of the policy model (as the trainer's)."""
    sampling_seed: int = 0
    """Seed of the policy model's sampler."""
    weight_version: str = "default"
    """Boot ``weight_version`` label, as SGLang's ``--weight-version``."""
    token_delay: Annotated[float, Meta(ge=0)] = 0.01
    """Seconds per generated token."""
