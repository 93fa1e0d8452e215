"""``NatsBus``: the ``Bus`` protocol over NATS JetStream (nats-py 2.16).

Invariants:

* One stream (``WEIGHTBUS`` by default) captures ``weightbus.>`` on file storage with a bounded
  history per subject. Connecting creates it only when it is missing; an existing stream is checked and
  never changed (see ``weightbus.bus.stream``).
* Connecting never hangs: the initial connect is bounded by ``connect_timeout`` and fails with
  ``BusConnectError`` naming the URL (secrets redacted) and the cause (refused, DNS, auth, TLS, no
  JetStream). Once connected, the client reconnects forever and logs each transition.
* A permission refusal from the server surfaces as ``PermissionDeniedError`` on the operation it refused,
  not as a timeout.
* Every publish is a JetStream publish with a caller-chosen ``Nats-Msg-Id``; a timeout is retried
  with the same id, so a retry never stores a second event. A conditional publish uses
  ``Nats-Expected-Last-Subject-Sequence``; if a retry of a publish that did land reports a conflict,
  the stored message is recognised by its id and acknowledged as a duplicate.
* Subscriptions are ordered push consumers (no durable state on the server), which survive server
  restarts; payloads are decoded once in the subscription's iterator.
* ``close()`` returns and never raises, also while the server is unreachable: what nats-py buffered for a
  reconnection is dropped (it could not be delivered), and a socket that dies during the final flush is
  closed anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit

import nats
import nats.aio.client
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from weightbus.bus import stream as _stream
from weightbus.bus._denials import Denials
from weightbus.bus._subscription import QueueSubscription
from weightbus.bus.metrics import BusMetrics
from weightbus.bus.options import ConnectOptions, redact_url
from weightbus.bus.protocol import Deliver, Envelope, PublishAck
from weightbus.bus.stream import DEFAULT_DUPLICATE_WINDOW, DEFAULT_HISTORY, StreamRequirements
from weightbus.errors import BusConnectError, BusError, PublishError, SequenceConflictError
from weightbus.schemas.codec import Event, decode, encode

__all__ = ["DEFAULT_STREAM", "NatsBus", "connect"]

log = logging.getLogger("weightbus.bus")

DEFAULT_STREAM: Final = "WEIGHTBUS"
T = TypeVar("T")
_DEFINITE: Final = ("auth", "tls", "dns")
_WRONG_LAST_SEQUENCE: Final = 10071
# A JetStream delivery's reply subject:
#   $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ts>.<pending>  (9 tokens), or
# the 12-token form with a domain and an account hash after $JS.ACK (11 when the random token is absent).
_SEQ_TOKEN_V1: Final = 5
_SEQ_TOKEN_V2: Final = 7


def stream_seq(reply: str | None) -> int | None:
    """The stream sequence in a JetStream delivery's reply subject, or None for anything else.

    nats-py's ``msg.metadata`` builds a dataclass and a datetime per message; the tracker needs one int.
    """
    if not reply or not reply.startswith("$JS.ACK."):
        return None
    tokens = reply.split(".")
    n = len(tokens)
    index = _SEQ_TOKEN_V1 if n == 9 else _SEQ_TOKEN_V2 if n >= 11 else None
    if index is None:
        return None
    try:
        return int(tokens[index])
    except ValueError:
        return None


_DELIVER: Final = {
    Deliver.LAST_PER_SUBJECT: DeliverPolicy.LAST_PER_SUBJECT,
    Deliver.NEW: DeliverPolicy.NEW,
    Deliver.ALL: DeliverPolicy.ALL,
}


def _classify(exc: BaseException | None, redacted: str) -> tuple[str, str]:
    """``(cause, detail)`` of the last error seen while connecting, for ``BusConnectError``."""
    if exc is None or isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return "timeout", "no answer"
    if isinstance(exc, nats.errors.AuthorizationError) or "authorization" in str(exc).lower():
        return "auth", "authentication failed: the server refused these credentials (user, token, creds or NKEY)"
    if isinstance(exc, ssl.SSLError) or "tls" in str(exc).lower() or "ssl" in str(exc).lower():
        return "tls", f"TLS handshake failed: {exc}"
    if isinstance(exc, socket.gaierror):
        host = urlsplit(redacted.split(",")[0].strip()).hostname or redacted
        return "dns", f"DNS lookup failed for host {host!r} ({exc.strerror or exc})"
    if isinstance(exc, ConnectionRefusedError):
        return "refused", "connection refused (is nats-server running on that host and port?)"
    if isinstance(exc, OSError):
        return "refused", f"cannot open a connection: {exc.strerror or exc}"
    return "error", repr(exc)


async def connect(
    url: str,
    *,
    name: str = "weightbus",
    metrics: BusMetrics | None = None,
    connect_timeout: float = 5.0,
    stream: str = DEFAULT_STREAM,
    history: int = DEFAULT_HISTORY,
    duplicate_window: float = DEFAULT_DUPLICATE_WINDOW,
    publish_timeout: float = 2.0,
    publish_attempts: int = 5,
    ensure_stream: bool = True,
    options: ConnectOptions | None = None,
) -> NatsBus:
    """Connect to NATS at ``url``; create the weightbus stream if it is missing, else check it.

    Args:
        url: a NATS URL (``nats://host:port``, ``tls://host:port``), or several separated by commas.
        name: the client name shown by the server.
        metrics: where invalid payloads are counted (a private registry when None).
        connect_timeout: the whole budget for the initial connect, in seconds.
        stream: the JetStream stream name.
        history: events per subject this client needs the stream to keep (a stream with less is refused).
        duplicate_window: seconds this client needs a repeated ``Nats-Msg-Id`` to be recognised.
        publish_timeout: seconds to wait for one publish acknowledgement.
        publish_attempts: publish tries on timeout (same ``Nats-Msg-Id`` each time).
        ensure_stream: create the stream when missing and check it when present (an existing stream is
            never changed); False skips both.
        options: credentials, TLS and the replicas of a created stream; ``ConnectOptions.from_env()``
            (the ``WEIGHTBUS_*`` variables) when None.

    Raises:
        BusConnectError: ``url`` names no server, or NATS could not be reached or used; ``cause`` is
            ``refused``, ``dns``, ``auth``, ``tls``, ``no_jetstream``, ``timeout`` or ``stream``. Secrets are
            redacted from the message.
        StreamConfigError: the stream exists but does not fit weightbus (it is left unchanged).
        PermissionDeniedError: this user may not read (or create) the stream.
        BusConfigError: the options cannot work (a missing file, a password without a user).
    """
    opts = options if options is not None else ConnectOptions.from_env()
    shown = opts.redact(url, url)
    kwargs = opts.nats_kwargs()
    client = NatsClient()
    closing = asyncio.Event()  # set by NatsBus.close, so a deliberate close is not logged as an outage
    denials = Denials()
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        # nats-py would retry an empty server list forever at full CPU.
        raise BusConnectError(url, "no server URL given", "config")
    last_error: list[BaseException] = []
    fatal = asyncio.Event()

    async def _error(exc: Exception) -> None:
        text = str(exc)
        if denials.record(text):
            # A refusal a guarded operation was waiting for becomes its PermissionDeniedError, which the caller
            # reports; a warning as well would say it twice.
            level = logging.DEBUG if denials.last_caught else logging.WARNING
            log.log(level, "NATS refused an action (permissions)", extra={"error": opts.redact(text, url)})
            return
        if client.is_connecting or not client.is_connected:
            cause, _ = _classify(exc, shown)
            # Keep the most telling cause: the reset that follows a refused login must not hide it.
            if not last_error or _classify(last_error[0], shown)[0] not in _DEFINITE:
                last_error[:] = [exc]
            if cause in ("auth", "tls") and len(servers) == 1:
                fatal.set()
        log.debug("nats client error", extra={"error": opts.redact(repr(exc), url)})

    async def _disconnected() -> None:
        if not (closing.is_set() or client.is_closed):
            log.warning("disconnected from NATS; reconnecting", extra={"url": shown})

    async def _reconnected() -> None:
        now = client.connected_url.geturl() if client.connected_url else url
        log.warning("reconnected to NATS", extra={"url": opts.redact(now, url)})

    async def _closed() -> None:
        log.info("NATS connection closed", extra={"url": shown})

    attempt = asyncio.ensure_future(
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
            **kwargs,
        )
    )
    stop = asyncio.ensure_future(fatal.wait())
    try:
        await asyncio.wait({attempt, stop}, timeout=connect_timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    failure: BaseException | None = None
    if attempt.done() and not attempt.cancelled():
        failure = attempt.exception()
    else:
        attempt.cancel()
        await asyncio.gather(attempt, return_exceptions=True)  # reap it; an outer cancel still propagates
        failure = last_error[0] if last_error else TimeoutError()
    if failure is not None:
        with contextlib.suppress(Exception):
            await client.close()
        cause, detail = _classify(failure, shown)
        if cause == "timeout":
            detail = f"{detail} within {connect_timeout:g}s"
        raise BusConnectError(shown, opts.redact(detail, url), cause) from None
    bus = NatsBus(
        client,
        metrics=metrics,
        stream=stream,
        publish_timeout=publish_timeout,
        publish_attempts=publish_attempts,
        closing=closing,
        denials=denials,
        shown_url=shown,
    )
    if ensure_stream:
        try:
            await bus.ensure_stream(history=history, duplicate_window=duplicate_window, replicas=opts.replicas)
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
        denials: Denials | None = None,
        shown_url: str | None = None,
    ) -> None:
        self.client = client
        self._denials = denials if denials is not None else Denials()
        self._shown_url = shown_url
        self._closing = closing if closing is not None else asyncio.Event()
        self.js: JetStreamContext = client.jetstream(timeout=publish_timeout)
        self.metrics = metrics if metrics is not None else BusMetrics()
        self.stream = stream
        self._publish_timeout = publish_timeout
        self._publish_attempts = max(1, publish_attempts)
        self._subs: list[QueueSubscription] = []
        self.direct = False
        """Whether last-message reads use JetStream's direct get (the stream allows it; set on connect)."""

    async def ensure_stream(
        self,
        *,
        history: int = DEFAULT_HISTORY,
        duplicate_window: float = DEFAULT_DUPLICATE_WINDOW,
        replicas: int = 1,
    ) -> None:
        """Create the stream with ``replicas`` when it is missing; otherwise check it and leave it unchanged.

        Raises:
            StreamConfigError: the stream exists but does not fit weightbus (every mismatch is named).
            PermissionDeniedError: this user may not read or create the stream.
            BusConnectError: JetStream is not enabled, or the stream could not be read or created.
        """
        url = self._url()
        req = StreamRequirements(history=history, duplicate_window=duplicate_window)
        try:
            check = _stream.ensure_stream(self.js, self.stream, req, url=url, replicas=replicas)
            allowed = await self._denials.guard(Denials.api_or_inbox("$JS.API."), check)
            # With fast_mail_parser installed, nats-py 2.16 parses a direct get's headers into lists and fails
            # on Nats-Sequence; the stream-API read works with either header parser.
            self.direct = allowed and getattr(nats.aio.client, "parse_email", None) is None
        except nats.errors.TimeoutError:
            raise BusConnectError(url, "JetStream did not answer (is it enabled?)", "no_jetstream") from None

    async def guard(self, match: Callable[[str, str], bool], op: Awaitable[T]) -> T:
        """Run ``op``, raising ``PermissionDeniedError`` as soon as the server refuses a matching action."""
        return await self._denials.guard(match, op)

    def _url(self) -> str:
        if self._shown_url is not None:
            return self._shown_url
        connected = self.client.connected_url
        return redact_url(connected.geturl()) if connected is not None else "nats"

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
                ack = await self._denials.guard(
                    Denials.publish_to(subject),
                    self.js.publish(subject, data, timeout=self._publish_timeout, headers=dict(hdrs)),
                    subject=subject,
                )
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
            raw = await self.js.get_last_msg(self.stream, subject, direct=self.direct)
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
        """The last stored sequence on ``subject``, whatever its payload; see ``Bus.last_seq``.

        A read that times out is retried like a publish (``publish_attempts``), so a server restart or a
        leader election does not fail the fence's reads at once.
        """
        delay = 0.1
        for attempt in range(1, self._publish_attempts + 1):
            try:
                return await self._last_seq_once(subject)
            except nats.errors.TimeoutError:
                if attempt == self._publish_attempts:
                    break
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        raise BusError(f"JetStream did not answer a read of the last sequence on {subject!r}")

    async def _last_seq_once(self, subject: str) -> int:
        try:
            raw = await self.js.get_last_msg(self.stream, subject, direct=self.direct)
        except nats.js.errors.NotFoundError:
            return 0
        except (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError):
            raise BusError(f"JetStream is not enabled on {self._url()} (start the server with -js)") from None
        except nats.js.errors.APIError as exc:
            raise BusError(f"cannot read the last sequence on {subject!r}: {exc.description or exc}") from None
        return int(raw.seq or 0)

    async def last(self, subject: str) -> Envelope | None:
        """The latest stored event on ``subject``; see ``Bus.last``."""
        try:
            raw = await self.js.get_last_msg(self.stream, subject, direct=self.direct)
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
        """Close every subscription, then the connection; also while the server is unreachable (never raises)."""
        self._closing.set()
        for sub in list(self._subs):
            await sub.close()
        client = self.client
        if client.is_closed:
            return
        if not client.is_connected:
            # What nats-py buffered for a reconnection that will not happen now. Its close() would write it to the
            # lost socket, raise ConnectionResetError and skip the rest of its cleanup (subscription tasks, the
            # socket, the closed callback).
            _drop_buffered_writes(client)
        try:
            await client.close()
        except OSError as exc:  # the socket died between the check above and the write
            log.warning("NATS connection lost while closing; closed without flushing", extra={"error": repr(exc)})
            _drop_buffered_writes(client)
            client._status = NatsClient.CONNECTED  # so that a second close() runs nats-py's cleanup again
            try:
                await client.close()
            except OSError as again:
                log.warning("NATS connection could not be closed cleanly", extra={"error": repr(again)})


def _drop_buffered_writes(client: NatsClient) -> None:
    """Forget the commands nats-py buffered while disconnected (nats-py 2.16 keeps no other handle on them).

    A JetStream publish among them is not lost silently: it never reached the server, so its caller, waiting
    for the acknowledgement, gets an error or its timeout, never a success.
    """
    if client._pending_data_size:
        log.info("dropping commands buffered for a reconnection", extra={"bytes": client._pending_data_size})
    client._pending = []
    client._pending_data_size = 0


class _NatsSubscription(QueueSubscription):
    """A ``QueueSubscription`` fed by a JetStream ordered push consumer."""

    def __init__(self, bus: NatsBus, pattern: str, deliver: Deliver, include_invalid: bool = False) -> None:
        super().__init__(pattern, bus.metrics, on_close=self._unsubscribe, include_invalid=include_invalid)
        self._bus = bus
        self._deliver = deliver
        self._js_sub: Any = None
        self._inner: Any = None
        self._start_lock = asyncio.Lock()

    async def start(self) -> _NatsSubscription:
        """Create the consumer now (otherwise on the first ``__anext__``)."""
        async with self._start_lock:
            if self._js_sub is not None:
                return self

            try:
                # No callback: nats-py then queues each delivery (after its ordered-consumer checks) on the
                # subscription's own pending queue, which this iterator reads directly. A callback would add
                # a task switch per event (nats-py's callback task, then ours). Unbounded on nats-py's side,
                # so it never drops a delivery the ordered consumer already counted; ``max_pending`` is
                # enforced here instead (SlowConsumerError on the next read).
                self._js_sub = await self._bus.guard(
                    Denials.api_or_inbox("$JS.API."),
                    self._bus.js.subscribe(
                        self.pattern,
                        stream=self._bus.stream,
                        ordered_consumer=True,
                        idle_heartbeat=1.0,
                        deliver_policy=_DELIVER[self._deliver],
                        pending_msgs_limit=0,
                        pending_bytes_limit=0,
                    ),
                )
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                raise BusError(f"cannot subscribe to {self.pattern!r}: {exc!r}") from None
            inner = self._js_sub._sub
            pending: asyncio.Queue[object] = inner._pending_queue
            while not self._queue.empty():  # a close or failure that came before the subscription
                pending.put_nowait(self._queue.get_nowait())
            self._inner = inner
            self._queue = pending
            self._bus._subs.append(self)
        return self

    def _unpack(self, item: object) -> tuple[str, bytes, Mapping[str, str] | None, int | None, float]:
        msg: Msg = item  # type: ignore[assignment]
        data = msg.data
        self._inner._pending_size -= len(data)  # nats-py's own accounting, as its callback task would do
        return msg.subject, data, msg.headers, stream_seq(msg.reply), time.time()

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
