"""A tiny torch language model for the CPU reference engine, loaded from ``torch.save``d state dicts.

Greedy decoding; a failed load keeps the old weights; torch is imported lazily, here only.
"""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from weightbus.refengine.model import VOCAB

if TYPE_CHECKING:
    import torch

__all__ = ["TinyTorchModel", "random_state_dict", "save_random_weights", "serialize_named_tensors"]

_DIM = 16
_CONTEXT = 4


def _torch() -> Any:
    import torch

    return torch


def random_state_dict(seed: int, *, dim: int = _DIM) -> dict[str, torch.Tensor]:
    """A full state dict for :class:`TinyTorchModel`, drawn from a seeded generator."""
    torch = _torch()
    generator = torch.Generator().manual_seed(seed)
    vocab = len(VOCAB)
    return {
        "embed.weight": torch.randn(vocab, dim, generator=generator),
        "head.weight": torch.randn(vocab, dim, generator=generator),
        "head.bias": torch.randn(vocab, generator=generator),
    }


def save_random_weights(path: str, seed: int, *, dim: int = _DIM) -> None:
    """Write a seeded random state dict to ``path`` with ``torch.save``, ready for ``update_weights_from_disk``."""
    _torch().save(random_state_dict(seed, dim=dim), path)


def serialize_named_tensors(tensors: Mapping[str, torch.Tensor]) -> str:
    """One ``update_weights_from_tensor`` payload for the reference engine: base64 of ``torch.save(dict)``."""
    buffer = io.BytesIO()
    _torch().save(dict(tensors), buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class TinyTorchModel:
    """An embedding-average + linear-head LM over the shared character vocabulary, on CPU.

    Args:
        seed: seeds the initial weights.
        dim: the embedding width.
    """

    name = "weightbus/tiny-torch-lm"
    architecture = "TinyTorchLM"

    def __init__(self, *, seed: int = 0, dim: int = _DIM) -> None:
        torch = _torch()
        vocab = len(VOCAB)
        self._module = torch.nn.ModuleDict(
            {"embed": torch.nn.Embedding(vocab, dim), "head": torch.nn.Linear(dim, vocab)}
        ).eval()
        self._module.load_state_dict(random_state_dict(seed, dim=dim))

    @property
    def vocab_size(self) -> int:
        return len(VOCAB)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A detached copy of the current weights."""
        return {name: tensor.detach().clone() for name, tensor in self._module.state_dict().items()}

    def next_token(self, context: Sequence[int], adapter: str | None) -> int:
        # Adapters are accepted by the engine but do not alter this model's output.
        torch = _torch()
        ids = list(context[-_CONTEXT:]) or [0]
        with torch.no_grad():
            hidden = self._module["embed"](torch.tensor(ids)).mean(dim=0)
            logits = self._module["head"](hidden)
        return int(torch.argmax(logits).item())

    def load_from_disk(self, path: str, load_format: str | None) -> None:
        torch = _torch()
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
            raise ValueError(f"cannot read weights from {path!r}: {exc}") from exc
        if not isinstance(state, dict):
            raise ValueError(f"{path!r} holds a {type(state).__name__}, not a state dict")
        self._apply(state, full=True)

    def load_from_tensors(self, payloads: Sequence[str], load_format: str | None) -> None:
        torch = _torch()
        if not payloads:
            raise ValueError("serialized_named_tensors is empty")
        merged: dict[str, Any] = {}
        for payload in payloads:
            try:
                raw = base64.b64decode(payload, validate=True)
                merged.update(torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True))
            except (ValueError, RuntimeError, EOFError, TypeError, pickle.UnpicklingError) as exc:
                raise ValueError(f"cannot decode a serialized tensor payload: {exc}") from exc
        self._apply(merged, full=False)

    def load_from_distributed(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[list[int]]) -> None:
        raise ValueError("the CPU reference engine has no NCCL weight-update group")

    def _apply(self, state: Mapping[str, Any], *, full: bool) -> None:
        torch = _torch()
        current = self._module.state_dict()
        unknown = sorted(set(state) - set(current))
        if unknown:
            raise ValueError(f"unknown parameters: {unknown}")
        missing = sorted(set(current) - set(state))
        if full and missing:
            raise ValueError(f"missing parameters: {missing}")
        for name, tensor in state.items():
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(current[name].shape):
                got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"parameter {name!r}: expected shape {tuple(current[name].shape)}, got {got}")
        # Validate everything before touching any weight, so a bad load leaves the old weights whole.
        with torch.no_grad():
            for name, tensor in state.items():
                current[name].copy_(tensor)
