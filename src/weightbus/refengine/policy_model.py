"""``WindowLM``: the tiny torch policy the reference engine serves and the RL trainer trains (same architecture).

Weights and LoRA adapters travel as safetensors files; a load missing a parameter or a shape keeps the old weights.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from weightbus.refengine.model import VOCAB

if TYPE_CHECKING:
    import torch
    from torch import Tensor  # the name a function that binds ``torch`` to the lazy import can still annotate with

__all__ = [
    "CONTEXT",
    "LORA_LAYERS",
    "WindowLM",
    "build_module",
    "context_window",
    "load_safetensors",
    "module_logits",
    "save_safetensors",
]

#: How many trailing tokens the model sees; shorter contexts are left-padded with token 0 (a space).
CONTEXT = 6
_DIM = 8
_HIDDEN = 32
#: The layers a LoRA adapter may adapt.
LORA_LAYERS = ("fc", "head")


def _torch() -> Any:
    import torch

    return torch


def build_module(seed: int) -> Any:
    """A fresh ``torch.nn.ModuleDict`` of the architecture (``embed``, ``fc``, ``head``), seeded."""
    torch = _torch()
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        module = torch.nn.ModuleDict(
            {
                "embed": torch.nn.Embedding(len(VOCAB), _DIM),
                "fc": torch.nn.Linear(CONTEXT * _DIM, _HIDDEN),
                "head": torch.nn.Linear(_HIDDEN, len(VOCAB)),
            }
        )
    finally:
        torch.random.set_rng_state(generator_state)
    return module


def context_window(context: Sequence[int]) -> list[int]:
    """The last :data:`CONTEXT` tokens of ``context``, left-padded with 0."""
    tail = list(context[-CONTEXT:])
    return [0] * (CONTEXT - len(tail)) + tail


def module_logits(module: Any, windows: torch.Tensor, lora: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Logits ``[B, vocab]`` for context windows ``[B, CONTEXT]``; ``lora`` adds ``B @ A`` to ``fc`` and ``head``."""
    torch = _torch()
    x = module["embed"](windows).flatten(1)
    h = module["fc"](x)
    if lora is not None:
        h = h + (x @ lora["fc.lora_A"].T) @ lora["fc.lora_B"].T
    h = torch.tanh(h)
    out: Tensor = module["head"](h)
    if lora is not None:
        out = out + (h @ lora["head.lora_A"].T) @ lora["head.lora_B"].T
    return out


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: str) -> None:
    """Write ``tensors`` to ``path`` (contiguous CPU copies) with ``safetensors``."""
    from safetensors.torch import save_file

    save_file({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, path)


def load_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Read a safetensors file. Raises ``ValueError`` when it cannot be read."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (OSError, SafetensorError) as exc:
        raise ValueError(f"cannot read safetensors from {path!r}: {exc}") from exc


class WindowLM:
    """The engine-side model: samples the next token (or picks the argmax at temperature 0), with its logprob.

    Args:
        seed: seeds the initial weights (the trainer's ``--seed`` builds the same ones).
        sampling_seed: seeds the engine's sampler.
    """

    name = "weightbus/window-lm"
    architecture = "WindowLM"

    def __init__(self, *, seed: int = 0, sampling_seed: int = 0) -> None:
        self._module = build_module(seed).eval()
        self._adapters: dict[str, dict[str, Any]] = {}
        self._rng = random.Random(sampling_seed)

    @property
    def vocab_size(self) -> int:
        return len(VOCAB)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A detached copy of the current weights."""
        return {name: tensor.detach().clone() for name, tensor in self._module.state_dict().items()}

    def _logprobs(self, context: Sequence[int], adapter: str | None) -> list[float]:
        torch = _torch()
        lora = self._adapter(adapter) if adapter is not None else None
        with torch.no_grad():
            logits = module_logits(self._module, torch.tensor([context_window(context)]), lora)[0]
            logprobs: list[float] = torch.log_softmax(logits, dim=-1).tolist()
            return logprobs

    def next_token(self, context: Sequence[int], adapter: str | None) -> int:
        logprobs = self._logprobs(context, adapter)
        return max(range(len(logprobs)), key=logprobs.__getitem__)

    def sample_token(self, context: Sequence[int], adapter: str | None, temperature: float) -> tuple[int, float]:
        """A token drawn at ``temperature`` (argmax at 0) and its logprob under the unscaled distribution."""
        logprobs = self._logprobs(context, adapter)
        if temperature <= 0:
            token = max(range(len(logprobs)), key=logprobs.__getitem__)
            return token, logprobs[token]
        scaled = [lp / temperature for lp in logprobs]
        top = max(scaled)
        weights = [math.exp(s - top) for s in scaled]
        token = self._rng.choices(range(len(weights)), weights=weights)[0]
        return token, logprobs[token]

    def _adapter(self, path: str) -> dict[str, Any]:
        cached = self._adapters.get(path)
        if cached is None:
            tensors = load_safetensors(path)
            expected = {f"{layer}.lora_{ab}" for layer in LORA_LAYERS for ab in "AB"}
            if set(tensors) != expected:
                raise ValueError(f"LoRA adapter {path!r} must hold exactly {sorted(expected)}")
            cached = self._adapters[path] = tensors
        return cached

    def load_from_disk(self, path: str, load_format: str | None) -> None:
        self._apply(load_safetensors(path), full=True)

    def load_from_tensors(self, payloads: Sequence[str], load_format: str | None) -> None:
        raise ValueError("WindowLM loads weights from safetensors files only (update_weights_from_disk)")

    def load_from_distributed(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[list[int]]) -> None:
        raise ValueError("the CPU reference engine has no NCCL weight-update group")

    def _apply(self, state: Mapping[str, Any], *, full: bool) -> None:
        torch = _torch()
        current = self._module.state_dict()
        unknown = sorted(set(state) - set(current))
        missing = sorted(set(current) - set(state))
        if unknown or (full and missing):
            raise ValueError(f"unknown parameters {unknown}, missing parameters {missing}")
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(current[name].shape):
                expected = tuple(current[name].shape)
                raise ValueError(f"parameter {name!r}: expected shape {expected}, got {tuple(tensor.shape)}")
        # Validate everything before touching any weight, so a bad load leaves the old weights whole.
        with torch.no_grad():
            for name, tensor in state.items():
                current[name].copy_(tensor)
