"""The reference engine's mutable state and its token-by-token generation loop; no HTTP here.

``weight_version`` is read once per token (a relabel starts a span); an abort records the version of that moment.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from weightbus.engines.wire import PauseMode
from weightbus.refengine.model import EngineModel, HashModel

__all__ = ["EngineState", "InFlightRequest", "LoraAdapter", "RecordedRequest", "version_spans"]


class RecordedRequest(msgspec.Struct, frozen=True):
    """One request as the engine received it. ``body`` is the parsed JSON, the raw text, or ``None`` if empty."""

    method: str
    path: str
    query: dict[str, str]
    body: Any


class LoraAdapter(msgspec.Struct, frozen=True):
    """A loaded LoRA adapter."""

    path: str
    pinned: bool = False


class InFlightRequest:
    """A ``/generate`` request being served; readable by tests to synchronise with generation.

    Attributes:
        rid: the request id.
        prompt: the prompt token ids.
        output_ids: tokens generated so far.
        logprobs: the logprob of each output token under the weights that generated it (0.0 for a model without
            a distribution, such as the hash model).
        versions: the weight version each output token was generated under.
        parked: the request is waiting for ``/continue_generation``.
        num_retractions: how often a ``retract`` pause requeued it.
        abort_message: why it was aborted, or ``None``.
        abort_version: the engine's version when it was aborted, or ``None``.
    """

    def __init__(self, rid: str, prompt: list[int]) -> None:
        self.rid = rid
        self.prompt = prompt
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[str] = []
        self.parked = False
        self.num_retractions = 0
        self.abort_message: str | None = None
        self.abort_version: str | None = None


def version_spans(versions: list[str]) -> list[dict[str, Any]]:
    """Compress per-token versions into ``[{"version", "start", "end"}]`` spans (token indices, end exclusive)."""
    spans: list[dict[str, Any]] = []
    for index, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = index + 1
        else:
            spans.append({"version": version, "start": index, "end": index + 1})
    return spans


class EngineState:
    """Everything a reference engine knows, plus fault-injection knobs for tests.

    Args:
        model: the LM; a fresh :class:`~weightbus.refengine.model.HashModel` if ``None``.
        weight_version: the boot label (SGLang's ``--weight-version``, default ``"default"``).
        model_path: reported by ``/model_info`` until a disk load replaces it; the model's name if ``None``.
        served_model_name: reported by ``/model_info``; ``model_path`` if ``None``.
        api_key: when set, every route but ``/health`` requires ``Authorization: Bearer <api_key>``.
        token_delay: seconds to sleep after each generated token (0 still yields to the event loop).
        ignore_version_updates: fault injection: ``/update_weight_version`` and the ``weight_version`` of weight
            updates answer success but leave the version unchanged (an engine that ignores the stamp).
        fail_weight_updates: fault injection: when set, every ``/update_weights_*`` fails with 400 and this
            message, leaving weights and version unchanged.
        weight_update_delay: fault injection: seconds every ``/update_weights_*`` takes before it applies (a
            slow load, so a test can act while one is in flight).

    Attributes:
        requests: every request received, oldest first (see :meth:`recorded`).
        in_flight: the ``/generate`` requests being served, by request id.
        lora_adapters: loaded adapters by name.
        pause_mode: the active pause mode, or ``None`` while generating.
    """

    def __init__(
        self,
        *,
        model: EngineModel | None = None,
        weight_version: str = "default",
        model_path: str | None = None,
        served_model_name: str | None = None,
        api_key: str | None = None,
        token_delay: float = 0.0,
        ignore_version_updates: bool = False,
        fail_weight_updates: str | None = None,
        weight_update_delay: float = 0.0,
    ) -> None:
        self.model: EngineModel = model if model is not None else HashModel()
        self.weight_version = weight_version
        self.model_path = model_path or self.model.name
        self.served_model_name = served_model_name or self.model_path
        self.api_key = api_key
        self.token_delay = token_delay
        self.ignore_version_updates = ignore_version_updates
        self.fail_weight_updates = fail_weight_updates
        self.weight_update_delay = weight_update_delay
        self.lora_adapters: dict[str, LoraAdapter] = {}
        self.pause_mode: PauseMode | None = None
        self.in_flight: dict[str, InFlightRequest] = {}
        self.requests: list[RecordedRequest] = []
        self._condition: asyncio.Condition | None = None
        self._condition_loop: asyncio.AbstractEventLoop | None = None

    def recorded(self, path: str) -> list[RecordedRequest]:
        """The recorded requests to ``path``, oldest first."""
        return [request for request in self.requests if request.path == path]

    def _wakeup(self) -> asyncio.Condition:
        # A Condition binds to the loop that first uses it; a state may outlive one loop (tests reuse states).
        loop = asyncio.get_running_loop()
        if self._condition is None or self._condition_loop is not loop:
            self._condition = asyncio.Condition()
            self._condition_loop = loop
        return self._condition

    async def _notify(self) -> None:
        condition = self._wakeup()
        async with condition:
            condition.notify_all()

    async def pause(self, mode: PauseMode) -> None:
        """Park generation; ``abort`` mode also aborts every in-flight request."""
        self.pause_mode = mode
        if mode == "abort":
            await self.abort_all("Abort due to pause_generation")

    async def resume(self) -> None:
        """End a pause; parked requests continue with whatever weights and version are current now."""
        self.pause_mode = None
        await self._notify()

    async def abort(self, rid: str, message: str = "Abort request") -> bool:
        """Abort one in-flight request; returns whether one was aborted."""
        request = self.in_flight.get(rid)
        if request is None or request.abort_message is not None:
            return False
        request.abort_message = message
        request.abort_version = self.weight_version
        await self._notify()
        return True

    async def abort_all(self, message: str) -> int:
        """Abort every in-flight ``/generate`` request; each returns with ``finish_reason.type == "abort"``.

        Returns:
            How many requests were aborted.
        """
        count = 0
        for request in self.in_flight.values():
            if request.abort_message is None:
                request.abort_message = message
                request.abort_version = self.weight_version
                count += 1
        await self._notify()
        return count

    async def _wait_if_paused(self, request: InFlightRequest) -> None:
        if self.pause_mode is None or request.abort_message is not None:
            return
        if self.pause_mode == "retract" and request.output_ids:
            request.num_retractions += 1
        request.parked = True
        condition = self._wakeup()
        try:
            async with condition:
                await condition.wait_for(lambda: self.pause_mode is None or request.abort_message is not None)
        finally:
            request.parked = False

    async def generate(
        self,
        request: InFlightRequest,
        max_new_tokens: int,
        stop_ids: set[int],
        adapter: str | None,
        temperature: float = 0.0,
    ) -> dict[str, Any]:
        """Generate into ``request`` (registered in :attr:`in_flight` meanwhile) and return its ``finish_reason``.

        Tokens are sampled at ``temperature`` when the model can sample (``sample_token``), else greedy.

        Raises:
            ValueError: a request with the same id is already in flight.
        """
        if request.rid in self.in_flight:
            raise ValueError(f"duplicate request id {request.rid}")
        self.in_flight[request.rid] = request
        try:
            return await self._generate(request, max_new_tokens, stop_ids, adapter, temperature)
        finally:
            del self.in_flight[request.rid]

    async def _generate(
        self, request: InFlightRequest, max_new_tokens: int, stop_ids: set[int], adapter: str | None, temperature: float
    ) -> dict[str, Any]:
        context = list(request.prompt)
        sample = getattr(self.model, "sample_token", None)
        while len(request.output_ids) < max_new_tokens:
            await self._wait_if_paused(request)
            if request.abort_message is not None:
                break
            if sample is not None:
                token, logprob = sample(context, adapter, temperature)
            else:
                token, logprob = self.model.next_token(context, adapter), 0.0
            request.output_ids.append(token)
            request.logprobs.append(logprob)
            request.versions.append(self.weight_version)
            context.append(token)
            if token in stop_ids:
                return {"type": "stop", "matched": token}
            await asyncio.sleep(self.token_delay)
        if request.abort_message is not None:
            return {"type": "abort", "message": request.abort_message}
        return {"type": "length", "length": max_new_tokens}

    def output_version(self, request: InFlightRequest) -> tuple[str, list[dict[str, Any]] | None]:
        """``meta_info``'s ``weight_version`` and ``weight_versions`` (``None`` unless the version changed)."""
        spans = version_spans(request.versions)
        if len(spans) > 1:
            return spans[-1]["version"], spans
        if request.abort_version is not None:
            return request.abort_version, None
        return self.weight_version, None
