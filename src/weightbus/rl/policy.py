"""The trainer's torch policy: the engine's ``WindowLM`` architecture, trainable in full or through a LoRA adapter.

Same seed, same initial weights as the engines; what it writes is exactly what the engine loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from weightbus.refengine.policy_model import (
    CONTEXT,
    LORA_LAYERS,
    build_module,
    context_window,
    module_logits,
    save_safetensors,
)

__all__ = ["Policy", "token_windows"]


def token_windows(tokens: Sequence[int], response_length: int) -> list[list[int]]:
    """The context window of each response token of a sample (prompt + response ``tokens``)."""
    start = len(tokens) - response_length
    return [context_window(tokens[:i]) for i in range(start, len(tokens))]


class Policy:
    """A trainable ``WindowLM``.

    Args:
        seed: the initial weights (the engines' ``--seed``).
        lora_rank: when set, the base weights are frozen and a rank-``lora_rank`` adapter on ``fc`` and ``head``
            is what trains (B starts at zero, so the adapter starts as a no-op).
    """

    def __init__(self, *, seed: int = 0, lora_rank: int | None = None) -> None:
        import torch

        self.module = build_module(seed)
        self.lora: dict[str, Any] | None = None
        if lora_rank is not None:
            for p in self.module.parameters():
                p.requires_grad_(False)
            generator = torch.Generator().manual_seed(seed + 1)
            shapes = {
                "fc": (self.module["fc"].out_features, self.module["fc"].in_features),
                "head": (self.module["head"].out_features, self.module["head"].in_features),
            }
            self.lora = {}
            for layer in LORA_LAYERS:
                out_f, in_f = shapes[layer]
                a = torch.randn(lora_rank, in_f, generator=generator) / in_f**0.5
                self.lora[f"{layer}.lora_A"] = a.requires_grad_(True)
                self.lora[f"{layer}.lora_B"] = torch.zeros(out_f, lora_rank).requires_grad_(True)

    def parameters(self) -> list[Any]:
        """What the optimizer updates: the adapter in LoRA mode, else every weight."""
        if self.lora is not None:
            return list(self.lora.values())
        return list(self.module.parameters())

    def token_logprobs(self, windows: Sequence[Sequence[int]], tokens: Sequence[int]) -> Any:
        """Logprobs (a 1-d tensor, with grad) of ``tokens`` after their ``windows``."""
        import torch

        x = torch.tensor([list(w) for w in windows], dtype=torch.long).reshape(-1, CONTEXT)
        logits = module_logits(self.module, x, self.lora)
        return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(list(tokens))[:, None])[:, 0]

    def save_weights(self, path: str) -> None:
        """The full weights as a safetensors file for ``/update_weights_from_disk``."""
        save_safetensors(self.module.state_dict(), path)

    def save_adapter(self, path: str) -> None:
        """The LoRA adapter as a safetensors file for ``/load_lora_adapter``."""
        if self.lora is None:
            raise ValueError("this policy has no LoRA adapter")
        save_safetensors(self.lora, path)

    def state(self) -> dict[str, Any]:
        """Everything a checkpoint needs to rebuild this policy."""
        return {"module": self.module.state_dict(), "lora": {k: v.detach() for k, v in (self.lora or {}).items()}}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state`."""
        import torch

        self.module.load_state_dict(state["module"])
        if self.lora is not None:
            with torch.no_grad():
                for name, tensor in state["lora"].items():
                    self.lora[name].copy_(tensor)
