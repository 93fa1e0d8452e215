"""weightbus for miles: both halves of a drop-in, each loaded with one miles flag.

* The trainer half, ``--custom-megatron-init-path weightbus.integrations.miles.install``
  (``install_fsdp()`` for FSDP actors): every weight update takes its number from weightbus' fenced,
  durable counter, stamps and reads back the engines, announces the version on the bus before the
  engines resume, and quarantines them on any failure (``patching`` checks miles and patches its
  updaters; ``trainer`` runs each update).
* The rollout half, ``--custom-async-data-buffer-path weightbus.integrations.miles.WeightbusDataBuffer``:
  miles' fully-async data buffer, judging staleness against the bus's version (module ``buffer``), and
  ``--custom-generate-function-path weightbus.integrations.miles.generate``, which starts a group only
  while it can still be trained within the bound (module ``admission``).

Both read the same settings (module ``config``): ``args.weightbus_*`` or ``WEIGHTBUS_*``. Importing
this package never imports miles, torch or ray.
"""

from weightbus.integrations.miles.admission import generate
from weightbus.integrations.miles.buffer import WeightbusDataBuffer
from weightbus.integrations.miles.config import MilesSettings
from weightbus.integrations.miles.groups import miles_group_versions, to_weightbus_group
from weightbus.integrations.miles.patching import MILES_COMMIT, install, install_fsdp, installed, uninstall
from weightbus.integrations.miles.trainer import MilesTrainer

__all__ = [
    "MILES_COMMIT",
    "MilesSettings",
    "MilesTrainer",
    "WeightbusDataBuffer",
    "generate",
    "install",
    "install_fsdp",
    "installed",
    "miles_group_versions",
    "to_weightbus_group",
    "uninstall",
]
