"""Opening the nats-py connection under a ``NatsBus``: a bounded first connect, a typed failure, logged transitions.

The first connect fails within ``connect_timeout`` with ``BusConnectError`` (URL redacted, cause named); TLS asked
for is TLS or nothing; then the client reconnects forever; permission refusals go to ``Denials``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

import nats.errors
from nats.aio.client import Client as NatsClient

from weightbus.bus import _natspy
from weightbus.bus._denials import Denials
from weightbus.bus.options import ConnectOptions
from weightbus.errors import BusConnectError

__all__ = ["RECONNECT_TIME_WAIT", "Link", "classify", "open_link"]

log = logging.getLogger("weightbus.bus")

RECONNECT_TIME_WAIT: Final = 0.5
"""Seconds nats-py waits between reconnection attempts to one server."""

_DEFINITE: Final = ("auth", "tls", "dns")
_PLAINTEXT: Final = "nats: plaintext refused:"


@dataclass(frozen=True)
class Link:
    """A connected nats-py client and what its ``NatsBus`` shares with the connection's callbacks.

    Attributes:
        client: the connected client.
        closing: set by ``NatsBus.aclose`` so that the callbacks do not log the close as an outage.
        denials: the permission refusals the server reported on this connection.
        shown: the URL as it may be shown (secrets redacted).
    """

    client: NatsClient
    closing: asyncio.Event
    denials: Denials
    shown: str


def classify(exc: BaseException | None, redacted: str) -> tuple[str, str]:
    """``(cause, detail)`` of the last error seen while connecting, for ``BusConnectError``."""
    if exc is None or isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return "timeout", "no answer"
    if isinstance(exc, nats.errors.Error) and str(exc).startswith(_PLAINTEXT):
        return "tls", str(exc).removeprefix(_PLAINTEXT).strip()
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


@dataclass
class _Callbacks:
    """nats-py's four callbacks for one connection, and what they saw while it was connecting."""

    client: NatsClient
    opts: ConnectOptions
    url: str
    shown: str
    single_server: bool
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    denials: Denials = field(default_factory=Denials)
    fatal: asyncio.Event = field(default_factory=asyncio.Event)
    """Set on a refused login or TLS handshake with one server: retrying cannot help."""
    last_error: BaseException | None = None

    async def error(self, exc: Exception) -> None:
        text = str(exc)
        if self.denials.record(text):
            # A refusal a guarded operation was waiting for becomes its PermissionDeniedError, which the caller
            # reports; a warning as well would say it twice.
            level = logging.DEBUG if self.denials.last_caught else logging.WARNING
            log.log(level, "NATS refused an action (permissions)", extra={"error": self.opts.redact(text, self.url)})
            return
        if self.client.is_connecting or not self.client.is_connected:
            cause, _ = classify(exc, self.shown)
            # Keep the most telling cause: the reset that follows a refused login must not hide it.
            if self.last_error is None or classify(self.last_error, self.shown)[0] not in _DEFINITE:
                self.last_error = exc
            if cause in ("auth", "tls") and self.single_server:
                self.fatal.set()
        log.debug("nats client error", extra={"error": self.opts.redact(repr(exc), self.url)})

    def plaintext(self, server: str) -> nats.errors.Error:
        """The refusal of ``server``, which left the connection unencrypted while TLS is required."""
        shown = self.opts.redact(server, self.url)
        detail = (
            f"TLS is required (a TLS option or a tls:// URL) but the server {shown} did not encrypt the connection "
            "(its INFO does not ask for TLS); refused before sending any credential"
        )
        log.error("refused a plaintext NATS connection", extra={"url": shown, "error": detail})
        return nats.errors.Error(f"{_PLAINTEXT} {detail}")

    async def disconnected(self) -> None:
        if not (self.closing.is_set() or self.client.is_closed):
            log.warning("disconnected from NATS; reconnecting", extra={"url": self.shown})

    async def reconnected(self) -> None:
        now = self.client.connected_url.geturl() if self.client.connected_url else self.url
        log.warning("reconnected to NATS", extra={"url": self.opts.redact(now, self.url)})

    async def closed(self) -> None:
        log.info("NATS connection closed", extra={"url": self.shown})


def _servers(url: str) -> list[str]:
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        # nats-py would retry an empty server list forever at full CPU.
        raise BusConnectError(url, "no server URL given", "config")
    return servers


async def open_link(url: str, *, name: str, connect_timeout: float, opts: ConnectOptions) -> Link:
    """Connect a nats-py client to ``url`` within ``connect_timeout`` seconds.

    Raises:
        BusConnectError: no server URL, or none could be reached or logged into in time (``cause`` says why).
        BusConfigError: the options cannot work (a missing file, a password without a user).
    """
    shown = opts.redact(url, url)
    kwargs = opts.nats_kwargs()
    servers = _servers(url)
    client = NatsClient()
    calls = _Callbacks(client, opts, url, shown, single_server=len(servers) == 1)
    if opts.requires_tls(url):
        _natspy.refuse_plaintext(client, calls.plaintext)
    attempt = asyncio.ensure_future(
        client.connect(
            servers=servers,
            name=name,
            error_cb=calls.error,
            disconnected_cb=calls.disconnected,
            reconnected_cb=calls.reconnected,
            closed_cb=calls.closed,
            connect_timeout=max(1, int(connect_timeout)),
            # nats-py annotates it int, but only compares with it and sleeps on it: half a second works.
            reconnect_time_wait=RECONNECT_TIME_WAIT,  # type: ignore[arg-type]
            max_reconnect_attempts=-1,
            allow_reconnect=True,
            **kwargs,
        )
    )
    failure = await _outcome(attempt, calls, connect_timeout)
    if failure is not None:
        with contextlib.suppress(Exception):
            await client.close()
        cause, detail = classify(failure, shown)
        if cause == "timeout":
            detail = f"{detail} within {connect_timeout:g}s"
        raise BusConnectError(shown, opts.redact(detail, url), cause) from None
    return Link(client, calls.closing, calls.denials, shown)


async def _outcome(attempt: asyncio.Future[None], calls: _Callbacks, timeout: float) -> BaseException | None:
    """Wait for the connect ``attempt``, at most ``timeout`` seconds; None on success, else what made it fail."""
    stop = asyncio.ensure_future(calls.fatal.wait())
    waiters: set[asyncio.Future[Any]] = {attempt, stop}
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if attempt.done() and not attempt.cancelled():
        return attempt.exception()
    attempt.cancel()
    await asyncio.gather(attempt, return_exceptions=True)  # reap it; an outer cancel still propagates
    return calls.last_error if calls.last_error is not None else TimeoutError()
