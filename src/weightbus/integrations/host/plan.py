"""``Plan``: how one host update maps onto ``VersionUpdate`` (full or delta, labelled by the push or not, which
adapters). Each host reads its plan off its updater (``integrations.<host>``); this is the shape they share.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightbus.producers.coverage import Push
from weightbus.schemas import LoraAdapter

__all__ = ["Plan"]


@dataclass(frozen=True, slots=True)
class Plan:
    """How one update maps onto ``VersionUpdate``.

    Attributes:
        push: ``full`` (the whole model) or ``delta`` (a LoRA load, a disk delta).
        labels: the push itself carries ``weight_version=str(v)`` to every engine.
        lora: the adapters of a LoRA push, else None.
    """

    push: Push
    labels: bool
    lora: LoraAdapter | None
