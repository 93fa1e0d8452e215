"""The trainer half of the miles integration at run time: ``HostTrainer`` (``integrations.host.trainer``) with
miles' plan of each update (``plan``: full or delta, NCCL-labelled or not, which adapters). docs/integrations/miles.md.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

from weightbus.integrations.host.engines import ray_engines
from weightbus.integrations.host.identity import Host
from weightbus.integrations.host.plan import Plan
from weightbus.integrations.host.runtime import Runtime
from weightbus.integrations.host.trainer import HostTrainer
from weightbus.integrations.miles.plan import Kind, plan_update

__all__ = ["Kind", "LORA_NAME", "MILES", "MILES_COMMIT", "MilesTrainer", "Plan", "Runtime"]

#: The miles commit the patches were written against (main, 2026-08-21).
MILES_COMMIT: Final = "31f1ca961a94cb860cec3b2dea34ec332bfa8f76"

#: miles as the shared trainer half sees it: its engine handles relabel and pause themselves.
MILES: Final = Host("miles", MILES_COMMIT, ray_engines)

#: miles' adapter name when the mixin module does not say (``miles.utils.lora.LORA_ADAPTER_NAME``).
LORA_NAME: Final = "miles_lora"


class MilesTrainer(HostTrainer):
    """The integration in one miles training actor's process (``HostTrainer``), with miles' plan of each update.

    Attributes:
        settings: what was configured.
        labelling: the updater classes whose full push carries ``weight_version`` (miles' NCCL broadcast).
    """

    labelled: ClassVar[frozenset[str]] = frozenset({"UpdateWeightFromDistributed"})

    host: ClassVar[Host] = MILES

    def plan(self, updater: Any, kind: str, runtime: Runtime) -> Plan:
        """miles' plan: a LoRA push is a delta, labelled by the push only on miles' NCCL broadcast."""
        return plan_update(updater, kind, runtime, self.labelling)
