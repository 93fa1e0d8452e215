"""``Host``: which framework a drop-in serves, as the shared trainer half needs to know it.

Its name (log lines, the trainer's id on the bus, engine names), the commit its patches were written against,
and how its engine handles are reached (``integrations.host.engines``). A host package makes one and hands it
to the shared machinery; nothing here imports a host.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from weightbus.engines.sglang import PauseMode
from weightbus.integrations.host.engines import EngineReach

__all__ = ["Host"]


@dataclass(frozen=True, slots=True)
class Host:
    """A host framework as the shared trainer half sees it.

    Attributes:
        name: ``"miles"``, ``"slime"``: log lines, ``<name>:<hostname>:<pid>`` trainer ids, ``InstallError``.
        commit: the host commit the patches were written against (full hash).
        reach: how its engine handles become the fleet's engines.
        pause: the pause mode weightbus' pause uses when ``args.pause_generation_mode`` does not say (the one
            the host's own pause uses: miles' ``retract``; slime's ``pause_generation()`` sends SGLang's
            default, ``abort``).
        update_timeout: seconds an update retries a bus that does not answer when ``WEIGHTBUS_UPDATE_TIMEOUT``
            is unset; None: until it answers. miles: 30 (its group retries a failed update on another cell);
            slime: None (its ``train_async.py`` has no retry, so raising would end the job).
    """

    name: str
    commit: str
    reach: EngineReach
    pause: PauseMode = "retract"
    update_timeout: float | None = 30.0

    @property
    def log(self) -> logging.Logger:
        """The host's logger (``weightbus.integrations.<name>``)."""
        return logging.getLogger(f"weightbus.integrations.{self.name}")

    @property
    def checked(self) -> str:
        """What the patches were checked against, as ``InstallError`` says it (``miles main@31f1ca961``)."""
        return f"{self.name} main@{self.commit[:9]}"
