"""The Prometheus endpoint of a long-running command (``--metrics-port``, ``--metrics-host``; ``serve_metrics``).

The command's own registry is served, never the global one; an address that cannot be bound exits 2 before NATS.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from weightbus.bus.metrics import serve_metrics
from weightbus.cli.exits import EXIT_USAGE, fail

__all__ = ["start_metrics"]


def start_metrics(port: int | None, registry: CollectorRegistry, addr: str = "127.0.0.1") -> None:
    """Serve ``registry`` on ``addr:port`` from a daemon thread (nothing when ``port`` is None).

    Raises:
        typer.Exit: (code 2, after one ``error:`` line) the address cannot be bound (in use, unknown host).
    """
    if port is None:
        return
    try:
        serve_metrics(port, registry, addr)
    except (OSError, OverflowError, ValueError) as exc:
        reason = (exc.strerror or exc) if isinstance(exc, OSError) else exc
        raise fail(f"cannot serve metrics on {addr}:{port}: {reason}", EXIT_USAGE) from None
    logging.getLogger("weightbus.cli").info("metrics served", extra={"url": f"http://{addr}:{port}/metrics"})
