"""Prometheus metrics of the bus boundary, registered on an injected ``CollectorRegistry``, and the endpoint that
serves a registry (``serve_metrics``: the CLI's ``--metrics-port`` and the integrations' metrics ports).

Only low-cardinality labels: the subject family and a fixed reason, never a subject or a payload value. A served
registry is always the one given, never prometheus-client's global one.
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, start_http_server

from weightbus.schemas.codec import FAMILIES

__all__ = ["BusMetrics", "MetricsServer", "serve_metrics"]


class MetricsServer:
    """A registry served on ``http://host:port/metrics`` from a daemon thread (``serve_metrics``); ``close()`` stops it.

    Attributes:
        host: the interface it is bound to.
        port: the port it is bound to (the one picked when 0 was asked).
    """

    def __init__(self, server: WSGIServer, thread: threading.Thread, host: str) -> None:
        self._server = server
        self._thread = thread
        self.host = host
        self.port: int = server.server_port
        self._closed = False

    @property
    def url(self) -> str:
        """The endpoint's URL."""
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``registry`` on ``host:port`` from a daemon thread until the returned server is closed.

    Raises:
        OSError: the address cannot be bound (in use, unknown host).
        OverflowError, ValueError: not a port.
    """
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread, host)


class BusMetrics:
    """Counters of the bus boundary.

    ``weightbus_invalid_events_total{family, reason}`` counts payloads that failed the typed decode
    (``malformed``, ``invalid``, ``oversized``, ``unknown_subject``). Pass None as the registry to get
    an unregistered private one (useful in scripts; tests should inject theirs).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.invalid_events = Counter(
            "weightbus_invalid_events",
            "Payloads that failed the typed decode at the bus boundary, by subject family and reason.",
            ["family", "reason"],
            registry=self.registry,
        )
        # Every pair at 0 from the start: a counter born at 1 on its first event shows no increase(), so an
        # alert on it would miss the first invalid payload.
        for family in FAMILIES:
            for reason in ("malformed", "invalid", "oversized"):
                self.invalid_events.labels(family, reason)
        self.invalid_events.labels("unknown", "unknown_subject")
