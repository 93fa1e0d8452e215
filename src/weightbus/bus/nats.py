"""``NatsBus``: the ``Bus`` protocol over NATS JetStream (nats-py 2.16).

A timed-out publish is retried with the same ``Nats-Msg-Id`` (a conflict over its own message is a duplicate); a
deleted stream is ``StreamNotFoundError``; ``close()`` never raises and ends every client task. See ``bus._natspy``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg

from weightbus.backoff import Backoff, retry_async
from weightbus.bus import _natspy
from weightbus.bus import stream as _stream
from weightbus.bus._cancel import honouring_cancel
from weightbus.bus._connection import open_link
from weightbus.bus._denials import Denials
from weightbus.bus._nats_subscription import NatsSubscription, stream_seq  # noqa: F401 (importable from here)
from weightbus.bus.metrics import BusMetrics
from weightbus.bus.options import ConnectOptions, redact_url
from weightbus.bus.protocol import Deliver, Envelope, PublishAck
from weightbus.bus.stream import DEFAULT_DUPLICATE_WINDOW, DEFAULT_HISTORY, StreamRequirements
from weightbus.errors import BusConnectError, BusError, PublishError, SequenceConflictError, StreamNotFoundError
from weightbus.schemas.codec import Event, decode, encode

__all__ = ["CLOSE_TASKS_BOUND", "DEFAULT_STREAM", "NatsBus", "connect"]

log = logging.getLogger("weightbus.bus")

DEFAULT_STREAM: Final = "WEIGHTBUS"
CLOSE_TASKS_BOUND: Final = 2.0
"""Seconds ``NatsBus.aclose()`` spends ending the client's tasks once nats-py's own close has returned."""

T = TypeVar("T")
_WRONG_LAST_SEQUENCE: Final = 10071
_STREAM_NOT_FOUND: Final = 10059
_NO_JETSTREAM_ANSWER = (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError)

#: What a publish retries (nothing answered in time, or the client's buffer is full while it reconnects).
_UNANSWERED: Final = (nats.errors.TimeoutError, nats.errors.OutboundBufferLimitError)


def _unanswered(exc: Exception) -> bool:
    return isinstance(exc, _UNANSWERED)


def _timed_out(exc: Exception) -> bool:
    return isinstance(exc, nats.errors.TimeoutError)


# Kept importable from here (tests and older callers).
_NatsSubscription = NatsSubscription


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
            (the ``WEIGHTBUS_*`` variables, then the ``NATS_*`` ones and ``NATS_CONTEXT``) when None.

    Raises:
        BusConnectError: ``url`` names no server, or NATS could not be reached or used; ``cause`` is
            ``refused``, ``dns``, ``auth``, ``tls``, ``no_jetstream``, ``timeout`` or ``stream``. Secrets are
            redacted from the message.
        StreamConfigError: the stream exists but does not fit weightbus (it is left unchanged).
        PermissionDeniedError: this user may not read (or create) the stream.
        BusConfigError: the options cannot work (a missing file, a password without a user).
    """
    opts = options if options is not None else ConnectOptions.from_env()
    link = await open_link(url, name=name, connect_timeout=connect_timeout, opts=opts)
    bus = NatsBus(
        link.client,
        metrics=metrics,
        stream=stream,
        publish_timeout=publish_timeout,
        publish_attempts=publish_attempts,
        closing=link.closing,
        denials=link.denials,
        shown_url=link.shown,
    )
    if ensure_stream:
        try:
            await bus.ensure_stream(history=history, duplicate_window=duplicate_window, replicas=opts.replicas)
        except BaseException:
            await bus.aclose()
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
        self._retries = Backoff(first_s=0.1, cap_s=2.0, attempts=self._publish_attempts)
        self.subscriptions: list[NatsSubscription] = []
        """The live subscriptions (each adds and removes itself), ended by ``close``."""
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
            self.direct = allowed and _natspy.direct_get_supported()
        except nats.errors.TimeoutError:
            raise BusConnectError(url, "JetStream did not answer (is it enabled?)", "no_jetstream") from None

    async def check_stream(self, req: StreamRequirements) -> tuple[str, list[str]]:
        """Read the stream, changing nothing: its configuration in one line, and every way it fails ``req``.

        Raises:
            StreamNotFoundError: the stream does not exist.
            PermissionDeniedError: this user may not read it.
            BusConnectError: JetStream is not enabled (``cause`` ``no_jetstream``) or refused the read (``stream``).
        """
        url = self._url()
        try:
            check = _stream.check(self.js, self.stream, req, url=url)
            info, problems = await self.guard(lambda action, subject: True, check)
        except nats.errors.TimeoutError:
            raise BusConnectError(url, "JetStream did not answer (is it enabled?)", "no_jetstream") from None
        return _stream.describe(info), problems

    async def create_or_upgrade_stream(
        self, req: StreamRequirements, *, replicas: int, deny_delete: bool = True, deny_purge: bool = True
    ) -> tuple[str, str]:
        """The admin action: create the stream, or upgrade it to ``req`` (``weightbus.bus.stream.create_or_upgrade``).

        Returns:
            ``("created" | "upgraded" | "unchanged", the resulting configuration in one line)``.

        Raises:
            PermissionDeniedError: this user may not create or update the stream.
            BusConnectError: the server refused the change (``cause`` ``stream``), or JetStream is not enabled.
        """
        url = self._url()
        change = _stream.create_or_upgrade(
            self.js, self.stream, req, replicas=replicas, deny_delete=deny_delete, deny_purge=deny_purge, url=url
        )
        try:
            outcome, info = await self.guard(lambda action, subject: True, change)
        except nats.errors.TimeoutError:
            raise BusConnectError(url, "JetStream did not answer (is it enabled?)", "no_jetstream") from None
        return outcome, _stream.describe(info)

    async def guard(self, match: Callable[[str, str], bool], op: Awaitable[T], *, subject: str | None = None) -> T:
        """Run ``op``, raising ``PermissionDeniedError`` as soon as the server refuses a matching action.

        ``subject`` is the name the error gives (the caller's spelling: nats-py lower-cases the server's text).
        """
        return await self._denials.guard(match, op, subject=subject)

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

        async def once() -> PublishAck:
            try:
                ack = await self._denials.guard(
                    Denials.publish_to(subject),
                    self.js.publish(subject, data, timeout=self._publish_timeout, headers=dict(hdrs)),
                    subject=subject,
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
            return PublishAck(ack.seq, bool(ack.duplicate))

        def retrying(exc: Exception, attempt: int, wait: float) -> None:
            what = (
                "outbound buffer full while disconnected; retrying"
                if isinstance(exc, nats.errors.OutboundBufferLimitError)
                else "publish timed out; retrying with the same Nats-Msg-Id"
            )
            log.warning(what, extra={"subject": subject, "msg_id": msg_id, "attempt": attempt, "retry_in": wait})

        try:
            return await retry_async(once, self._retries, retry_on=_unanswered, on_retry=retrying)
        except _UNANSWERED:
            raise PublishError(
                subject, f"no acknowledgement after {self._publish_attempts} attempts (msg id {msg_id!r})"
            ) from None

    async def _landed(self, subject: str, msg_id: str) -> int | None:
        """The sequence of the last message on ``subject`` if it carries ``msg_id`` (a retry that did land)."""
        try:
            raw = await self._read_last(subject)
        except nats.errors.Error as exc:
            raise PublishError(subject, f"conflict reported, and the last message could not be read: {exc!r}") from None
        if raw is not None and raw.headers and raw.headers.get("Nats-Msg-Id") == msg_id:
            return int(raw.seq) if raw.seq is not None else None
        return None

    def subscribe(
        self,
        pattern: str,
        *,
        deliver: Deliver = Deliver.LAST_PER_SUBJECT,
        include_invalid: bool = False,
        transient: bool = False,
    ) -> NatsSubscription:
        """Subscribe to ``pattern`` with an ordered consumer; see ``Bus.subscribe``.

        The consumer is created lazily on the first ``__anext__`` (or ``await sub.start()``). A
        ``transient`` one is deleted by the server about ``TRANSIENT_INACTIVE`` seconds after it closes,
        not the 5 s JetStream keeps an ephemeral consumer by default.
        """
        return NatsSubscription(self, pattern, deliver, include_invalid, transient=transient)

    async def last_seq(self, subject: str) -> int:
        """The last stored sequence on ``subject``, whatever its payload; see ``Bus.last_seq``.

        A read that times out is retried like a publish (``publish_attempts``), so a server restart or a
        leader election does not fail the fence's reads at once.

        Raises:
            StreamNotFoundError: the stream was deleted (seen on a bus that reads with direct gets).
            BusError: JetStream did not answer, is not enabled, or refused the read.
        """
        try:
            return await retry_async(lambda: self._last_seq_once(subject), self._retries, retry_on=_timed_out)
        except nats.errors.TimeoutError:
            raise BusError(f"JetStream did not answer a read of the last sequence on {subject!r}") from None

    async def _last_seq_once(self, subject: str) -> int:
        try:
            raw = await self._read_last(subject)
        except nats.errors.TimeoutError:
            raise  # retried by last_seq
        except nats.js.errors.APIError as exc:
            raise BusError(f"cannot read the last sequence on {subject!r}: {exc.description or exc}") from None
        except nats.errors.Error as exc:
            raise BusError(f"cannot read the last sequence on {subject!r}: {exc!r}") from None
        return int(raw.seq or 0) if raw is not None else 0

    async def last(self, subject: str) -> Envelope | None:
        """The latest stored event on ``subject``; see ``Bus.last``."""
        try:
            raw = await self._read_last(subject)
        except nats.errors.TimeoutError:
            raise BusError(f"JetStream did not answer a read of the last event on {subject!r}") from None
        except nats.js.errors.APIError as exc:
            raise BusError(f"JetStream refused a read of {subject!r}: {exc.description or exc}") from None
        except nats.errors.Error as exc:
            raise BusError(f"cannot read the last event on {subject!r}: {exc!r}") from None
        if raw is None:
            return None
        data = raw.data or b""
        headers = dict(raw.headers or {})
        return Envelope(subject, decode(subject, data), data, headers, raw.seq, time.time())

    async def _read_last(self, subject: str) -> RawStreamMsg | None:
        """The last stored message on ``subject``, None when there is none (a timeout or refusal is the caller's).

        Raises:
            StreamNotFoundError: a direct get found no stream to answer it, and the stream API says it is gone.
            BusError: JetStream is not enabled.
        """
        try:
            return await honouring_cancel(self.js.get_last_msg(self.stream, subject, direct=self.direct))
        except nats.js.errors.NotFoundError:
            return None
        except _NO_JETSTREAM_ANSWER:
            if not self.direct:
                raise BusError(f"JetStream is not enabled on {self._url()} (start the server with -js)") from None
        # Nobody answers a direct get when the stream is gone as when JetStream is off: ask the stream API.
        await self._explain_unanswered_direct_get()
        return await self._read_last(subject)

    async def _explain_unanswered_direct_get(self) -> None:
        """Raise what an unanswered direct get means; return when the stream now refuses direct gets (read on).

        Raises:
            StreamNotFoundError: the stream does not exist (deleted).
            BusError: JetStream is not enabled, or the stream allows direct gets and still none answered.
        """
        url = self._url()
        try:
            info = await honouring_cancel(self.js.stream_info(self.stream))
        except nats.js.errors.NotFoundError:
            raise StreamNotFoundError(url, self.stream) from None
        except _NO_JETSTREAM_ANSWER:
            raise BusError(f"JetStream is not enabled on {url} (start the server with -js)") from None
        except nats.js.errors.APIError as exc:
            if exc.err_code == _STREAM_NOT_FOUND:
                raise StreamNotFoundError(url, self.stream) from None
            raise BusError(f"cannot read stream {self.stream} on {url}: {exc.description or exc}") from None
        if info.config.allow_direct:
            raise BusError(f"no server answered a direct get on stream {self.stream} at {url}")
        log.warning("the stream no longer allows direct gets; reading through the stream API", extra={"url": url})
        self.direct = False

    async def __aenter__(self) -> NatsBus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every subscription, then the connection; also while the server is unreachable (never raises).

        When it returns, every task the client started has ended (or, past ``CLOSE_TASKS_BOUND`` seconds, is
        logged as still running).
        """
        self._closing.set()
        for sub in list(self.subscriptions):
            await sub.aclose()
        client = self.client
        started = _natspy.client_tasks(client)  # nats-py's close() forgets its subscriptions: list them first
        await self._close_client()
        left = await _natspy.end_tasks([*started, *_natspy.client_tasks(client)], CLOSE_TASKS_BOUND)
        if not client.is_closed:
            # The reconnection task got past a swallowed cancel and set a reconnecting status: close again, now
            # that no task of the client runs any more.
            await self._close_client()
            left = await _natspy.end_tasks([*left, *_natspy.client_tasks(client)], CLOSE_TASKS_BOUND)
        if left:
            log.warning("nats-py tasks still running after close", extra={"tasks": [t.get_name() for t in left]})

    async def _close_client(self) -> None:
        client = self.client
        if client.is_closed:
            return
        if not client.is_connected:
            # What nats-py buffered for a reconnection that will not happen now. Its close() would write it to the
            # lost socket, raise ConnectionResetError and skip the rest of its cleanup (subscription tasks, the
            # socket, the closed callback).
            self._drop_buffered_writes()
        try:
            await client.close()
        except OSError as exc:  # the socket died between the check above and the write
            log.warning("NATS connection lost while closing; closed without flushing", extra={"error": repr(exc)})
            self._drop_buffered_writes()
            _natspy.reopen_for_close(client)  # so that a second close() runs nats-py's cleanup again
            try:
                await client.close()
            except OSError as again:
                log.warning("NATS connection could not be closed cleanly", extra={"error": repr(again)})

    def _drop_buffered_writes(self) -> None:
        dropped = _natspy.drop_buffered_writes(self.client)
        if dropped:
            log.info("dropping commands buffered for a reconnection", extra={"bytes": dropped})
