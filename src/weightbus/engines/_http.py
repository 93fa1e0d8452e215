"""HTTP helpers shared by the engine and router clients: URL normalisation, error-message extraction, and one
request through httpx whose every failure is an ``EngineError``.

Internal (``weightbus.engines`` exports ``httpx_request``); nothing here raises ``httpx`` errors (a malformed URL is
a ``ValueError``).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import httpx
import msgspec

from weightbus.errors import EngineError

__all__ = ["Reply", "httpx_request", "normalize_url", "server_message"]

log = logging.getLogger("weightbus.engines")


class Reply(Protocol):
    """What the engine clients read of an answer: an ``httpx.Response`` or a ``KeepAliveHttp`` reply."""

    @property
    def status_code(self) -> int: ...
    @property
    def reason_phrase(self) -> str: ...
    @property
    def content(self) -> bytes: ...
    @property
    def text(self) -> str: ...
    @property
    def is_success(self) -> bool: ...


# Server messages can be whole tracebacks; keep errors readable.
_MAX_MESSAGE = 2000


def normalize_url(url: str) -> str:
    """``url`` without surrounding spaces or a trailing slash, with ``http://`` added when no scheme is given.

    Raises:
        ValueError: ``url`` is empty, or is not an ``http``/``https`` URL with a host and a valid port.
    """
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("url is empty")
    if "://" not in url:
        url = f"http://{url}"
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise ValueError(f"invalid engine URL {url!r}: {exc}") from None
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"invalid engine URL {url!r}: the scheme must be http or https")
    if not parsed.host:
        raise ValueError(f"invalid engine URL {url!r}: no host")
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        raise ValueError(f"invalid engine URL {url!r}: port {parsed.port} is not in 1-65535")
    return url


def server_message(response: Reply) -> str:
    """The most specific human message in an error response, whatever shape the server chose.

    Looks at JSON ``message``, ``error_message``, ``detail`` and ``error`` (or ``error.message``), then the
    plain text, then the reason phrase.
    """
    try:
        body = msgspec.json.decode(response.content)
    except msgspec.DecodeError:
        body = None
    if isinstance(body, dict):
        for key in ("message", "error_message", "detail", "error"):
            value = body.get(key)
            if isinstance(value, dict) and isinstance(value.get("message"), str):
                value = value["message"]
            if isinstance(value, str) and value:
                return value[:_MAX_MESSAGE]
    text = response.text.strip()
    if text:
        return text[:_MAX_MESSAGE]
    return response.reason_phrase or "empty response"


async def httpx_request(http: httpx.AsyncClient, base: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """``http.request(method, base + path, **kwargs)``, any answer returned, every failure an ``EngineError`` of
    ``base`` with no status (a timeout says so).

    Raises:
        EngineError: no answer: the connection, the TLS handshake, a timeout, or the HTTP client itself failed.
    """
    try:
        return await http.request(method, base + path, **kwargs)
    except httpx.TimeoutException as exc:
        raise EngineError(base, None, f"{method} {path} timed out ({type(exc).__name__})") from exc
    except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError) as exc:
        raise EngineError(base, None, f"{method} {path} failed: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:
        # A connection the engine resets as it is made can break the layers under httpx (anyio on uvloop:
        # AttributeError on a socket already gone). There is no answer either way; raised as it was, it escaped
        # every caller's handling of engine failures and ended the demo's trainer. Logged with its traceback.
        log.warning("the HTTP client failed inside", exc_info=True, extra={"engine": base, "path": path})
        raise EngineError(base, None, f"{method} {path} failed in the HTTP client: {exc!r}") from exc
