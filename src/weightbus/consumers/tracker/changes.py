"""``VersionChange`` and ``ChangeFeed``, the fan-out behind ``VersionTracker.changes()``.

Each iterator has its own bounded queue: an overflow raises ``SlowConsumerError`` once it is drained, while the end
and the error are always queued; a late iterator first gets the current change; ``push`` allocates only entries.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import Final

import msgspec

from weightbus.errors import SlowConsumerError
from weightbus.rules.chain import TrackerAction

__all__ = ["ChangeFeed", "VersionChange"]

_END: Final = object()


class VersionChange(msgspec.Struct, frozen=True):
    """One change of a tracker's version (or, when asked for, one held regression).

    Attributes:
        policy: the policy id.
        action: what the tracker did (``adopted``, ``advanced``, ``claimed``, ``followed``, ``held``).
        previous: the version held before.
        version: the version held after (equal to ``previous`` for ``held``).
        incoming: the version the event carried.
        epoch: the epoch of the event.
        publisher: the trainer id of the event.
        published_at: the event's publish time (the publisher's clock).
        received_at: local receive time.
        lag: publish-to-observe delay in seconds, for live updates only (None when replayed, republished by
            `weightbus replay`, or a claim).
        replayed: whether the event was the stream's stored one, delivered at (re)subscription.
        reason: why an event was rejected (``not_owner``, ``unexplained_jump``, ...), else None.
    """

    policy: str
    action: TrackerAction
    previous: int | None
    version: int | None
    incoming: int | None
    epoch: int
    publisher: str
    published_at: float
    received_at: float
    lag: float | None
    replayed: bool
    reason: str | None = None


class _Queue:
    """The bounded queue of one iterator; overflow ends it with ``SlowConsumerError``."""

    __slots__ = ("include_regressions", "items", "limit", "overflowed", "signal")

    def __init__(self, include_regressions: bool, limit: int) -> None:
        self.include_regressions = include_regressions
        self.limit = limit
        self.items: deque[object] = deque()
        self.overflowed = False
        self.signal = asyncio.Event()

    def push(self, item: object) -> None:
        if len(self.items) >= self.limit and item is not _END and not isinstance(item, BaseException):
            self.overflowed = True
        else:
            self.items.append(item)
        self.signal.set()

    async def next(self, subject: str) -> VersionChange | None:
        while not self.items:
            if self.overflowed:
                raise SlowConsumerError(subject, self.limit)
            self.signal.clear()
            await self.signal.wait()
        item = self.items.popleft()
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, VersionChange)
        return item


class _Latest:
    """The one-place queue of a coalescing iterator: a change replaces the one not yet read, so it never overflows.

    A terminal item (the end, an error) is kept beside that place: the newest change is read before it.
    """

    __slots__ = ("newest", "signal", "terminal")

    include_regressions = False

    def __init__(self) -> None:
        self.newest: VersionChange | None = None
        self.terminal: object | None = None
        self.signal = asyncio.Event()

    def push(self, item: object) -> None:
        if isinstance(item, VersionChange):
            self.newest = item
        elif self.terminal is None:
            self.terminal = item
        self.signal.set()

    async def next(self, subject: str) -> VersionChange | None:
        while True:
            newest = self.newest
            if newest is not None:
                self.newest = None
                return newest
            terminal = self.terminal
            if terminal is _END:
                return None
            if isinstance(terminal, BaseException):
                raise terminal
            self.signal.clear()
            await self.signal.wait()


class ChangeFeed:
    """The changes of one tracker, fanned out to every open iterator; see the module docstring.

    Args:
        subject: the tracker's subject (named by ``SlowConsumerError``).
        limit: the bound of each iterator's queue.
    """

    def __init__(self, subject: str, limit: int) -> None:
        self._subject = subject
        self._limit = limit
        self._queues: list[_Queue | _Latest] = []
        self._terminal: object | None = None
        self.last: VersionChange | None = None
        """The newest change that moved the version (a late iterator starts with it)."""

    def push(self, change: VersionChange, changed: bool) -> None:
        """Hand ``change`` to every iterator; ``changed`` False (held, rejected) only to those that asked."""
        if changed:
            self.last = change
        for queue in self._queues:
            if changed or queue.include_regressions:
                queue.push(change)

    def fail(self, exc: BaseException) -> None:
        """End the feed with ``exc``: every iterator, and any started later, raises it."""
        if self._terminal is None or self._terminal is _END:
            self._terminal = exc
        for queue in self._queues:
            queue.push(exc)

    def close(self) -> None:
        """End the feed: every iterator ends once it consumed what was queued (idempotent)."""
        if self._terminal is None:
            self._terminal = _END
        for queue in self._queues:
            queue.push(_END)

    def follow(self, include_regressions: bool = False) -> AsyncIterator[VersionChange]:
        """Iterate over the changes: ``last`` first (if any), then each one pushed, until the feed ends.

        Raises:
            VersionRegressionError: the error the feed was failed with.
            SlowConsumerError: this iterator fell more than ``limit`` changes behind.
        """
        return self._follow(_Queue(include_regressions, self._limit))

    def latest(self) -> AsyncIterator[VersionChange]:
        """Iterate over the newest state: ``last`` first (if any), then the newest change not yet read, until the
        feed ends. A reader that falls behind skips to the newest change: it never raises ``SlowConsumerError``,
        and the last change it reads before the end is the feed's ``last``.

        Raises:
            VersionRegressionError: the error the feed was failed with (after the newest change).
        """
        return self._follow(_Latest())

    async def _follow(self, queue: _Queue | _Latest) -> AsyncIterator[VersionChange]:
        if self.last is not None:
            queue.push(self.last)
        if self._terminal is not None:
            queue.push(self._terminal)
        self._queues.append(queue)
        try:
            while (change := await queue.next(self._subject)) is not None:
                yield change
        finally:
            self._queues.remove(queue)
