"""The CPU reference engine: a Starlette app that answers like SGLang 0.5.23 on the weight and generate routes.

It is strict where 0.5.23 is strict, so client bugs show up in tests rather than on a GPU fleet.
See docs/engines.md#the-reference-engine.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from weightbus.refengine.engine_state import EngineState, InFlightRequest, LoraAdapter, RecordedRequest
from weightbus.refengine.model import decode, encode

__all__ = ["EngineState", "InFlightRequest", "LoraAdapter", "RecordedRequest", "create_app"]

_T = TypeVar("_T")

# sglang's default when sampling_params has no max_new_tokens.
_DEFAULT_MAX_NEW_TOKENS = 128


# --- request bodies (fields and defaults as in sglang 0.5.23 io_struct; unknown keys are ignored) -------------


class _PauseBody(msgspec.Struct, frozen=True):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class _ContinueBody(msgspec.Struct, frozen=True):
    torch_empty_cache: bool = True


class _UpdateWeightVersionBody(msgspec.Struct, frozen=True):
    new_version: str
    abort_all_requests: bool = True


class _FromDiskBody(msgspec.Struct, frozen=True):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: Any = None


class _FromTensorBody(msgspec.Struct, frozen=True):
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class _FromDistributedBody(msgspec.Struct, frozen=True):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class _LoadLoraBody(msgspec.Struct, frozen=True):
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


class _UnloadLoraBody(msgspec.Struct, frozen=True):
    lora_name: str
    lora_id: str | None = None


class _AbortBody(msgspec.Struct, frozen=True):
    # sglang's AbortReq: the rid a /generate was sent with (None: none), abort_all, and the message the
    # aborted request's finish_reason carries; finished_reason and weight_versions are accepted, unused.
    rid: str | None = None
    abort_all: bool = False
    abort_message: str | None = None


class _SamplingParams(msgspec.Struct, frozen=True):
    max_new_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    # sglang's default; models without a distribution (hash, tiny torch) stay greedy.
    temperature: float = 1.0


class _GenerateBody(msgspec.Struct, frozen=True):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: _SamplingParams | None = None
    stream: bool = False
    lora_path: str | None = None
    rid: str | None = None
    return_logprob: bool = False


class _BadRequest(Exception):
    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


def _json(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def _parse(raw: bytes, type_: type[_T]) -> _T:
    if not raw.strip():
        raise _BadRequest("a JSON request body is required")
    try:
        return msgspec.json.decode(raw, type=type_)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _BadRequest(f"invalid request body: {exc}") from exc


# --- health and model info -------------------------------------------------------------------------------------------


async def _health(state: EngineState, request: Request, raw: bytes) -> Response:
    return Response(status_code=200)


async def _model_info(state: EngineState, request: Request, raw: bytes) -> Response:
    return _json(
        {
            "model_path": state.model_path,
            "served_model_name": state.served_model_name,
            "tokenizer_path": state.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": state.weight_version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "weightbus-reference",
            "architectures": [state.model.architecture],
        }
    )


# --- generation control: pause, continue, relabel, flush, abort ------------------------------------------------------


async def _pause_generation(state: EngineState, request: Request, raw: bytes) -> Response:
    await state.pause(_parse(raw, _PauseBody).mode)
    return _json({"message": "Generation paused successfully.", "status": "ok"})


async def _continue_generation(state: EngineState, request: Request, raw: bytes) -> Response:
    _parse(raw, _ContinueBody)
    await state.resume()
    return _json({"message": "Generation continued successfully.", "status": "ok"})


async def _update_weight_version(state: EngineState, request: Request, raw: bytes) -> Response:
    body = _parse(raw, _UpdateWeightVersionBody)
    if body.abort_all_requests:
        await state.abort_all("Abort all requests due to update_weight_version")
    if not state.ignore_version_updates:
        state.weight_version = body.new_version
    message = f"Weight version updated to {body.new_version}"
    return _json({"success": True, "message": message, "new_version": body.new_version})


async def _flush_cache(state: EngineState, request: Request, raw: bytes) -> Response:
    try:
        timeout = float(request.query_params.get("timeout", "0"))
    except ValueError as exc:
        raise _BadRequest(f"timeout must be a number: {exc}") from exc
    deadline = time.monotonic() + timeout
    # SGLang's /flush_cache waits the same way; in_flight has no wakeup of its own to wait on.
    while state.in_flight and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    if state.in_flight:
        message = f"Cache not flushed: {len(state.in_flight)} requests are running or waiting.\n"
        return PlainTextResponse(message, status_code=400)
    return PlainTextResponse("Cache flushed.\n")


async def _abort_request(state: EngineState, request: Request, raw: bytes) -> Response:
    body = _parse(raw, _AbortBody)
    if body.abort_all:
        await state.abort_all(body.abort_message or "Abort all requests")
    elif body.rid:
        # An unknown or finished rid is ignored, as sglang does.
        await state.abort(body.rid, body.abort_message or "Abort request")
    return Response(status_code=200)


# --- weight updates and LoRA adapters (a failed load keeps the old weights and label) --------------------------------


async def _apply_update(
    state: EngineState, abort_all_requests: bool, weight_version: str | None, load: Callable[[], None]
) -> tuple[bool, str]:
    if abort_all_requests:
        await state.abort_all("Abort all requests due to a weight update")
    if state.weight_update_delay > 0:
        await asyncio.sleep(state.weight_update_delay)
    if state.fail_weight_updates is not None:
        return False, state.fail_weight_updates
    try:
        load()
    except ValueError as exc:
        return False, f"Failed to update weights: {exc}. The old weights are kept."
    if weight_version is not None and not state.ignore_version_updates:
        state.weight_version = weight_version
    return True, "Succeeded to update model weights."


def _parked(state: EngineState) -> int:
    return sum(1 for request in state.in_flight.values() if request.parked)


async def _update_weights_from_disk(state: EngineState, request: Request, raw: bytes) -> Response:
    body = _parse(raw, _FromDiskBody)
    ok, message = await _apply_update(
        state,
        body.abort_all_requests,
        body.weight_version,
        lambda: state.model.load_from_disk(body.model_path, body.load_format),
    )
    if ok:
        state.model_path = body.model_path
    return _json({"success": ok, "message": message, "num_paused_requests": _parked(state)}, 200 if ok else 400)


async def _update_weights_from_tensor(state: EngineState, request: Request, raw: bytes) -> Response:
    body = _parse(raw, _FromTensorBody)
    if body.selector == "draft":
        raise _BadRequest("the reference engine has no draft model")
    ok, message = await _apply_update(
        state,
        body.abort_all_requests,
        body.weight_version,
        lambda: state.model.load_from_tensors(body.serialized_named_tensors, body.load_format),
    )
    return _json({"success": ok, "message": message}, 200 if ok else 400)


async def _update_weights_from_distributed(state: EngineState, request: Request, raw: bytes) -> Response:
    body = _parse(raw, _FromDistributedBody)
    if not len(body.names) == len(body.dtypes) == len(body.shapes):
        raise _BadRequest("names, dtypes and shapes must have the same length")
    if body.selector == "draft":
        raise _BadRequest("the reference engine has no draft model")
    ok, message = await _apply_update(
        state,
        body.abort_all_requests,
        body.weight_version,
        lambda: state.model.load_from_distributed(body.names, body.dtypes, body.shapes),
    )
    return _json({"success": ok, "message": message}, 200 if ok else 400)


def _lora_result(state: EngineState, error: str | None) -> Response:
    adapters = {name: adapter.path for name, adapter in state.lora_adapters.items()}
    body = {"success": error is None, "error_message": error, "loaded_adapters": adapters}
    return _json(body, 200 if error is None else 400)


async def _load_lora_adapter(state: EngineState, request: Request, raw: bytes) -> Response:
    body = _parse(raw, _LoadLoraBody)
    if body.lora_name in state.lora_adapters:
        return _lora_result(state, f"LoRA with name {body.lora_name} already exists")
    state.lora_adapters[body.lora_name] = LoraAdapter(body.lora_path, body.pinned)
    return _lora_result(state, None)


async def _unload_lora_adapter(state: EngineState, request: Request, raw: bytes) -> Response:
    body = _parse(raw, _UnloadLoraBody)
    if state.lora_adapters.pop(body.lora_name, None) is None:
        return _lora_result(state, f"LoRA adapter {body.lora_name} is not loaded")
    return _lora_result(state, None)


# --- generation ------------------------------------------------------------------------------------------------------


async def _generate(state: EngineState, request: Request, raw: bytes) -> Response:
    body = _parse(raw, _GenerateBody)
    if body.stream:
        raise _BadRequest("the reference engine does not stream; send stream=false")
    if (body.text is None) == (body.input_ids is None):
        raise _BadRequest("exactly one of text and input_ids is required")
    prompt = encode(body.text) if body.text is not None else list(body.input_ids or [])
    if any(not 0 <= token < state.model.vocab_size for token in prompt):
        raise _BadRequest(f"input_ids must be in [0, {state.model.vocab_size})")
    params = body.sampling_params or _SamplingParams()
    max_new_tokens = _DEFAULT_MAX_NEW_TOKENS if params.max_new_tokens is None else params.max_new_tokens
    if max_new_tokens < 0:
        raise _BadRequest("max_new_tokens must be >= 0")
    adapter = None
    if body.lora_path is not None:
        if body.lora_path not in state.lora_adapters:
            raise _BadRequest(f"LoRA adapter {body.lora_path} is not loaded")
        adapter = state.lora_adapters[body.lora_path].path
    job = InFlightRequest(body.rid or uuid.uuid4().hex, prompt)
    try:
        finish = await state.generate(
            job, max_new_tokens, set(params.stop_token_ids or ()), adapter, max(0.0, params.temperature)
        )
    except ValueError as exc:
        raise _BadRequest(str(exc)) from exc
    version, spans = state.output_version(job)
    meta: dict[str, Any] = {
        "id": job.rid,
        "finish_reason": finish,
        "prompt_tokens": len(prompt),
        "weight_version": version,
        "num_retractions": job.num_retractions,
        "completion_tokens": len(job.output_ids),
        "cached_tokens": 0,
        "reasoning_tokens": 0,
    }
    if spans is not None:
        meta["weight_versions"] = spans
    if body.return_logprob:
        # sglang's shape without return_text_in_logprobs: [logprob, token_id, null] per output token.
        pairs = zip(job.logprobs, job.output_ids, strict=True)
        meta["output_token_logprobs"] = [[logprob, token, None] for logprob, token in pairs]
    return _json({"text": decode(job.output_ids), "output_ids": job.output_ids, "meta_info": meta})


_Endpoint = Callable[[EngineState, Request, bytes], Awaitable[Response]]

#: Each group's routes: (path, endpoint, methods).
_INFO_ROUTES: list[tuple[str, _Endpoint, list[str]]] = [
    ("/health", _health, ["GET"]),
    ("/model_info", _model_info, ["GET"]),
    ("/get_model_info", _model_info, ["GET"]),
]
_CONTROL_ROUTES: list[tuple[str, _Endpoint, list[str]]] = [
    ("/pause_generation", _pause_generation, ["POST"]),
    ("/continue_generation", _continue_generation, ["POST"]),
    ("/update_weight_version", _update_weight_version, ["POST"]),
    ("/flush_cache", _flush_cache, ["GET", "POST"]),
    ("/abort_request", _abort_request, ["POST"]),
]
_WEIGHTS_ROUTES: list[tuple[str, _Endpoint, list[str]]] = [
    ("/update_weights_from_disk", _update_weights_from_disk, ["POST"]),
    ("/update_weights_from_tensor", _update_weights_from_tensor, ["POST"]),
    ("/update_weights_from_distributed", _update_weights_from_distributed, ["POST"]),
    ("/load_lora_adapter", _load_lora_adapter, ["POST"]),
    ("/unload_lora_adapter", _unload_lora_adapter, ["POST"]),
]
_GENERATE_ROUTES: list[tuple[str, _Endpoint, list[str]]] = [
    ("/generate", _generate, ["POST", "PUT"]),
]


def _route(state: EngineState, path: str, endpoint: _Endpoint, methods: list[str]) -> Route:
    """``endpoint`` behind what every route shares: the request record, Bearer auth, 400 on a bad body."""

    async def handle(request: Request) -> Response:
        raw = await request.body()
        try:
            body: Any = msgspec.json.decode(raw) if raw.strip() else None
        except msgspec.DecodeError:
            body = raw.decode("utf-8", "replace")
        state.requests.append(RecordedRequest(request.method, path, dict(request.query_params), body))
        if state.api_key is not None and path != "/health":
            if request.headers.get("authorization") != f"Bearer {state.api_key}":
                return _json({"error": "Unauthorized"}, 401)
        try:
            return await endpoint(state, request, raw)
        except _BadRequest as exc:
            return _json({"success": False, "message": exc.message}, 400)

    return Route(path, handle, methods=methods)


def create_app(state: EngineState) -> Starlette:
    """A Starlette app serving ``state`` with SGLang 0.5.23's HTTP shapes (see the module docstring)."""
    groups = (_INFO_ROUTES, _CONTROL_ROUTES, _WEIGHTS_ROUTES, _GENERATE_ROUTES)
    return Starlette(routes=[_route(state, *entry) for group in groups for entry in group])
