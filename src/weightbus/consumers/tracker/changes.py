"""``VersionChange`` and the change queues behind ``VersionTracker.changes()``.

A tracker keeps one ``_Listener`` per open ``changes()`` iterator and pushes each change to all of
them; the iterator consumes its own queue with ``_Listener.next``.

Invariants:

* A listener's queue is bounded by ``limit``. A change that finds it full is not queued: the
  listener is marked overflowed, and its iterator raises ``SlowConsumerError`` when it next finds
  the queue empty. The end marker (``_END``) and errors are always queued, so a slow iterator still
  learns how the tracker ended.
* Items come out in push order, and the first terminal item ends the iterator: ``_END`` ends it
  quietly, an exception (the tracker's ``VersionRegressionError``) is raised by it.
* ``include_regressions`` is read by the tracker when it pushes: a listener only receives ``held``
  changes when it asked for them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Final

import msgspec

from weightbus.errors import SlowConsumerError
from weightbus.rules.chain import TrackerAction

__all__ = ["VersionChange"]

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
        lag: publish-to-observe delay in seconds, for live updates only (None when replayed or a claim).
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


class _Listener:
    """The bounded queue of one ``changes()`` iterator; overflow ends it with ``SlowConsumerError``."""

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
        """Wait for the next change; None once the tracker ended.

        Raises:
            VersionRegressionError: the error the tracker pushed (``raise`` mode saw a regression).
            SlowConsumerError: the queue overflowed (``subject`` names the tracker's subject).
        """
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
