"""The trainer half of the slime integration at run time: ``HostTrainer`` (``integrations.host.trainer``) with
slime's plan of each update. docs/integrations/slime.md#the-trainer-half.

Every slime push is a full one (slime main has no LoRA adapter push: a LoRA run, as slime#1865 proposes, merges
the adapters and pushes full weights through the same updaters), and slime's NCCL broadcast and colocated tensor
loads carry ``weight_version=str(v)`` in every payload, so the push labels the engines itself.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

from weightbus.integrations.host.engines import http_engines
from weightbus.integrations.host.identity import Host
from weightbus.integrations.host.plan import Plan
from weightbus.integrations.host.runtime import Runtime
from weightbus.integrations.host.trainer import DELTA, HostTrainer

__all__ = ["SLIME", "SLIME_COMMIT", "SlimeTrainer"]

#: The slime commit the patches were written against (main, 2026-08-21).
SLIME_COMMIT: Final = "624b824a898ab0ec1fcb4d373004c7f3852bf515"

#: slime as the shared trainer half sees it: its ``SGLangEngine`` handle has no relabel method, so weightbus
#: reaches each engine at its ``get_url()`` with its own client; its ``pause_generation()`` sends no mode
#: (SGLang's default, ``abort``: slime's fully-async rollout recycles aborted groups): weightbus pauses alike.
# slime's train_async.py has no retry: an update that raised while the bus was down would end a job that, without
# weightbus, would have gone on. So an update waits for the bus (a warning per retry) unless a timeout is set.
SLIME: Final = Host("slime", SLIME_COMMIT, http_engines, pause="abort", update_timeout=None)


class SlimeTrainer(HostTrainer):
    """The integration in one slime training actor's process (``HostTrainer``), with slime's plan of each update."""

    host: ClassVar[Host] = SLIME

    def plan(self, updater: Any, kind: str, runtime: Runtime) -> Plan:
        """slime's plan: a full push, labelled by the push itself (the disk delta: by weightbus' stamp)."""
        return Plan("full", kind != DELTA, None)
