"""A lean HTTP/1.1 client for one engine: keep-alive connections over asyncio streams, and nothing else.

Why it exists: a fleet sends every engine five or six small JSON requests per update. Through httpx each one costs
the trainer about 400 µs of CPU, against about 30 µs written by hand (``bench/http_client.py``). At 256 engines that
difference is most of an update's control time, and so most of the engines' paused window. This client does what
those requests need: one origin, ``Content-Length`` or chunked answers, TLS from a given context, a bounded pool, and
one deadline per request. It has no redirects, cookies, proxies, compression or HTTP/2, and it sends no
``Expect: 100-continue``.

Invariants:
- A connection returns to the pool only after a complete answer, when neither side asked to close it. A request
  that is cancelled, times out or fails part-way closes its connection, so no later request reads a stale answer.
- At most ``max_connections`` connections are open at once, and at most one is kept idle between requests.
- A request is sent a second time only once, and only on a fresh connection, when a *reused* connection closed
  before a single byte of the answer arrived. That is a server dropping an idle keep-alive connection (uvicorn does
  after 5 s) just as the request left. The engine routes a fleet sends are idempotent for the same body, but for a
  LoRA load, whose repeat the engine refuses (a loud failure, never a second adapter).
- Every failure is an ``EngineTransportError`` (an ``EngineError`` with no status) naming the request and why.
"""

from __future__ import annotations

import asyncio
import logging
import ssl as ssl_module
from dataclasses import dataclass
from typing import Final, cast
from urllib.parse import urlencode, urlsplit

from weightbus.engines._http import normalize_url
from weightbus.errors import EngineTransportError

__all__ = ["HttpReply", "KeepAliveHttp"]

log = logging.getLogger("weightbus.engines")

#: The longest status line plus headers read; SGLang's are a few hundred bytes.
_MAX_HEAD: Final = 64 * 1024
#: The largest answer read; a larger one is refused with a typed error rather than filling memory.
_MAX_BODY: Final = 256 * 1024 * 1024
_NO_BODY_STATUS: Final = frozenset({204, 304})
_BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})


class _Unreadable(Exception):
    """The answer could not be read as HTTP/1.1; ``request`` turns it into an ``EngineTransportError``."""


@dataclass(frozen=True, slots=True)
class HttpReply:
    """One complete answer.

    Attributes:
        status_code: the HTTP status.
        reason_phrase: the status line's reason (may be empty).
        content: the body, de-chunked.
    """

    status_code: int
    reason_phrase: str
    content: bytes

    @property
    def is_success(self) -> bool:
        """Whether the status is 2xx."""
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        """The body as UTF-8 (undecodable bytes replaced: SGLang sends JSON or plain ASCII text)."""
        return self.content.decode("utf-8", errors="replace")


class _ClosedBeforeAnswer(Exception):
    """The connection ended before the first byte of the answer."""


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection: bytes in a buffer, and a future to wait on for more of them."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._more: asyncio.Future[None] | None = None
        self._eof = False
        self._error: Exception | None = None
        # Set while the connection waits in the pool: a byte arriving then is no answer to anything we sent.
        self.parked = False
        self.stray = False

    # --- asyncio.Protocol --------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.parked:
            self.stray = True
        self._buffer += data
        if len(self._buffer) > _MAX_BODY + _MAX_HEAD and self.transport is not None:
            # The reader refuses anything this long anyway; stop reading rather than fill memory.
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool | None:
        self._eof = True
        self._wake()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._error = exc
        self._wake()

    def _wake(self) -> None:
        if self._more is not None and not self._more.done():
            self._more.set_result(None)

    # --- use -----------------------------------------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        """Whether the connection may carry another request: open, quiet, nothing unread and nothing unsent (a
        server that answered before reading the whole body has not read the rest, and may never)."""
        return (
            self.transport is not None
            and not self.transport.is_closing()
            and self.transport.get_write_buffer_size() == 0
            and not self._eof
            and not self.stray
            and not self._buffer
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    async def _wait(self) -> None:
        """Until more bytes, the end of the connection, or its failure."""
        if self._eof:
            if self._error is not None and not self._buffer:
                raise ConnectionResetError(str(self._error)) from self._error
            raise asyncio.IncompleteReadError(bytes(self._buffer), None)
        self._more = asyncio.get_running_loop().create_future()
        try:
            await self._more
        finally:
            self._more = None

    async def _until(self, separator: bytes, limit: int) -> bytes:
        start = 0
        while (at := self._buffer.find(separator, start)) < 0:
            if len(self._buffer) > limit:
                raise asyncio.LimitOverrunError("separator not found within the limit", len(self._buffer))
            start = max(0, len(self._buffer) - len(separator) + 1)
            await self._wait()
        end = at + len(separator)
        out = bytes(self._buffer[:end])
        del self._buffer[:end]
        return out

    async def _exactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            await self._wait()
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out

    async def _rest(self) -> bytes:
        while not self._eof:
            if len(self._buffer) > _MAX_BODY:
                raise _Unreadable(f"the answer is longer than {_MAX_BODY} bytes")
            self._more = asyncio.get_running_loop().create_future()
            try:
                await self._more
            finally:
                self._more = None
        if self._error is not None:
            # A reset is not the end of an unframed body: what came is not the whole answer.
            raise ConnectionResetError(str(self._error)) from self._error
        out = bytes(self._buffer)
        self._buffer.clear()
        return out

    async def exchange(self, raw: bytes, *, head_request: bool) -> tuple[HttpReply, bool]:
        """Send ``raw`` and read one answer; returns it and whether the connection may be reused."""
        assert self.transport is not None
        try:
            # The transport buffers what the socket cannot take yet; the answer is read at once, not after
            # the body is out, since a server may answer (a 413, a 400) before it has read the whole request.
            self.transport.write(raw)
            while True:
                try:
                    head = await self._until(b"\r\n\r\n", _MAX_HEAD)
                except asyncio.IncompleteReadError as exc:
                    if not exc.partial:
                        raise _ClosedBeforeAnswer from None
                    raise _Unreadable("the connection closed inside the answer's headers") from None
                status, reason, headers, http10 = _parse_head(head)
                # 1xx answers (we never ask for 100-continue, but a server may send 103) precede the real one.
                if not 100 <= status < 200:
                    break
        except ConnectionError as exc:
            # Nothing was read yet: on a reused connection, the server closed it as the request left.
            raise _ClosedBeforeAnswer from exc
        except asyncio.LimitOverrunError:
            raise _Unreadable(f"the answer's headers are longer than {_MAX_HEAD} bytes") from None
        keep = not http10 and "close" not in headers.get("connection", "").lower()
        try:
            if head_request or status in _NO_BODY_STATUS:
                body = b""
            elif "chunked" in headers.get("transfer-encoding", "").lower():
                body = await self._chunked()
            elif "content-length" in headers:
                body = await self._exactly(_content_length(headers["content-length"]))
            else:
                # No framing: the body runs to the end of the connection.
                body = await self._rest()
                keep = False
        except asyncio.IncompleteReadError as exc:
            got = len(exc.partial)
            raise _Unreadable(f"the connection closed inside the answer's body ({got} bytes in)") from None
        except (asyncio.LimitOverrunError, ValueError) as exc:
            raise _Unreadable(f"malformed chunked body: {exc}") from None
        except ConnectionError as exc:
            raise _Unreadable(f"the connection failed inside the answer's body: {exc}") from None
        return HttpReply(status, reason, body), keep

    async def _chunked(self) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            line = await self._until(b"\r\n", _MAX_HEAD)
            size = int(line.split(b";", 1)[0].strip(), 16)
            if size < 0:
                raise ValueError(f"negative chunk size {size}")
            if size == 0:
                # Trailers, if any, end with an empty line.
                while await self._until(b"\r\n", _MAX_HEAD) != b"\r\n":
                    pass
                return b"".join(parts)
            total += size
            if total > _MAX_BODY:
                raise _Unreadable(f"the answer is longer than {_MAX_BODY} bytes")
            parts.append(await self._exactly(size))
            if await self._exactly(2) != b"\r\n":
                raise ValueError("a chunk does not end with CRLF")


def _parse_head(head: bytes) -> tuple[int, str, dict[str, str], bool]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit() or len(parts[1]) != 3:
        raise _Unreadable(f"not an HTTP/1.x status line: {lines[0][:200]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise _Unreadable(f"malformed header line: {line[:200]!r}")
        key = name.lower()
        value = value.strip()
        if key in headers:
            if key == "content-length" and headers[key] != value:
                raise _Unreadable("the answer carries two different Content-Length headers")
            headers[key] = f"{headers[key]}, {value}" if key != "content-length" else value
        else:
            headers[key] = value
    return int(parts[1]), parts[2] if len(parts) > 2 else "", headers, parts[0] == "HTTP/1.0"


def _content_length(value: str) -> int:
    if not value.isdigit():
        raise _Unreadable(f"invalid Content-Length {value[:50]!r}")
    length = int(value)
    if length > _MAX_BODY:
        raise _Unreadable(f"the answer is longer than {_MAX_BODY} bytes ({length})")
    return length


class KeepAliveHttp:
    """A small pool of keep-alive HTTP/1.1 connections to one engine.

    Args:
        url: the engine's base URL (``http://`` or ``https://``; a path prefix is kept).
        timeout: seconds each request may take in all (connecting, sending, the whole answer); None waits forever.
        ssl: the TLS context for ``https`` URLs (default: ``ssl.create_default_context()``); a fleet passes one
            context to all its engines.
        max_connections: the most connections open at once; more concurrent requests wait for one.

    Raises:
        ValueError: ``url`` is malformed, or ``max_connections`` is below 1.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float | None = 30.0,
        ssl: ssl_module.SSLContext | None = None,
        max_connections: int = 2,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self.url = normalize_url(url)
        parts = urlsplit(self.url)
        self.timeout = timeout
        self._host = parts.hostname or ""
        tls = parts.scheme == "https"
        self._port = parts.port or (443 if tls else 80)
        self._ssl = (ssl or ssl_module.create_default_context()) if tls else None
        host = f"[{self._host}]" if ":" in self._host else self._host
        default_port = self._port == (443 if tls else 80)
        self._host_header = host if default_port else f"{host}:{self._port}"
        self._prefix = parts.path
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: _Connection | None = None
        self._open: set[_Connection] = set()
        self._closed = False

    def __repr__(self) -> str:
        return f"KeepAliveHttp({self.url!r})"

    @property
    def open_connections(self) -> int:
        """How many connections are open now (in use or idle)."""
        return len(self._open)

    async def request(
        self,
        method: str,
        path: str,
        *,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> HttpReply:
        """Send one request to ``path`` (below the base URL) and read its whole answer.

        Args:
            method: ``GET``, ``POST``, ...
            path: begins with ``/``.
            content: the body; ``POST``/``PUT``/``PATCH`` without one send ``Content-Length: 0``.
            headers: extra headers (no CR or LF in names or values).
            params: the query string.
            timeout: this request's deadline in seconds (None: the client's ``timeout``).

        Raises:
            EngineTransportError: no connection, a reset, an answer that is not HTTP/1.1, or no whole answer
                within the deadline.
            RuntimeError: the client is closed.
            ValueError: a header name or value holds CR or LF.
        """
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        raw = self._encode(method, path, content, headers, params)
        deadline = self.timeout if timeout is None else timeout
        try:
            # The deadline covers the wait for a free connection too, as httpx's pool timeout does.
            async with asyncio.timeout(deadline), self._slots:
                return await self._send(raw, head_request=method == "HEAD")
        except TimeoutError:
            message = f"{method} {path} timed out: no whole answer within {deadline}s"
            raise EngineTransportError(self.url, message) from None
        except _Unreadable as exc:
            raise EngineTransportError(self.url, f"{method} {path} failed: {exc}") from None

    def _encode(
        self,
        method: str,
        path: str,
        content: bytes | None,
        headers: dict[str, str] | None,
        params: dict[str, str] | None,
    ) -> bytes:
        target = self._prefix + path
        if params:
            target += "?" + urlencode(params)
        head = f"{method} {target} HTTP/1.1\r\nHost: {self._host_header}\r\nAccept: */*\r\nUser-Agent: weightbus\r\n"
        for name, value in (headers or {}).items():
            if any(c in name or c in value for c in "\r\n"):
                raise ValueError(f"header {name!r} holds CR or LF")
            head += f"{name}: {value}\r\n"
        if content is not None or method in _BODY_METHODS:
            head += f"Content-Length: {len(content or b'')}\r\n"
        return (head + "\r\n").encode("latin-1") + (content or b"")

    async def _send(self, raw: bytes, *, head_request: bool) -> HttpReply:
        idle = self._take_idle()
        if idle is not None:
            try:
                return await self._exchange(idle, raw, head_request=head_request)
            except _ClosedBeforeAnswer:
                # The server dropped the idle connection as the request left: once more, on a new one.
                log.debug("an idle connection was closed by the engine; sending again", extra={"engine": self.url})
        try:
            return await self._exchange(await self._connect(), raw, head_request=head_request)
        except _ClosedBeforeAnswer as exc:
            cause = exc.__cause__ or "EOF"
            raise _Unreadable(f"the engine closed the connection without answering ({cause})") from None

    async def _exchange(self, conn: _Connection, raw: bytes, *, head_request: bool) -> HttpReply:
        try:
            reply, keep = await conn.exchange(raw, head_request=head_request)
        except BaseException:
            self._discard(conn)
            raise
        if keep and conn.usable and self._idle is None and not self._closed:
            conn.parked = True
            self._idle = conn
        else:
            self._discard(conn)
        return reply

    def _take_idle(self) -> _Connection | None:
        conn, self._idle = self._idle, None
        if conn is not None:
            conn.parked = False
        if conn is not None and not conn.usable:
            self._discard(conn)
            return None
        return conn

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(
                _Connection,
                self._host,
                self._port,
                ssl=self._ssl,
                server_hostname=self._host if self._ssl is not None else None,
            )
        except ssl_module.SSLError as exc:
            raise _Unreadable(f"TLS failed: {exc}") from None
        except OSError as exc:
            raise _Unreadable(f"cannot connect: {exc}") from None
        self._open.add(conn)
        return conn

    def _discard(self, conn: _Connection) -> None:
        self._open.discard(conn)
        conn.close()

    async def aclose(self) -> None:
        """Close every connection; later requests raise ``RuntimeError``. Requests in flight fail."""
        self._closed = True
        self._idle = None
        conns, self._open = self._open, set()
        for conn in conns:
            conn.close()
        # Let the transports finish closing (connection_lost) so no "unclosed transport" warning follows.
        await asyncio.sleep(0)

    async def __aenter__(self) -> KeepAliveHttp:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
