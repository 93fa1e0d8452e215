"""``NatsBus``: the ``Bus`` protocol over NATS JetStream (nats-py 2.16).

Invariants:

* One stream (``WEIGHTBUS`` by default) captures ``weightbus.>`` on file storage with a bounded
  history per subject; it is created idempotently (created, or updated to this configuration).
* Connecting never hangs: the initial connect is bounded by ``connect_timeout`` and fails with
  ``BusConnectError`` naming the URL. Once connected, the client reconnects forever and logs each
  transition.
* Every publish is a JetStream publish with a caller-chosen ``Nats-Msg-Id``; a timeout is retried
  with the same id, so a retry never stores a second event. A conditional publish uses
  ``Nats-Expected-Last-Subject-Sequence``; if a retry of a publish that did land reports a conflict,
  the stored message is recognised by its id and acknowledged as a duplicate.
* Subscriptions are ordered push consumers (no durable state on the server), which survive server
  restarts; payloads are decoded once in the subscription's iterator.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any, Final

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy, DiscardPolicy, StorageType, StreamConfig

from weightbus.bus._subscription import QueueSubscription
from weightbus.bus.metrics import BusMetrics
from weightbus.bus.protocol import Deliver, Envelope, PublishAck
from weightbus.bus.subjects import PREFIX
from weightbus.errors import BusConnectError, BusError, PublishError, SequenceConflictError
from weightbus.schemas.codec import Event, decode, encode

__all__ = ["DEFAULT_STREAM", "NatsBus", "connect"]

log = logging.getLogger("weightbus.bus")

DEFAULT_STREAM: Final = "WEIGHTBUS"
_WRONG_LAST_SEQUENCE: Final = 10071
_STREAM_NAME_IN_USE: Final = 10058
_DELIVER: Final = {
    Deliver.LAST_PER_SUBJECT: DeliverPolicy.LAST_PER_SUBJECT,
    Deliver.NEW: DeliverPolicy.NEW,
    Deliver.ALL: DeliverPolicy.ALL,
}


async def connect(
    url: str,
    *,
    name: str = "weightbus",
    metrics: BusMetrics | None = None,
    connect_timeout: float = 5.0,
    stream: str = DEFAULT_STREAM,
    history: int = 256,
    duplicate_window: float = 120.0,
    publish_timeout: float = 2.0,
    publish_attempts: int = 5,
    ensure_stream: bool = True,
) -> NatsBus:
    """Connect to NATS at ``url`` and ensure the weightbus stream exists.

    Args:
        url: a NATS URL (``nats://host:port``), or several separated by commas.
        name: the client name shown by the server.
        metrics: where invalid payloads are counted (a private registry when None).
        connect_timeout: the whole budget for the initial connect, in seconds.
        stream: the JetStream stream name.
        history: events kept per subject.
        duplicate_window: seconds during which a repeated ``Nats-Msg-Id`` is recognised.
        publish_timeout: seconds to wait for one publish acknowledgement.
        publish_attempts: publish tries on timeout (same ``Nats-Msg-Id`` each time).
        ensure_stream: create or update the stream (needs stream-management permission).

    Raises:
        BusConnectError: ``url`` names no server, nothing answered at it within ``connect_timeout``, or
            the stream could not be ensured.
    """
    client = NatsClient()
    closing = asyncio.Event()  # set by NatsBus.close, so a deliberate close is not logged as an outage
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        # nats-py would retry an empty server list forever at full CPU.
        raise BusConnectError(url, "no server URL given")

    async def _error(exc: Exception) -> None:
        log.debug("nats client error", extra={"error": repr(exc)})

    async def _disconnected() -> None:
        if not (closing.is_set() or client.is_closed):
            log.warning("disconnected from NATS; reconnecting", extra={"url": url})

    async def _reconnected() -> None:
        log.warning(
            "reconnected to NATS", extra={"url": client.connected_url.geturl() if client.connected_url else url}
        )

    async def _closed() -> None:
        log.info("NATS connection closed", extra={"url": url})

    try:
        await asyncio.wait_for(
            client.connect(
                servers=servers,
                name=name,
                error_cb=_error,
                disconnected_cb=_disconnected,
                reconnected_cb=_reconnected,
                closed_cb=_closed,
                connect_timeout=max(1, int(connect_timeout)),
                reconnect_time_wait=0.5,
                max_reconnect_attempts=-1,
                allow_reconnect=True,
            ),
            timeout=connect_timeout,
        )
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        await client.close()
        detail = "no answer" if isinstance(exc, TimeoutError) else repr(exc)
        raise BusConnectError(url, f"{detail} within {connect_timeout:g}s") from None
    bus = NatsBus(
        client,
        metrics=metrics,
        stream=stream,
        publish_timeout=publish_timeout,
        publish_attempts=publish_attempts,
        closing=closing,
    )
    if ensure_stream:
        try:
            await bus.ensure_stream(history=history, duplicate_window=duplicate_window)
        except BaseException:
            await client.close()
            raise
    return bus


class NatsBus:
    """A ``Bus`` over a connected nats-py client. Build it with ``weightbus.bus.nats.connect``."""

    def __init__(
        self,
        client: NatsClient,
        *,
        metrics: BusMetrics | None = None,
        stream: str = DEFAULT_STREAM,
        publish_timeout: float = 2.0,
        publish_attempts: int = 5,
        closing: asyncio.Event | None = None,
    ) -> None:
        self.client = client
        self._closing = closing if closing is not None else asyncio.Event()
        self.js: JetStreamContext = client.jetstream(timeout=publish_timeout)
        self.metrics = metrics if metrics is not None else BusMetrics()
        self.stream = stream
        self._publish_timeout = publish_timeout
        self._publish_attempts = max(1, publish_attempts)
        self._subs: list[QueueSubscription] = []

    async def ensure_stream(self, *, history: int = 256, duplicate_window: float = 120.0) -> None:
        """Create the stream, or update it to this configuration if it exists.

        Raises:
            BusConnectError: JetStream is not enabled, or another stream already captures ``weightbus.>``.
        """
        config = StreamConfig(
            name=self.stream,
            subjects=[f"{PREFIX}.>"],
            storage=StorageType.FILE,
            max_msgs_per_subject=history,
            discard=DiscardPolicy.OLD,
            duplicate_window=duplicate_window,
        )
        url = self._url()
        try:
            await self.js.add_stream(config)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != _STREAM_NAME_IN_USE:
                raise BusConnectError(url, f"cannot create stream {self.stream}: {exc.description}") from None
            try:
                await self.js.update_stream(config)
            except nats.js.errors.APIError as upd:
                raise BusConnectError(url, f"cannot update stream {self.stream}: {upd.description}") from None
        except nats.js.errors.ServiceUnavailableError:
            raise BusConnectError(url, "JetStream is not enabled on this server (start it with -js)") from None
        except nats.js.errors.APIError as exc:
            raise BusConnectError(url, f"cannot create stream {self.stream}: {exc.description}") from None
        except nats.errors.TimeoutError:
            raise BusConnectError(url, "JetStream did not answer (is it enabled?)") from None

    def _url(self) -> str:
        connected = self.client.connected_url
        return connected.geturl() if connected is not None else "nats"

    async def publish(
        self,
        subject: str,
        event: Event,
        *,
        msg_id: str,
        expected_last_seq: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> PublishAck:
        """Store ``event`` on ``subject``; see ``Bus.publish``."""
        return await self._publish(subject, encode(event), msg_id, expected_last_seq, headers)

    async def publish_raw(
        self, subject: str, data: bytes, *, msg_id: str, headers: Mapping[str, str] | None = None
    ) -> PublishAck:
        """Store an already-encoded payload; see ``Bus.publish_raw``."""
        return await self._publish(subject, data, msg_id, None, headers)

    async def _publish(
        self,
        subject: str,
        data: bytes,
        msg_id: str,
        expected: int | None,
        headers: Mapping[str, str] | None,
    ) -> PublishAck:
        hdrs: dict[str, Any] = {**(headers or {}), "Nats-Msg-Id": msg_id}
        if expected is not None:
            hdrs["Nats-Expected-Last-Subject-Sequence"] = str(expected)
        delay = 0.1
        for attempt in range(1, self._publish_attempts + 1):
            try:
                ack = await self.js.publish(subject, data, timeout=self._publish_timeout, headers=dict(hdrs))
                return PublishAck(ack.seq, bool(ack.duplicate))
            except nats.errors.TimeoutError:
                log.warning(
                    "publish timed out; retrying with the same Nats-Msg-Id",
                    extra={"subject": subject, "msg_id": msg_id, "attempt": attempt},
                )
            except nats.js.errors.NoStreamResponseError:
                raise PublishError(
                    subject, f"no JetStream stream captures this subject (expected {self.stream})"
                ) from None
            except nats.js.errors.APIError as exc:
                if exc.err_code == _WRONG_LAST_SEQUENCE and expected is not None:
                    # The server checks the expected sequence before deduplication, so a retry of a
                    # publish that did land reports a conflict: recognise our own message by its id.
                    landed = await self._landed(subject, msg_id)
                    if landed is not None:
                        return PublishAck(landed, duplicate=True)
                    raise SequenceConflictError(subject, expected) from None
                raise PublishError(subject, f"JetStream refused it: {exc.description or exc}") from None
            except nats.errors.ConnectionClosedError:
                raise PublishError(subject, "the NATS connection is closed") from None
            except nats.errors.OutboundBufferLimitError:
                log.warning(
                    "outbound buffer full while disconnected; retrying",
                    extra={"subject": subject, "msg_id": msg_id, "attempt": attempt},
                )
            if attempt < self._publish_attempts:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        raise PublishError(subject, f"no acknowledgement after {self._publish_attempts} attempts (msg id {msg_id!r})")

    async def _landed(self, subject: str, msg_id: str) -> int | None:
        """The sequence of the last message on ``subject`` if it carries ``msg_id`` (a retry that did land)."""
        try:
            raw = await self.js.get_last_msg(self.stream, subject)
        except nats.js.errors.NotFoundError:
            return None
        if raw.headers and raw.headers.get("Nats-Msg-Id") == msg_id:
            return int(raw.seq) if raw.seq is not None else None
        return None

    def subscribe(
        self, pattern: str, *, deliver: Deliver = Deliver.LAST_PER_SUBJECT, include_invalid: bool = False
    ) -> _NatsSubscription:
        """Subscribe to ``pattern`` with an ordered consumer; see ``Bus.subscribe``.

        The consumer is created lazily on the first ``__anext__`` (or ``await sub.start()``).
        """
        return _NatsSubscription(self, pattern, deliver, include_invalid)

    async def last_seq(self, subject: str) -> int:
        """The last stored sequence on ``subject``, whatever its payload; see ``Bus.last_seq``."""
        try:
            raw = await self.js.get_last_msg(self.stream, subject)
        except nats.js.errors.NotFoundError:
            return 0
        except nats.errors.TimeoutError:
            raise BusError(f"JetStream did not answer a read of the last sequence on {subject!r}") from None
        except (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError):
            raise BusError(f"JetStream is not enabled on {self._url()} (start the server with -js)") from None
        except nats.js.errors.APIError as exc:
            raise BusError(f"cannot read the last sequence on {subject!r}: {exc.description or exc}") from None
        return int(raw.seq or 0)

    async def last(self, subject: str) -> Envelope | None:
        """The latest stored event on ``subject``; see ``Bus.last``."""
        try:
            raw = await self.js.get_last_msg(self.stream, subject)
        except nats.js.errors.NotFoundError:
            return None
        except nats.errors.TimeoutError:
            raise BusError(f"JetStream did not answer a read of the last event on {subject!r}") from None
        except (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError):
            raise BusError(f"JetStream is not enabled on {self._url()} (start the server with -js)") from None
        except nats.js.errors.APIError as exc:
            raise BusError(f"JetStream refused a read of {subject!r}: {exc.description or exc}") from None
        except nats.errors.Error as exc:
            raise BusError(f"cannot read the last event on {subject!r}: {exc!r}") from None
        data = raw.data or b""
        headers = dict(raw.headers or {})
        return Envelope(subject, decode(subject, data), data, headers, raw.seq, time.time())

    async def close(self) -> None:
        """Close every subscription, then the connection."""
        self._closing.set()
        for sub in list(self._subs):
            await sub.close()
        if not self.client.is_closed:
            await self.client.close()


class _NatsSubscription(QueueSubscription):
    """A ``QueueSubscription`` fed by a JetStream ordered push consumer."""

    def __init__(self, bus: NatsBus, pattern: str, deliver: Deliver, include_invalid: bool = False) -> None:
        super().__init__(pattern, bus.metrics, on_close=self._unsubscribe, include_invalid=include_invalid)
        self._bus = bus
        self._deliver = deliver
        self._js_sub: Any = None
        self._start_lock = asyncio.Lock()

    async def start(self) -> _NatsSubscription:
        """Create the consumer now (otherwise on the first ``__anext__``)."""
        async with self._start_lock:
            if self._js_sub is not None:
                return self

            async def _on_msg(msg: Msg) -> None:
                seq: int | None = None
                try:
                    seq = msg.metadata.sequence.stream
                except (nats.errors.Error, AttributeError, ValueError):
                    seq = None
                self.offer(msg.subject, msg.data, msg.headers, seq)

            try:
                self._js_sub = await self._bus.js.subscribe(
                    self.pattern,
                    cb=_on_msg,
                    stream=self._bus.stream,
                    ordered_consumer=True,
                    idle_heartbeat=1.0,
                    deliver_policy=_DELIVER[self._deliver],
                )
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                raise BusError(f"cannot subscribe to {self.pattern!r}: {exc!r}") from None
            self._bus._subs.append(self)
        return self

    async def __anext__(self) -> Envelope:
        if self._js_sub is None:
            await self.start()
        return await super().__anext__()

    async def __aenter__(self) -> _NatsSubscription:
        return await self.start()

    async def _unsubscribe(self) -> None:
        sub, self._js_sub = self._js_sub, None
        if self in self._bus._subs:
            self._bus._subs.remove(self)
        if sub is not None and not self._bus.client.is_closed:
            try:
                await sub.unsubscribe()
            except nats.errors.Error as exc:
                log.debug("unsubscribe failed", extra={"pattern": self.pattern, "error": repr(exc)})
