"""``ReplayCursor``: where a tracker's subscription stands in the weights subject's stream.

Each event is handled once (unless the stream was reset); one at or below the ``boundary`` is replayed, not live; a
gap after ``last_handled`` is a ``rebase``. The per-event methods allocate nothing.
"""

from __future__ import annotations

import time

__all__ = ["ReplayCursor"]


class ReplayCursor:
    """The replay state of one tracker; see the module docstring."""

    __slots__ = ("_first", "boundary", "last_handled", "last_item_at", "position", "rebase", "subscribed_at")

    def __init__(self) -> None:
        self.boundary: int | None = None
        """The subject's last sequence when this subscription started: the end of the replay."""
        self.position = 0
        """The highest sequence delivered on this subscription."""
        self.last_handled: int | None = None
        """The sequence of the last event handled, across subscriptions (None: none yet, or reset)."""
        self.rebase = False
        """Events were missed: the chain may restart from the retained history (see ``rules.chain.decide``)."""
        self.subscribed_at = 0.0
        """Unix time at which this subscription started."""
        self.last_item_at = time.monotonic()
        """Monotonic time of the last delivery (the watchdog checks the subject after silence)."""
        self._first = False

    def subscribe(self, stored: int, subscribed_at: float) -> bool:
        """A new subscription, started at ``subscribed_at`` (Unix time), whose subject's last sequence is ``stored``.

        Returns:
            Whether the stream was reset (its sequence went below the last event handled): the
            history is then handled again from its start.
        """
        reset = self.last_handled is not None and stored < self.last_handled
        if reset:
            self.last_handled = None
        self.boundary = stored
        self.position = 0
        self.subscribed_at = subscribed_at
        self._first = True
        return reset

    @property
    def empty(self) -> bool:
        """Whether the subject held nothing when subscribing (the replay is over before it starts)."""
        return self.boundary == 0

    def arrived(self, seq: int | None) -> None:
        """Something was delivered at ``seq`` (an event or a skipped payload)."""
        self.last_item_at = time.monotonic()
        if self._first:
            self._first = False
            if self.last_handled is not None and seq is not None and seq > self.last_handled:
                self.rebase = True

    def take(self, seq: int | None, published_at: float) -> bool | None:
        """Mark the event at ``seq`` handled; None if it was handled before, else whether it is replayed."""
        last = self.last_handled
        if seq is None:
            return published_at < self.subscribed_at
        if last is not None and seq <= last:
            return None
        self.last_handled = seq
        boundary = self.boundary
        return seq <= boundary if boundary is not None else published_at < self.subscribed_at

    def advance(self, seq: int | None) -> bool:
        """Move past ``seq``; return whether the replay is over (the boundary is reached)."""
        if seq is not None and seq > self.position:
            self.position = seq
        boundary = self.boundary
        return boundary is None or seq is None or self.position >= boundary
