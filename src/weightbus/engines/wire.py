"""SGLang 0.5.23's HTTP shapes as msgspec Structs: the request bodies the client sends and the responses it reads.

Requests carry only the keys the client sends; responses ignore unknown keys and require only what weightbus reads.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "AbortReq",
    "ContinueGenerationReq",
    "FinishReason",
    "GenerateMetaInfo",
    "GenerateOutput",
    "GenerateReq",
    "LoadLoraAdapterReq",
    "LoraResult",
    "ModelInfo",
    "PauseAck",
    "PauseGenerationReq",
    "PauseMode",
    "Selector",
    "UnloadLoraAdapterReq",
    "UpdateResult",
    "UpdateWeightVersionReq",
    "UpdateWeightsFromDiskReq",
    "UpdateWeightsFromDistributedReq",
    "UpdateWeightsFromTensorReq",
    "VersionAck",
    "WeightVersionSpan",
]

PauseMode = Literal["abort", "retract", "in_place"]
Selector = Literal["target", "draft", "all"]


# --- Request bodies (client → engine): io_struct field order, no defaults, so every key is sent explicitly. ---


class PauseGenerationReq(msgspec.Struct, frozen=True):
    """``POST /pause_generation``; 0.5.23 requires this JSON body (mode defaults to ``abort`` server-side)."""

    mode: str


class ContinueGenerationReq(msgspec.Struct, frozen=True):
    """Sent as ``{}``: 0.5.23 requires a JSON body, and older servers accept an empty object."""


class UpdateWeightVersionReq(msgspec.Struct, frozen=True):
    """``POST /update_weight_version``; ``abort_all_requests`` is always sent (the server defaults it to true)."""

    new_version: str
    abort_all_requests: bool


class UpdateWeightsFromDiskReq(msgspec.Struct, frozen=True):
    """``POST /update_weights_from_disk``: the keys the client controls; the server defaults the rest."""

    model_path: str
    load_format: str | None
    abort_all_requests: bool
    weight_version: str | None
    flush_cache: bool


class UpdateWeightsFromTensorReq(msgspec.Struct, frozen=True):
    """``POST /update_weights_from_tensor``: the keys the client controls; the server defaults the rest."""

    serialized_named_tensors: list[str]
    load_format: str | None
    flush_cache: bool
    abort_all_requests: bool
    weight_version: str | None
    selector: str


class UpdateWeightsFromDistributedReq(msgspec.Struct, frozen=True):
    """``POST /update_weights_from_distributed``: the keys the client controls; the server defaults the rest."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str
    flush_cache: bool
    abort_all_requests: bool
    weight_version: str | None
    load_format: str | None
    selector: str


class LoadLoraAdapterReq(msgspec.Struct, frozen=True):
    """``POST /load_lora_adapter``. It has no ``weight_version``: LoRA loads never change it."""

    lora_name: str
    lora_path: str
    pinned: bool


class UnloadLoraAdapterReq(msgspec.Struct, frozen=True):
    """``POST /unload_lora_adapter``."""

    lora_name: str


class AbortReq(msgspec.Struct, frozen=True):
    """``POST /abort_request`` (SGLang's ``AbortReq``): one request by the ``rid`` it was generated with, or all.

    The server's other keys (``finished_reason``, ``weight_versions``) stay at their defaults.
    """

    rid: str | None
    abort_all: bool
    abort_message: str | None


class GenerateReq(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """``POST /generate``, non-streaming; unset optional keys are left off the wire."""

    # omit_defaults: only the prompt field in use, and lora_path/rid when given, go on the wire.
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any]
    stream: bool
    lora_path: str | None = None
    rid: str | None = None


# --- Responses (engine → client). Unknown keys are ignored so newer servers still decode. ---------------------


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The body of ``GET /model_info``. Only ``weight_version`` is required; the rest vary by server."""

    weight_version: str
    model_path: str | None = None
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    is_generation: bool | None = None
    preferred_sampling_params: Any = None
    load_format: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    disaggregation_mode: str | None = None
    has_image_understanding: bool | None = None
    has_audio_understanding: bool | None = None
    model_type: str | None = None
    architectures: list[str] | None = None


class UpdateResult(msgspec.Struct, frozen=True, kw_only=True):
    """The body of a successful ``/update_weights_from_*`` call."""

    success: bool
    message: str = ""
    num_paused_requests: int | None = None


class LoraResult(msgspec.Struct, frozen=True, kw_only=True):
    """The body of a successful ``/load_lora_adapter`` or ``/unload_lora_adapter`` call.

    ``loaded_adapters`` maps adapter name to its path (or a server-side ``LoRARef`` object).
    """

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, Any] = msgspec.field(default_factory=dict)


class WeightVersionSpan(msgspec.Struct, frozen=True):
    """Output tokens ``[start, end)`` of one request were generated under weight ``version``."""

    version: str
    start: int
    end: int


class FinishReason(msgspec.Struct, frozen=True, kw_only=True):
    """Why generation stopped: ``type`` is ``stop``, ``length`` or ``abort``."""

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None


class GenerateMetaInfo(msgspec.Struct, frozen=True, kw_only=True):
    """``meta_info`` of a ``/generate`` output.

    ``weight_version`` is the engine's version when the output was built; when the version changed during the
    request, ``weight_versions`` lists the per-token spans and ``weight_version`` equals the last span's.
    """

    id: str
    weight_version: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    num_retractions: int = 0
    weight_versions: list[WeightVersionSpan] | None = None


class GenerateOutput(msgspec.Struct, frozen=True, kw_only=True):
    """The body of a non-streaming ``/generate`` call."""

    text: str
    output_ids: list[int] = msgspec.field(default_factory=list)
    meta_info: GenerateMetaInfo


class PauseAck(msgspec.Struct, frozen=True):
    """The answer to ``/pause_generation`` and ``/continue_generation``."""

    message: str = ""
    status: str = ""


class VersionAck(msgspec.Struct, frozen=True):
    """The answer to ``/update_weight_version``."""

    success: bool
    message: str = ""
    new_version: str | None = None
