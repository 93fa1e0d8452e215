"""weightbus for miles: both halves of a drop-in, each loaded with one miles flag.

The trainer half (``patching``, ``trainer``) and the rollout half (``buffer``, ``admission``) read the same settings
(``config``); importing this package never imports miles, torch or ray. The flags: docs/integrations/miles.md.
"""

from weightbus.integrations.host.groups import group_versions_of as miles_group_versions
from weightbus.integrations.host.groups import to_weightbus_group
from weightbus.integrations.miles.admission import generate
from weightbus.integrations.miles.buffer import WeightbusDataBuffer
from weightbus.integrations.miles.config import MilesSettings, add_arguments
from weightbus.integrations.miles.patching import MILES_COMMIT, install, install_fsdp, installed, uninstall
from weightbus.integrations.miles.trainer import MilesTrainer

__all__ = [
    "MILES_COMMIT",
    "MilesSettings",
    "MilesTrainer",
    "WeightbusDataBuffer",
    "add_arguments",
    "generate",
    "install",
    "install_fsdp",
    "installed",
    "miles_group_versions",
    "to_weightbus_group",
    "uninstall",
]
