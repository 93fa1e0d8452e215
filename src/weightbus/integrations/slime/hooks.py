"""The weight-update hooks slime#2279 (open) calls around each ``update_weights()``, checked against the bus.

On that branch slime's ``RolloutManager`` keeps its own ``policy_version`` in memory (0 at start, + 1 per
successful update) and calls ``before_weight_update(policy_version)`` / ``after_weight_update(policy_version,
succeeded)`` when the rollout function's module defines them: re-exported from weightbus' rollout function, a
user of that branch patches nothing. The number that counts is the bus's (the trainer half takes it from the
fenced counter); after a successful update the hook reads the newest announced version once and, when slime's
count differs (a resume or a failover restarts slime's at 0), says so loudly (an error line and
``weightbus_host_version_mismatches_total``) and answers the bus's number. slime main has neither hook.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from weightbus.bus import subjects
from weightbus.bus.history import read_subject_history
from weightbus.errors import BusError
from weightbus.integrations.host.metrics import process_metrics
from weightbus.integrations.slime.config import SlimeSettings
from weightbus.integrations.slime.trainer import SLIME
from weightbus.schemas import WeightUpdated

__all__ = ["after_weight_update", "announced_version", "before_weight_update"]


def announced_version(settings: SlimeSettings) -> int | None:
    """The newest version announced on the bus for ``settings.policy`` (None: none yet), read once.

    Raises:
        BusError: the bus could not be read.
    """

    async def read() -> int | None:
        from weightbus.bus.nats import connect

        bus = await connect(
            settings.nats,
            name="weightbus-slime-hooks",
            connect_timeout=settings.connect_timeout,
            options=settings.options,
        )
        try:
            history = await read_subject_history(bus, subjects.weights(settings.policy))
        finally:
            await bus.aclose()
        versions = [e.event.version for e in history.events if isinstance(e.event, WeightUpdated)]
        return max(versions, default=None)

    result: list[int | None] = []
    failure: list[BaseException] = []

    def run() -> None:  # its own thread: the caller's thread may be running an event loop (the rollout's)
        try:
            result.append(asyncio.run(read()))
        except BaseException as exc:
            failure.append(exc)

    worker = threading.Thread(target=run, name="weightbus-slime-hooks")
    worker.start()
    worker.join()
    if failure:
        raise failure[0]
    return result[0]


def before_weight_update(policy_version: int, *args: Any, **kwargs: Any) -> None:
    """slime#2279's hook before ``update_weights()``: nothing to do (the trainer half takes the number itself)."""
    SLIME.log.debug("slime is about to update weights", extra={"policy_version": policy_version})


def after_weight_update(policy_version: int, succeeded: bool, *args: Any, **kwargs: Any) -> int | None:
    """slime#2279's hook after ``update_weights()``: slime's count checked against the bus's; the bus's wins.

    Args:
        policy_version: slime's own count (the ``RolloutManager``'s, in memory).
        succeeded: whether slime's update succeeded.

    Returns:
        The bus's newest announced version (the number the samples carry), or None after a failed update,
        before anything was announced, or when the bus cannot be read (said in an error line).
    """
    if not succeeded:
        SLIME.log.warning(
            "slime's weight update failed; the bus's version stands", extra={"policy_version": policy_version}
        )
        return None
    settings = SlimeSettings.from_args(None)
    try:
        bus = announced_version(settings)
    except BusError as exc:
        SLIME.log.error(
            "cannot read the bus's version after slime's weight update: slime's count is unchecked",
            extra={"policy": settings.policy, "policy_version": policy_version, "error": str(exc)},
        )
        return None
    if bus != policy_version:
        process_metrics().drain.for_policy(settings.policy).version_mismatched()
        SLIME.log.error(
            "slime's policy_version %s is not the bus's version %s: weightbus' number is the one samples carry",
            policy_version,
            bus,
            extra={"policy": settings.policy, "policy_version": policy_version, "bus_version": bus},
        )
    return bus
