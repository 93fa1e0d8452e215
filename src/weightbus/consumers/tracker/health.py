"""The tracker's watchdog: a subscription that went quiet is checked against the subject, beside the loop.

A JetStream subscription can stall (the server stopped delivering while the subject moved on) or
outlive its stream (purged, deleted and recreated: the sequence went back) without an error. The
watchdog runs as a task beside the follow loop, so the per-event path arms no timer. Invariants:

* Only silence is checked: after ``interval`` seconds without a delivery (``ReplayCursor.last_item_at``),
  one ``last_seq`` read compares the subject with the cursor's ``position``.
* A stream whose last sequence is below the position was reset: the subscription is failed at once.
  A subject that moved past the position is failed when it is still ahead at the next check (one
  interval of grace for a delivery in flight).
* Failing the subscription (``Subscription.fail``) ends the follow loop's iteration with the error,
  so the tracker logs it, counts it, turns deaf and resubscribes; a failed ``last_seq`` read (the
  stream is gone) fails it the same way.
* A check that finds the subscription where the subject is calls ``on_caught_up`` (a deaf tracker
  whose subscription is back is current again).
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
