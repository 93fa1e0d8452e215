"""``Plan``: which push one miles update is (full or delta, labelled by the push or not, which adapters).

``plan_update`` reads it off the updater: a LoRA updater's push is a delta on the same counter,
announced with the adapters as the engines serve them (multi-LoRA by miles' slot names, each with
miles' name for it); any other push is full, and labels the engines itself only on the updater
classes that carry ``weight_version`` (miles' NCCL broadcast).
"""

from __future__ import annotations

import importlib
from collections.abc import Collection
from typing import Any, Final, Literal

import msgspec

from weightbus.integrations.host.plan import Plan
from weightbus.integrations.host.runtime import Runtime
from weightbus.schemas import LoraAdapter

__all__ = ["Kind", "Plan", "plan_update"]

#: Where miles names its multi-LoRA adapters' engine slots (``slot_lora_name``).
_MULTI_LORA: Final = "miles.utils.multi_lora"

Kind = Literal["mixin", "delta", "tensor", "fsdp"]


def plan_update(updater: Any, kind: str, runtime: Runtime, labelling: Collection[type]) -> Plan:
    """How ``updater``'s update maps onto the protocol.

    ``labelling``: the updater classes whose full push carries ``weight_version`` (``MilesTrainer.labelling``).
    """
    if kind in ("mixin", "tensor") and getattr(updater, "is_lora", False):
        adapters = getattr(updater, "multi_lora_adapters", None) if kind == "mixin" else None
        if adapters is None:
            return Plan("delta", False, LoraAdapter(name=runtime.lora_name))
        # Multi-LoRA: the engines serve each adapter under its controller slot's name.
        served = sorted((_slot_name(adapter), str(name)) for name, adapter in adapters.items())
        if not served:
            return Plan("delta", False, None)  # nothing loaded: the engines serve what they served
        loaded = [LoraAdapter(name=engine, trainer_name=name) for engine, name in served]
        return Plan("delta", False, msgspec.structs.replace(loaded[0], more=tuple(loaded[1:])))
    return Plan("full", kind == "mixin" and isinstance(updater, tuple(labelling)), None)


def _slot_name(adapter: Any) -> str:
    """The engine-side name of a multi-LoRA adapter: miles' own ``slot_lora_name(adapter.slot)``."""
    module = importlib.import_module(_MULTI_LORA)
    namer = getattr(module, "slot_lora_name", None)
    if not callable(namer):
        raise RuntimeError(f"{_MULTI_LORA}.slot_lora_name is missing: weightbus cannot name miles' adapters")
    return str(namer(adapter.slot))
