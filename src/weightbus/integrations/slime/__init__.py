"""weightbus for slime (THUDM/slime): both halves of a drop-in. See docs/integrations/slime.md.

The trainer half (``install`` for ``--custom-megatron-init-path``; ``before_weight_update`` and
``after_weight_update`` for slime#2279's hooks) reads the same settings as the rollout half (``config``);
importing this package never imports slime, torch or ray.
"""

from weightbus.integrations.slime.config import SlimeSettings
from weightbus.integrations.slime.hooks import after_weight_update, before_weight_update
from weightbus.integrations.slime.patching import SLIME_COMMIT, install, installed, uninstall

__all__ = [
    "SLIME_COMMIT",
    "SlimeSettings",
    "after_weight_update",
    "before_weight_update",
    "install",
    "installed",
    "uninstall",
]
