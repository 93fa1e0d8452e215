"""The ``Bus`` protocol: the one seam between weightbus logic and a message transport.

Every implementation keeps: one event per ``msg_id``; ``expected_last_seq`` makes a publish conditional (a lost race
raises ``SequenceConflictError``, stores nothing); invalid payloads are skipped; ``last_seq`` ignores payloads.
See docs/events.md#the-bus-interface.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

import msgspec

from weightbus.errors import InvalidEventError
from weightbus.schemas.codec import Event

__all__ = ["Bus", "Deliver", "Envelope", "PublishAck", "Skipped", "Subscription"]


class Deliver(StrEnum):
    """Where a subscription starts."""

    LAST_PER_SUBJECT = "last_per_subject"
    """The latest stored event of each matching subject, then live events."""
    NEW = "new"
    """Only events published after the subscription started."""
    ALL = "all"
    """Every stored event (bounded by the stream's per-subject history), then live events."""


@dataclass(frozen=True, slots=True)
class PublishAck:
    """The bus's confirmation of a stored event: its stream sequence, and whether it was a duplicate."""

    seq: int
    duplicate: bool = False


class Envelope(msgspec.Struct, frozen=True):
    """One received event with its transport metadata.

    Attributes:
        subject: the subject it was published on.
        event: the decoded, typed event.
        data: the raw payload (what ``record`` writes).
        headers: the message headers (``Nats-Msg-Id`` among them).
        seq: the stream sequence (None when the transport has none).
        received_at: local Unix time of receipt.
    """

    subject: str
    event: Event
    data: bytes
    headers: Mapping[str, str] = msgspec.field(default_factory=dict)
    seq: int | None = None
    received_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Skipped:
    """A stored or live payload that failed the typed decode (yielded only with ``include_invalid=True``).

    Attributes:
        subject: the subject it arrived on.
        data: the raw payload.
        error: why it failed (``reason`` ``malformed``, ``invalid``, ``oversized``, ...).
        headers: its headers.
        seq: its stream sequence (None when the transport has none).
        received_at: local Unix time of receipt.
    """

    subject: str
    data: bytes
    error: InvalidEventError
    headers: Mapping[str, str] = field(default_factory=dict)
    seq: int | None = None
    received_at: float = 0.0


@runtime_checkable
class Subscription(Protocol):
    """An async iterator of envelopes; ``aclose()`` (or ``async with``) ends it."""

    def __aiter__(self) -> AsyncIterator[Envelope]: ...

    async def __anext__(self) -> Envelope: ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Subscription: ...

    async def __aexit__(self, *exc: object) -> None: ...


@runtime_checkable
class Bus(Protocol):
    """Publish typed events durably and subscribe to them as typed async iterators."""

    async def publish(
        self,
        subject: str,
        event: Event,
        *,
        msg_id: str,
        expected_last_seq: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> PublishAck:
        """Store ``event`` on ``subject``.

        Raises:
            SequenceConflictError: ``expected_last_seq`` did not match; nothing was stored.
            PublishError: the bus refused the event or could not confirm it after its retries.
        """
        ...

    async def publish_raw(
        self, subject: str, data: bytes, *, msg_id: str, headers: Mapping[str, str] | None = None
    ) -> PublishAck:
        """Store an already-encoded payload (replay); it is not validated here, subscribers decode it."""
        ...

    def subscribe(
        self,
        pattern: str,
        *,
        deliver: Deliver = Deliver.LAST_PER_SUBJECT,
        include_invalid: bool = False,
        transient: bool = False,
    ) -> Subscription:
        """Subscribe to ``pattern`` (NATS wildcards ``*`` and ``>`` allowed).

        The subscription is live (every later publish reaches it) once ``async with`` has entered it
        or its first ``__anext__`` has begun. With ``include_invalid`` it also yields ``Skipped`` for
        payloads that fail the decode (they are counted either way). ``transient``: a short read (a
        subject's history) whose server-side state, if any, is dropped soon after it closes.
        """
        ...

    async def last_seq(self, subject: str) -> int:
        """The last stored sequence on ``subject`` (no wildcards), whatever its payload; 0 when none.

        Raises:
            BusError: the bus did not answer.
        """
        ...

    async def last(self, subject: str) -> Envelope | None:
        """The latest stored event on ``subject`` (no wildcards), or None if there is none.

        Raises:
            InvalidEventError: the stored payload is not a valid event.
        """
        ...

    async def aclose(self) -> None:
        """Release the connection; open subscriptions end."""
        ...

    async def __aenter__(self) -> Bus:
        """``async with`` closes the bus on leaving (``aclose``)."""
        ...

    async def __aexit__(self, *exc: object) -> None: ...
