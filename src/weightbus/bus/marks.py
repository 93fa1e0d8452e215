"""Reading a policy's counter high-water mark (``weightbus.<policy>.counter``) for the trainer, status and trackers.

An invalid newest payload falls back to the highest valid mark retained; a mark naming another policy is ignored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from weightbus.bus import subjects
from weightbus.bus.history import read_subject_history
from weightbus.bus.protocol import Bus
from weightbus.errors import InvalidEventError
from weightbus.schemas import CounterHighWater

__all__ = ["StoredMark", "read_high_water"]

log = logging.getLogger("weightbus.bus")


@dataclass(frozen=True, slots=True)
class StoredMark:
    """The newest mark read from the counter subject (``mark`` None: none stored) and the subject's last sequence."""

    mark: CounterHighWater | None
    seq: int


async def read_high_water(bus: Bus, policy: str) -> StoredMark:
    """One last-message read of ``counter(policy)``; the highest valid retained mark if the newest is not one.

    Raises:
        BusError: the bus did not answer.
    """
    subject = subjects.counter(policy)
    try:
        last = await bus.last(subject)
    except InvalidEventError as exc:
        log.warning(
            "the newest payload on the counter subject is not a valid mark; reading the retained marks",
            extra={"policy": policy, "error": str(exc)},
        )
        history = await read_subject_history(bus, subject)
        marks = [m for m in (_mark_of(e.event, policy) for e in history.events) if m is not None]
        return StoredMark(max(marks, key=lambda m: m.version, default=None), history.last_seq)
    if last is None:
        return StoredMark(None, 0)
    mark = _mark_of(last.event, policy)
    if mark is None or last.seq is None:
        log.warning("the newest mark names another policy; ignored", extra={"policy": policy})
        return StoredMark(None, await bus.last_seq(subject))
    return StoredMark(mark, last.seq)


def _mark_of(event: object, policy: str) -> CounterHighWater | None:
    return event if isinstance(event, CounterHighWater) and event.policy == policy else None
