"""The settings both halves of the slime integration read: ``integrations.host.settings``' under slime's name.

One slime addition: ``args.update_weight_start_version`` (what slime's ``RayTrainGroup`` hands a re-created
actor, ``actor.py:183``) is a floor of the counter, never the source of a number. Pure: no I/O beyond
``os.environ``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Self

from weightbus.integrations.host.settings import DropInSettings, add_arguments

__all__ = ["SlimeSettings", "add_arguments"]


class SlimeSettings(DropInSettings):
    """What both halves need to reach the bus, and what the trainer half needs to publish (``DropInSettings``).

    The trainer's readable name defaults to ``slime:<hostname>:<pid>``; ``floor`` is the larger of
    ``WEIGHTBUS_FLOOR`` and slime's ``update_weight_start_version``.
    """

    __slots__ = ()

    @classmethod
    def from_args(cls, args: Any) -> Self:
        """The settings for ``args`` (slime's namespace; None for the environment alone).

        Raises:
            ValueError, BusConfigError: as ``DropInSettings.from_args``.
        """
        settings = super().from_args(args)
        start = getattr(args, "update_weight_start_version", None)
        if type(start) is int and start > 0 and (settings.floor is None or start > settings.floor):
            return dataclasses.replace(settings, floor=start)
        return settings
