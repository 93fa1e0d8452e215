"""The tracker's watchdog: a subscription that went quiet is checked against the subject, beside the loop.

Only silence is checked (one ``last_seq`` read per quiet ``interval``): a reset stream fails the subscription at
once, a subject still ahead at the next check then; a check that finds it caught up calls ``on_caught_up``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from weightbus.bus.protocol import Bus, Subscription
from weightbus.consumers.tracker.cursor import ReplayCursor

__all__ = ["SubscriptionWatchdog"]


class _SubscriptionLost(Exception):
    """The subscription stalled or its stream was reset; it fails the subscription it was found on."""


class SubscriptionWatchdog:
    """Checks one tracker's subscription after each ``interval`` of silence; see the module docstring.

    Args:
        bus: the bus (for ``last_seq``).
        subject: the subject followed.
        cursor: the tracker's replay cursor (read only).
        interval: seconds of silence before a check.
        on_caught_up: called when a check finds the subscription at the subject's last sequence.
    """

    def __init__(
        self, bus: Bus, subject: str, cursor: ReplayCursor, interval: float, on_caught_up: Callable[[], None]
    ) -> None:
        self._bus = bus
        self._subject = subject
        self._cursor = cursor
        self._interval = interval
        self._on_caught_up = on_caught_up

    async def watch(self, sub: Subscription) -> None:
        """Check ``sub`` until cancelled, or until it is failed (then return).

        Raises:
            Exception: a check failed and ``sub`` has no ``fail`` to hand the error to.
        """
        stalled = 0
        while True:
            await asyncio.sleep(self._interval)
            if time.monotonic() - self._cursor.last_item_at < self._interval:
                stalled = 0
                continue
            try:
                stalled = await self._check(stalled)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Ends the follow loop's iteration with this error: the tracker then resubscribes.
                fail = getattr(sub, "fail", None)
                if fail is None:
                    raise
                fail(exc)
                return

    async def _check(self, stalled: int) -> int:
        stored = await self._bus.last_seq(self._subject)  # a BusError here (stream gone) makes the tracker deaf
        position = self._cursor.position
        if stored < position:
            raise _SubscriptionLost(f"the stream was reset (last sequence {stored} < {position})")
        if stored > position:
            if stalled >= 1:
                raise _SubscriptionLost(f"no delivery while the subject moved to sequence {stored}")
            return stalled + 1
        self._on_caught_up()
        return 0
