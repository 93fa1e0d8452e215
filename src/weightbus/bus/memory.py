"""``MemoryBus``: an in-process bus with the same contract as the NATS JetStream bus.

It passes the same contract suite through the same codec, so a test on it exercises the real encode and decode.
See docs/events.md#the-bus-interface.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Mapping

from weightbus.bus._subscription import QueueSubscription
from weightbus.bus.metrics import BusMetrics
from weightbus.bus.protocol import Deliver, Envelope, PublishAck
from weightbus.bus.subjects import matches
from weightbus.errors import BusError, SequenceConflictError
from weightbus.schemas.codec import Event, decode, encode

__all__ = ["MemoryBus"]


class MemoryBus:
    """An in-memory ``Bus``.

    Args:
        metrics: where invalid payloads are counted (a private registry if None).
        history: events kept per subject (like the stream's ``max_msgs_per_subject``).
        dedup_window: how many recent ``msg_id`` values are remembered for deduplication.
    """

    def __init__(self, metrics: BusMetrics | None = None, *, history: int = 256, dedup_window: int = 100_000) -> None:
        self.metrics = metrics if metrics is not None else BusMetrics()
        self._history = history
        self._seq = 0
        self._by_subject: dict[str, deque[tuple[int, bytes, dict[str, str]]]] = {}
        self._last_seq: dict[str, int] = {}
        self._msg_ids: OrderedDict[str, int] = OrderedDict()
        self._dedup_window = dedup_window
        self._subs: list[QueueSubscription] = []
        self._closed = False

    async def publish(
        self,
        subject: str,
        event: Event,
        *,
        msg_id: str,
        expected_last_seq: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> PublishAck:
        """Store ``event``; see ``Bus.publish``."""
        return self._store(subject, encode(event), msg_id, expected_last_seq, headers)

    async def publish_raw(
        self, subject: str, data: bytes, *, msg_id: str, headers: Mapping[str, str] | None = None
    ) -> PublishAck:
        """Store an already-encoded payload; see ``Bus.publish_raw``."""
        return self._store(subject, data, msg_id, None, headers)

    def _store(
        self, subject: str, data: bytes, msg_id: str, expected: int | None, headers: Mapping[str, str] | None
    ) -> PublishAck:
        if self._closed:
            raise BusError("the memory bus is closed")
        if "*" in subject or ">" in subject:
            raise ValueError(f"cannot publish to a wildcard subject: {subject!r}")
        if expected is not None and self._last_seq.get(subject, 0) != expected:
            # Same order as JetStream: the expected sequence is checked before deduplication, and a
            # conflict caused by our own earlier publish of this id is a duplicate, not a conflict.
            ring = self._by_subject.get(subject)
            if ring and ring[-1][2].get("Nats-Msg-Id") == msg_id:
                return PublishAck(ring[-1][0], duplicate=True)
            raise SequenceConflictError(subject, expected)
        if msg_id in self._msg_ids:
            return PublishAck(self._msg_ids[msg_id], duplicate=True)
        self._seq += 1
        hdrs = {**(headers or {}), "Nats-Msg-Id": msg_id}
        ring = self._by_subject.setdefault(subject, deque(maxlen=self._history))
        ring.append((self._seq, data, hdrs))
        self._last_seq[subject] = self._seq
        self._msg_ids[msg_id] = self._seq
        if len(self._msg_ids) > self._dedup_window:
            self._msg_ids.popitem(last=False)
        for sub in self._subs:
            if matches(sub.pattern, subject):
                sub.offer(subject, data, hdrs, self._seq)
        return PublishAck(self._seq)

    def subscribe(
        self,
        pattern: str,
        *,
        deliver: Deliver = Deliver.LAST_PER_SUBJECT,
        include_invalid: bool = False,
        transient: bool = False,
    ) -> QueueSubscription:
        """Subscribe to ``pattern``; stored events are queued first according to ``deliver`` (``transient``: no-op)."""
        sub: QueueSubscription

        async def _remove() -> None:
            if sub in self._subs:
                self._subs.remove(sub)

        sub = QueueSubscription(pattern, self.metrics, on_close=_remove, include_invalid=include_invalid)
        stored: list[tuple[int, str, bytes, dict[str, str]]] = []
        if deliver is not Deliver.NEW:
            for subject, ring in self._by_subject.items():
                if not matches(pattern, subject) or not ring:
                    continue
                entries = [ring[-1]] if deliver is Deliver.LAST_PER_SUBJECT else list(ring)
                stored.extend((seq, subject, data, hdrs) for seq, data, hdrs in entries)
        for seq, subject, data, hdrs in sorted(stored, key=lambda item: item[0]):
            sub.offer(subject, data, hdrs, seq)
        self._subs.append(sub)
        return sub

    async def last(self, subject: str) -> Envelope | None:
        """The latest stored event on ``subject``; see ``Bus.last``."""
        ring = self._by_subject.get(subject)
        if not ring:
            return None
        seq, data, hdrs = ring[-1]
        return Envelope(subject, decode(subject, data), data, hdrs, seq, time.time())

    async def last_seq(self, subject: str) -> int:
        """The last stored sequence on ``subject``; see ``Bus.last_seq``."""
        ring = self._by_subject.get(subject)
        return ring[-1][0] if ring else 0

    def purge(self, subject: str) -> None:
        """Remove every stored event of ``subject`` (as an operator's stream purge would); for tests."""
        self._by_subject.pop(subject, None)
        self._last_seq.pop(subject, None)

    async def __aenter__(self) -> MemoryBus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """End every open subscription."""
        self._closed = True
        for sub in list(self._subs):
            await sub.aclose()
        self._subs.clear()
