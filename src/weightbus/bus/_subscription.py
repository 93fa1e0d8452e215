"""The bounded queue behind every subscription: decoding at the boundary, counting invalid payloads.

An invalid payload is logged, counted and skipped, never ending the subscription; a full queue raises
``SlowConsumerError`` on the next read, never drops silently.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

from weightbus.bus.metrics import BusMetrics
from weightbus.bus.protocol import Envelope, Skipped
from weightbus.errors import InvalidEventError, SlowConsumerError
from weightbus.schemas.codec import decode

__all__ = ["QueueSubscription"]

log = logging.getLogger("weightbus.bus")

_CLOSED: Final = object()


class QueueSubscription:
    """A typed async iterator over a bounded queue of raw messages."""

    def __init__(
        self,
        pattern: str,
        metrics: BusMetrics,
        *,
        max_pending: int = 10_000,
        on_close: Callable[[], Awaitable[None]] | None = None,
        include_invalid: bool = False,
    ) -> None:
        self.pattern = pattern
        self.include_invalid = include_invalid
        self._metrics = metrics
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._max_pending = max_pending
        self._overflowed = False
        self._closed = False
        self._on_close = on_close
        self._error: BaseException | None = None

    def offer(self, subject: str, data: bytes, headers: Mapping[str, str] | None, seq: int | None) -> None:
        """Queue one raw message (called by the transport, never blocks)."""
        if self._closed:
            return
        queue = self._queue
        if queue.qsize() >= self._max_pending:
            self._overflowed = True
            return
        queue.put_nowait((subject, data, headers, seq, time.time()))

    def fail(self, exc: BaseException) -> None:
        """End the iteration with ``exc`` (a transport failure the caller must see)."""
        self._error = exc
        self._queue.put_nowait(_CLOSED)

    def __aiter__(self) -> QueueSubscription:
        return self

    def _unpack(self, item: object) -> tuple[str, bytes, Mapping[str, str] | None, int | None, float]:
        """``(subject, data, headers, seq, received_at)`` of one queued item (a transport may queue its own type)."""
        return item  # type: ignore[return-value]

    async def __anext__(self) -> Envelope:  # or Skipped, with include_invalid
        while True:
            queue = self._queue
            if self._overflowed or queue.qsize() > self._max_pending:
                self._overflowed = False
                raise SlowConsumerError(self.pattern, self._max_pending)
            item = await queue.get()
            if item is _CLOSED:
                queue.put_nowait(_CLOSED)
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            subject, data, raw_headers, seq, received_at = self._unpack(item)
            headers = dict(raw_headers) if raw_headers else {}
            try:
                event = decode(subject, data)
            except InvalidEventError as exc:
                self._metrics.invalid_events.labels(exc.family, exc.reason).inc()
                log.warning(
                    "invalid event skipped",
                    extra={"subject": subject, "family": exc.family, "reason": exc.reason, "detail": exc.detail},
                )
                if self.include_invalid:
                    return Skipped(subject, data, exc, headers, seq, received_at)  # type: ignore[return-value]
                continue
            return Envelope(subject, event, data, headers, seq, received_at)

    async def aclose(self) -> None:
        """Stop receiving; a pending ``__anext__`` ends with StopAsyncIteration."""
        if self._closed:
            return
        self._closed = True
        self._queue.put_nowait(_CLOSED)
        if self._on_close is not None:
            await self._on_close()

    async def __aenter__(self) -> QueueSubscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
