"""Reading a subject's retained history in one pass: every valid event, oldest first, and where it ends.

It ends at the ``last_seq`` read before subscribing, whatever that payload is (garbage is counted and skipped); a bus
that does not deliver up to it within ``timeout`` raises ``BusError``, never returns a partial history.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from weightbus.bus.protocol import Bus, Deliver, Envelope, Skipped
from weightbus.errors import BusError, InvalidEventError

__all__ = ["History", "read_subject_history"]


@dataclass(frozen=True, slots=True)
class History:
    """The retained history of one subject.

    Attributes:
        subject: the subject read.
        events: every valid event, oldest first.
        invalid: how many stored payloads failed the typed decode (skipped).
        last_seq: the subject's last stored sequence when the read began (0: nothing stored).
        invalid_seqs: the sequences of the skipped payloads.
        last_error: the decode error of the newest skipped payload, if any.
    """

    subject: str
    events: list[Envelope] = field(default_factory=list)
    invalid: int = 0
    last_seq: int = 0
    invalid_seqs: list[int] = field(default_factory=list)
    last_error: InvalidEventError | None = None

    @property
    def last_valid(self) -> Envelope | None:
        """The newest valid event, or None when there is none."""
        return self.events[-1] if self.events else None

    @property
    def empty(self) -> bool:
        """Whether nothing at all is stored on the subject (not even garbage)."""
        return self.last_seq == 0


async def read_subject_history(bus: Bus, subject: str, *, timeout: float = 10.0) -> History:
    """Read every retained event of ``subject`` up to its current last sequence.

    Args:
        bus: the bus.
        subject: one subject (no wildcards).
        timeout: seconds the whole read may take.

    Raises:
        BusError: the bus did not answer, or did not deliver the history within ``timeout``.
    """
    last_seq = await bus.last_seq(subject)
    if last_seq == 0:
        return History(subject)
    events: list[Envelope] = []
    invalid_seqs: list[int] = []
    last_error: InvalidEventError | None = None
    try:
        async with asyncio.timeout(timeout):
            async with bus.subscribe(subject, deliver=Deliver.ALL, include_invalid=True, transient=True) as sub:
                async for item in sub:
                    if isinstance(item, Skipped):
                        last_error = item.error
                        if item.seq is not None:
                            invalid_seqs.append(item.seq)
                    else:
                        events.append(item)
                    if item.seq is None or item.seq >= last_seq:
                        break
    except TimeoutError:
        raise BusError(f"the history of {subject!r} was not delivered within {timeout:g}s") from None
    return History(subject, events, len(invalid_seqs), last_seq, invalid_seqs, last_error)
