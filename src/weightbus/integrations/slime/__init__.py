"""weightbus for slime (THUDM/slime): both halves of a drop-in. See docs/integrations/slime.md.

The trainer half (``install`` for ``--custom-megatron-init-path``; ``before_weight_update`` and
``after_weight_update`` for slime#2279's hooks, which it looks up in the rollout function's module: this one) and
the rollout half (``generate_rollout`` for ``--rollout-function-path``, ``generate`` for
``--custom-generate-function-path``) read the same settings; importing this package never imports slime, torch
or ray.
"""

from weightbus.integrations.slime.abort import generate, request_id
from weightbus.integrations.slime.config import SlimeSettings
from weightbus.integrations.slime.hooks import after_weight_update, before_weight_update
from weightbus.integrations.slime.patching import SLIME_COMMIT, install, installed, uninstall
from weightbus.integrations.slime.rollout import GatedDataBuffer, SlimeRollout, generate_rollout, shutdown

__all__ = [
    "SLIME_COMMIT",
    "GatedDataBuffer",
    "SlimeRollout",
    "SlimeSettings",
    "after_weight_update",
    "before_weight_update",
    "generate",
    "generate_rollout",
    "install",
    "installed",
    "request_id",
    "shutdown",
    "uninstall",
]
