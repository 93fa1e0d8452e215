"""Serve an ASGI app (normally the reference engine) over real HTTP with uvicorn.

The socket is bound before uvicorn starts (``ServedEngine``, ``serve_forever``), so ``url`` is known, no port race is
possible, and an address in use is an ``OSError`` at once rather than a uvicorn log line.
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn

__all__ = ["ServedEngine", "listen", "serve_forever"]


def _config(
    app: Any,
    host: str,
    port: int,
    graceful_timeout: float | None,
    log_level: str | None,
    keep_alive: float = 5.0,
) -> uvicorn.Config:
    # h11 and no websockets: the engine needs neither httptools nor websockets, and both are optional imports.
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http="h11",
        ws="none",
        lifespan="off",
        # uvicorn's loggers propagate to the root's one handler (weightbus's format) instead of its own; None
        # leaves their level to the root's (--log-level: warning by default, so no startup lines).
        log_config=None,
        log_level=log_level,
        access_log=False,
        # uvicorn's default, which SGLang keeps: an idle keep-alive connection is closed after 5 s.
        timeout_keep_alive=keep_alive,  # type: ignore[arg-type]
        timeout_graceful_shutdown=None if graceful_timeout is None else max(1, round(graceful_timeout)),
    )


class ServedEngine:
    """Run ``app`` in a background thread on ``host`` and a free port; a context manager.

    Args:
        app: an ASGI app, e.g. ``create_app(EngineState())``.
        host: the interface to bind.
        startup_timeout: seconds to wait for the server to accept connections.
        graceful_timeout: seconds in-flight requests get at shutdown before they are cut.
        log_level: uvicorn's log level.
        keep_alive: seconds an idle keep-alive connection stays open (uvicorn's and SGLang's default: 5).

    Attributes:
        url: ``http://host:port``, valid once constructed.
    """

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        startup_timeout: float = 10.0,
        graceful_timeout: float = 1.0,
        log_level: str = "warning",
        keep_alive: float = 5.0,
    ) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))
        self.port: int = self._socket.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._startup_timeout = startup_timeout
        self._server = uvicorn.Server(_config(app, host, self.port, graceful_timeout, log_level, keep_alive))
        self._thread = threading.Thread(target=self._run, name=f"weightbus-engine-{self.port}", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        except Exception as exc:  # handed to the starting thread, which raises it from start()
            self._error = exc

    def start(self) -> ServedEngine:
        """Start serving; returns once the server accepts connections.

        Raises:
            RuntimeError: the server failed or did not start within ``startup_timeout``.
        """
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"engine server at {self.url} exited during startup") from self._error
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"engine server at {self.url} did not start within {self._startup_timeout} s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Ask the server to exit and wait for its thread; idempotent."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join()
        self._socket.close()

    def __enter__(self) -> ServedEngine:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``, for ``serve_forever``; uvicorn starts listening on it.

    Bound, not listening: a client connects only once uvicorn serves (and handles Ctrl-C and SIGTERM).

    Raises:
        OSError: the address cannot be bound (in use, unknown host).
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


async def serve_forever(
    app: Any, host: str, port: int, *, log_level: str | None = None, sock: socket.socket | None = None
) -> None:
    """Serve ``app`` on ``host:port`` until uvicorn is told to exit (Ctrl-C / SIGTERM in the main thread).

    ``log_level`` None: uvicorn logs at the root logger's level (the command's ``--log-level``, warning by default).
    ``sock`` is the socket from ``listen(host, port)`` (bound here when None); it is closed on return.

    Raises:
        OSError: the address cannot be bound.
    """
    sock = sock if sock is not None else listen(host, port)
    with sock:
        await uvicorn.Server(_config(app, host, port, graceful_timeout=1.0, log_level=log_level)).serve(sockets=[sock])
