"""Async HTTP client for one SGLang 0.5.23 engine: weight pushes, version stamps, pause/continue, generate.

Each method sends a fixed set of keys (``wire``, pinned by tests); every failure is an ``EngineError`` (URL, status,
server message): httpx errors are translated here only (the keep-alive client raises ``EngineTransportError``,
an ``EngineError``, itself). It speaks through an
``httpx.AsyncClient`` or a ``KeepAliveHttp`` (what a fleet built from URLs uses); one passed in is borrowed, never
closed.
See docs/engines.md#the-sglang-client.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, TypeVar

import httpx
import msgspec

from weightbus.engines._http import Reply, httpx_request, normalize_url, server_message
from weightbus.engines.keepalive import KeepAliveHttp
from weightbus.engines.wire import (
    AbortReq,
    ContinueGenerationReq,
    FinishReason,
    GenerateMetaInfo,
    GenerateOutput,
    GenerateReq,
    LoadLoraAdapterReq,
    LoraResult,
    ModelInfo,
    PauseAck,
    PauseGenerationReq,
    PauseMode,
    Selector,
    UnloadLoraAdapterReq,
    UpdateResult,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDistributedReq,
    UpdateWeightsFromTensorReq,
    UpdateWeightVersionReq,
    VersionAck,
    WeightVersionSpan,
)
from weightbus.errors import EngineError

# The response types are re-exported so that ``weightbus.engines.sglang`` is a complete client surface.
__all__ = [
    "FinishReason",
    "GenerateMetaInfo",
    "GenerateOutput",
    "LoraResult",
    "ModelInfo",
    "PauseMode",
    "SGLangClient",
    "Selector",
    "UpdateResult",
    "WeightVersionSpan",
]

_T = TypeVar("_T")


class SGLangClient:
    """Async client for one SGLang engine (a worker, not a router: routers do not forward weight routes).

    Args:
        url: the engine's base URL, e.g. ``http://10.0.0.5:30000``; a missing scheme means ``http``.
        http: an ``httpx.AsyncClient`` to borrow, or a ``KeepAliveHttp`` for this same URL (the lean client
            ``EngineFleet`` gives each engine); neither is closed by :meth:`aclose`.
        api_key: sent as ``Authorization: Bearer <api_key>`` (the server's ``--api-key`` or ``--admin-api-key``).
        timeout: seconds per request when this client creates its own ``httpx.AsyncClient``.

    Raises:
        ValueError: ``url`` is empty or malformed (not http/https, no host, a bad port), or ``http`` is a
            ``KeepAliveHttp`` for another URL.
    """

    def __init__(
        self,
        url: str,
        *,
        http: httpx.AsyncClient | KeepAliveHttp | None = None,
        api_key: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.url = normalize_url(url)
        if isinstance(http, KeepAliveHttp) and http.url != self.url:
            raise ValueError(f"a KeepAliveHttp for {http.url} cannot serve the engine {self.url}")
        self._owns_http = http is None
        self._http = http if http is not None else httpx.AsyncClient(timeout=timeout)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def __repr__(self) -> str:
        return f"SGLangClient({self.url!r})"

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP client if this object created it."""
        if self._owns_http:
            await self._http.aclose()

    # --- transport -------------------------------------------------------------------------------------------

    async def _send(
        self,
        method: str,
        path: str,
        body: msgspec.Struct | None = None,
        *,
        params: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> Reply:
        headers = dict(self._headers)
        content = None
        if body is not None:
            content = msgspec.json.encode(body)
            headers["Content-Type"] = "application/json"
        response: Reply
        if isinstance(self._http, KeepAliveHttp):
            # Its failures are typed already (EngineTransportError); a closed client is the caller's error.
            response = await self._http.request(
                method, path, content=content, headers=headers, params=params, timeout=timeout
            )
        else:
            extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
            response = await httpx_request(
                self._http, self.url, method, path, content=content, headers=headers, params=params, **extra
            )
        if not response.is_success:
            raise EngineError(self.url, response.status_code, server_message(response))
        return response

    def _decode(self, response: Reply, path: str, type_: type[_T]) -> _T:
        try:
            return msgspec.json.decode(response.content, type=type_)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise EngineError(self.url, response.status_code, f"unexpected response body from {path}: {exc}") from exc

    async def _call(self, method: str, path: str, body: msgspec.Struct | None, type_: type[_T]) -> _T:
        response = await self._send(method, path, body)
        result = self._decode(response, path, type_)
        # sglang answers failed updates with 400, but a 200 carrying success=false must not pass silently.
        if getattr(result, "success", True) is False:
            message = getattr(result, "message", None) or getattr(result, "error_message", None) or "success=false"
            raise EngineError(self.url, response.status_code, message)
        return result

    # --- generation control ----------------------------------------------------------------------------------

    async def pause_generation(self, mode: PauseMode = "retract") -> None:
        """Pause the scheduler. Always sends a JSON body, which 0.5.23 requires and older servers accept.

        Args:
            mode: ``abort`` returns running requests aborted; ``retract`` requeues them (their KV cache may be
                flushed); ``in_place`` keeps them and their KV cache. SGLang's own default is ``abort``; this
                client defaults to ``retract`` as miles does.

        Raises:
            EngineError: the engine refused or did not answer.
        """
        await self._call("POST", "/pause_generation", PauseGenerationReq(mode=mode), PauseAck)

    async def continue_generation(self) -> None:
        """Resume a paused scheduler; sends ``{}``.

        Raises:
            EngineError: the engine refused or did not answer.
        """
        await self._call("POST", "/continue_generation", ContinueGenerationReq(), PauseAck)

    async def abort_request(self, rid: str, *, message: str | None = None) -> None:
        """Abort the in-flight ``/generate`` request ``rid`` (the ``rid`` it was sent with).

        Sends SGLang 0.5.23's ``AbortReq`` as ``{"rid": rid, "abort_all": false, "abort_message": message}``.
        The aborted ``/generate`` returns with ``meta_info.finish_reason.type == "abort"``; a ``rid`` the engine
        does not hold (finished, or never sent to this engine) is not an error: the server ignores it.

        Raises:
            ValueError: ``rid`` is empty.
            EngineError: the engine refused or did not answer.
        """
        if not rid:
            raise ValueError("abort_request needs a non-empty rid")
        await self._send("POST", "/abort_request", AbortReq(rid=rid, abort_all=False, abort_message=message))

    async def abort_all_requests(self, *, message: str | None = None) -> None:
        """Abort every in-flight ``/generate`` request on this engine (``{"rid": null, "abort_all": true}``).

        Raises:
            EngineError: the engine refused or did not answer.
        """
        await self._send("POST", "/abort_request", AbortReq(rid=None, abort_all=True, abort_message=message))

    # --- weight version --------------------------------------------------------------------------------------

    async def update_weight_version(self, version: int | str, *, abort_all_requests: bool = False) -> str:
        """Relabel the engine's weights as ``version`` without loading anything.

        Args:
            version: the new label; integers are sent as their decimal string.
            abort_all_requests: sent explicitly because the server's default is ``True``, which aborts every
                in-flight generation.

        Returns:
            The ``new_version`` the server reports (``str(version)`` if it omitted it).

        Raises:
            EngineError: the engine refused, answered ``success: false``, or did not answer.
        """
        new_version = str(version)
        body = UpdateWeightVersionReq(new_version=new_version, abort_all_requests=abort_all_requests)
        ack = await self._call("POST", "/update_weight_version", body, VersionAck)
        return ack.new_version if ack.new_version is not None else new_version

    async def model_info(self) -> ModelInfo:
        """``GET /model_info``, falling back to the deprecated ``/get_model_info`` on a 404 (older servers).

        Raises:
            EngineError: the engine failed, did not answer, or sent no ``weight_version``.
        """
        try:
            response = await self._send("GET", "/model_info")
            path = "/model_info"
        except EngineError as exc:
            if exc.status != 404:
                raise
            response = await self._send("GET", "/get_model_info")
            path = "/get_model_info"
        return self._decode(response, path, ModelInfo)

    async def weight_version(self) -> str:
        """The engine's live ``weight_version`` label, read from ``/model_info``.

        Raises:
            EngineError: as :meth:`model_info`.
        """
        return (await self.model_info()).weight_version

    # --- weight updates --------------------------------------------------------------------------------------

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: int | str | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> UpdateResult:
        """Load new weights from a checkpoint path visible to the engine.

        Args:
            model_path: a path or hub id the engine can read.
            weight_version: the label to apply; the server applies it only if the load succeeds.
            load_format: the server's load format (``None`` = the server's default).
            flush_cache: flush the KV/radix cache after loading.
            abort_all_requests: abort in-flight generations before loading.

        Raises:
            EngineError: the load failed (the server's message says why) or the engine did not answer.
        """
        body = UpdateWeightsFromDiskReq(
            model_path=model_path,
            load_format=load_format,
            abort_all_requests=abort_all_requests,
            weight_version=None if weight_version is None else str(weight_version),
            flush_cache=flush_cache,
        )
        return await self._call("POST", "/update_weights_from_disk", body, UpdateResult)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        *,
        weight_version: int | str | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        selector: Selector = "all",
    ) -> UpdateResult:
        """Load weights from serialized tensor handles, one string per TP rank (same host only in SGLang).

        Args:
            serialized_named_tensors: base64 payloads; SGLang expects ``MultiprocessingSerializer`` handles.
            weight_version: the label to apply on success.
            load_format: e.g. ``flattened_bucket``; ``None`` = the server's default.
            flush_cache: flush the KV/radix cache after loading.
            abort_all_requests: abort in-flight generations before loading.
            selector: which model receives the weights: ``target``, ``draft`` or ``all``.

        Raises:
            EngineError: the load failed or the engine did not answer.
        """
        body = UpdateWeightsFromTensorReq(
            serialized_named_tensors=list(serialized_named_tensors),
            load_format=load_format,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
            weight_version=None if weight_version is None else str(weight_version),
            selector=selector,
        )
        return await self._call("POST", "/update_weights_from_tensor", body, UpdateResult)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str = "weight_update_group",
        weight_version: int | str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        load_format: str | None = None,
        selector: Selector = "all",
    ) -> UpdateResult:
        """Announce a broadcast of named tensors over an initialised NCCL group; the tensors follow out of band.

        Args:
            names: parameter names, in broadcast order.
            dtypes: torch dtype names (``bfloat16``), one per name.
            shapes: tensor shapes, one per name.
            group_name: the group set up by ``/init_weights_update_group``.
            weight_version: the label to apply on success.
            flush_cache: flush the KV/radix cache after loading.
            abort_all_requests: abort in-flight generations before loading.
            load_format: ``None`` = the server's default.
            selector: ``target``, ``draft`` or ``all``.

        Raises:
            ValueError: ``names``, ``dtypes`` and ``shapes`` differ in length.
            EngineError: the update failed or the engine did not answer.
        """
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
        body = UpdateWeightsFromDistributedReq(
            names=list(names),
            dtypes=list(dtypes),
            shapes=[list(shape) for shape in shapes],
            group_name=group_name,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
            weight_version=None if weight_version is None else str(weight_version),
            load_format=load_format,
            selector=selector,
        )
        return await self._call("POST", "/update_weights_from_distributed", body, UpdateResult)

    # --- LoRA ------------------------------------------------------------------------------------------------

    async def load_lora_adapter(self, lora_name: str, lora_path: str, *, pinned: bool = False) -> LoraResult:
        """Load a LoRA adapter under ``lora_name``. This never changes ``weight_version``: stamp it yourself.

        Raises:
            EngineError: e.g. ``LoRA with name X already exists`` (HTTP 400).
        """
        body = LoadLoraAdapterReq(lora_name=lora_name, lora_path=lora_path, pinned=pinned)
        return await self._call("POST", "/load_lora_adapter", body, LoraResult)

    async def unload_lora_adapter(self, lora_name: str) -> LoraResult:
        """Unload the LoRA adapter ``lora_name``. This never changes ``weight_version``.

        Raises:
            EngineError: the adapter is not loaded, or the engine did not answer.
        """
        return await self._call("POST", "/unload_lora_adapter", UnloadLoraAdapterReq(lora_name=lora_name), LoraResult)

    # --- cache and generation --------------------------------------------------------------------------------

    async def flush_cache(self, *, timeout: float | None = None) -> str:
        """Flush the radix/KV cache; the server answers ``text/plain``.

        Args:
            timeout: sent as ``?timeout=<s>``: how long the server waits for running requests to drain
                (``None`` = the server's default, 0). The HTTP timeout is extended to match.

        Returns:
            The server's text, e.g. ``Cache flushed.``.

        Raises:
            EngineError: HTTP 400 while requests are running or waiting, or no answer.
        """
        params = None if timeout is None else {"timeout": repr(float(timeout))}
        http_timeout = None
        if timeout is not None:
            base = self._http.timeout if isinstance(self._http, KeepAliveHttp) else self._http.timeout.read
            http_timeout = None if base is None else base + float(timeout)
        response = await self._send("POST", "/flush_cache", params=params, timeout=http_timeout)
        return response.text

    async def generate(
        self,
        *,
        input_ids: list[int] | None = None,
        text: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        lora_path: str | None = None,
        rid: str | None = None,
    ) -> GenerateOutput:
        """One non-streaming ``/generate`` call.

        Args:
            input_ids: the prompt as token ids (exactly one of ``input_ids`` and ``text``).
            text: the prompt as text.
            sampling_params: e.g. ``{"max_new_tokens": 16, "temperature": 0}``; sent as ``{}`` if ``None``.
            lora_path: the *name* of a loaded LoRA adapter.
            rid: a request id, usable with ``/abort_request``.

        Raises:
            ValueError: both or neither of ``input_ids`` and ``text``.
            EngineError: the engine refused or did not answer.
        """
        if (input_ids is None) == (text is None):
            raise ValueError("pass exactly one of input_ids and text")
        body = GenerateReq(
            text=text,
            input_ids=None if input_ids is None else list(input_ids),
            sampling_params=dict(sampling_params or {}),
            stream=False,
            lora_path=lora_path,
            rid=rid,
        )
        response = await self._send("POST", "/generate", body)
        return self._decode(response, "/generate", GenerateOutput)
