"""The settings both halves of the miles integration read: ``integrations.host.settings``' under miles' name.

Pure: no I/O beyond ``os.environ``.
"""

from __future__ import annotations

from weightbus.integrations.host.settings import DropInSettings, add_arguments

__all__ = ["MilesSettings", "add_arguments"]


class MilesSettings(DropInSettings):
    """What both halves need to reach the bus, and what the trainer half needs to publish (``DropInSettings``).

    The trainer's readable name defaults to ``miles:<hostname>:<pid>``.
    """

    __slots__ = ()
