"""What ``weightbus engine`` serves: one typed config object, from the command's flags or a JSON file.

Each setting is declared once, as a field; ``weightbus engine``'s flags are derived from the fields
(``weightbus.cli.config_flags``). The API key is not a field (``--api-key`` or ``WEIGHTBUS_API_KEY`` only), so it
never lands in a file.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

__all__ = ["EngineConfig"]


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One reference engine (each field declared once: its description is its flag's help)."""

    port: Annotated[int, Meta(ge=1, le=65535, description="HTTP port (SGLang's default is 30000).")] = 30000
    host: Annotated[str, Meta(description="Interface to bind.")] = "127.0.0.1"
    model: Annotated[
        Literal["hash", "torch", "policy"],
        Meta(
            description="hash: pure-Python; torch: tiny torch LM; policy: the RL loop's WindowLM (safetensors, "
            "sampling)."
        ),
    ] = "hash"
    seed: Annotated[int, Meta(description="Initial weights of the policy model (as the trainer's).")] = 0
    sampling_seed: Annotated[int, Meta(description="Seed of the policy model's sampler.")] = 0
    weight_version: Annotated[str, Meta(description="Boot weight_version label, as SGLang's --weight-version.")] = (
        "default"
    )
    token_delay: Annotated[float, Meta(ge=0, description="Seconds per generated token.")] = 0.01
