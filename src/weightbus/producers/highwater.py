"""``HighWaterMark``: the counter's high-water mark on ``weightbus.<policy>.counter``, apart from the weights history.

``cover(v)`` returns only once a mark of at least ``v`` is stored; writes are conditional, so a fenced zombie never
lowers it; a mark the writer's chain does not explain covers nothing, and is written after only by a writer that
is still the owner (a zombie's chain is too short to explain the new owner's marks).
Why: docs/design.md#the-counter-one-owner-fenced-by-the-bus.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Final

from weightbus.bus import subjects
from weightbus.bus.marks import read_high_water
from weightbus.bus.protocol import Bus
from weightbus.errors import PublishError, SequenceConflictError
from weightbus.rules.marks import mark_explained
from weightbus.schemas import ClaimStanding, CounterHighWater, now

__all__ = ["HighWaterMark"]

log = logging.getLogger("weightbus.producers")

_WRITE_ATTEMPTS: Final = 3


class HighWaterMark:
    """The writer of one policy's mark; see the module docstring.

    Args:
        bus: the bus (borrowed).
        policy: the policy id.
        trainer_id, incarnation: the writer, recorded on each mark.
        confirm_owner: raises ``FencedError`` when another owner took the counter (the writer's
            ``check_owner``): awaited before a mark above what the writer's chain explains is taken
            for a forged one.

    Attributes:
        standing: the writer's claim standing, recorded on each mark (set by the counter's claim).
    """

    def __init__(
        self,
        bus: Bus,
        policy: str,
        *,
        trainer_id: str,
        incarnation: str,
        confirm_owner: Callable[[], Awaitable[None]],
    ) -> None:
        self._bus = bus
        self._confirm_owner = confirm_owner
        self._policy = policy
        self._subject = subjects.counter(policy)
        self._trainer_id = trainer_id
        self._incarnation = incarnation
        self._covers = 0
        self._seq = 0
        self.standing: ClaimStanding | None = None

    @property
    def covers(self) -> int:
        """The highest number the newest stored mark covered when last read or written (0: none)."""
        return self._covers

    async def read(self) -> CounterHighWater | None:
        """Read the newest mark and remember where the subject is (the next write is conditional on it).

        Raises:
            BusError: the bus did not answer.
        """
        stored = await read_high_water(self._bus, self._policy)
        # What is stored now, not what we once wrote: a recreated stream lost our marks too.
        self._seq = stored.seq
        self._covers = stored.mark.version if stored.mark is not None else 0
        return stored.mark

    def adopt(self, seq: int, covers: int) -> None:
        """Take the subject as read elsewhere: its last sequence ``seq``, and the mark the rule credits, ``covers``.

        The caller read the retained marks and judged them (``rules.marks``); a newest mark the rule
        refused covers nothing, so the next ``cover`` above ``covers`` stores a mark after it.
        """
        self._seq, self._covers = seq, covers

    async def cover(self, version: int, *, epoch: int, announced: int | None, issued: int = 0) -> None:
        """Make sure a stored mark covers ``version``: nothing to do when one does, else write one.

        Args:
            version: the number about to be taken (or reserved ahead).
            epoch: the writer's epoch.
            announced: the highest version announced and acknowledged so far (None: none).
            issued: the highest number the writer's counter issued: a newer stored mark more than one above
                it and ``version`` is unexplained (``rules.marks``) and does not count as covering.

        Raises:
            PublishError: no mark covering ``version`` could be stored (nothing may carry ``version``).
            BusError: the newest mark could not be read after a lost race.
            FencedError: the newest mark is above what the writer's chain explains, and another owner
                took the counter (its mark, not a forged one): nothing was stored.
        """
        if version <= self._covers:
            return
        mark = CounterHighWater(
            policy=self._policy,
            version=version,
            epoch=epoch,
            trainer_id=self._trainer_id,
            published_at=now(),
            incarnation=self._incarnation,
            announced=announced,
            standing=self.standing,
        )
        msg_id = f"{self._policy}:mark:{self._incarnation}:{version}"
        for _ in range(_WRITE_ATTEMPTS):
            try:
                ack = await self._bus.publish(self._subject, mark, msg_id=msg_id, expected_last_seq=self._seq)
            except SequenceConflictError:
                newest = await self.read()
                seen = max(issued, version)
                if newest is not None and not mark_explained(newest.version, seen, newest.announced):
                    # Unexplained by *our* chain: a forged mark, or a new owner's that a zombie's chain is too
                    # short to explain. Storing ours after a new owner's would lower the mark (a lower mark voids
                    # the ones before it), so a fenced writer stops here.
                    await self._confirm_owner()
                    log.error(
                        "the newest counter mark is above what this owner's chain explains (an unexplained mark); "
                        "storing ours after it",
                        extra={"policy": self._policy, "version": version, "mark": newest.version, "seen": seen},
                    )
                    self._covers = 0
                    continue
                if version <= self._covers:
                    log.info(
                        "another writer's mark already covers the number",
                        extra={"policy": self._policy, "version": version, "mark": newest and newest.version},
                    )
                    return
                continue
            self._seq, self._covers = ack.seq, version  # the newest mark now: ours
            return
        raise PublishError(self._subject, f"the counter's mark kept moving under {_WRITE_ATTEMPTS} writes")
