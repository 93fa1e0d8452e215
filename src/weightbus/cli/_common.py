"""What every ``weightbus`` command shares: the NATS option, logging setup, metrics server, async entry.

Commands are tiny: parse options, call ``setup_logging``, then ``run_async(coroutine)``. Logging is
structured (one JSON object per line on stderr) and quiet by default (warnings only; ``-v`` for info).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Coroutine
from typing import Annotated, Any, TypeVar

import typer
from prometheus_client import CollectorRegistry, start_http_server

__all__ = [
    "DEFAULT_NATS",
    "ConnectTimeoutOption",
    "MetricsPortOption",
    "NatsOption",
    "PolicyOption",
    "RouterOption",
    "VerboseOption",
    "fail",
    "run_async",
    "setup_logging",
    "start_metrics",
]

T = TypeVar("T")

NatsOption = Annotated[
    str,
    typer.Option("--nats", envvar="WEIGHTBUS_NATS", help="NATS URL (or several, comma-separated).", show_default=True),
]
MetricsPortOption = Annotated[
    int | None,
    typer.Option("--metrics-port", help="Serve Prometheus metrics on http://127.0.0.1:PORT/metrics."),
]
#: The client default; weightbus never starts a server on 4222 itself.
DEFAULT_NATS = "nats://127.0.0.1:4222"
PolicyOption = Annotated[str, typer.Option("--policy", help="Policy id (letters, digits, '_' and '-').")]
RouterOption = Annotated[
    str | None, typer.Option("--router", help="Router whose GET /workers lists the engines (instead of --engine).")
]
ConnectTimeoutOption = Annotated[float, typer.Option("--connect-timeout", help="Seconds to wait for NATS.")]
VerboseOption = Annotated[int, typer.Option("--verbose", "-v", count=True, help="More logs: -v info, -vv debug.")]

_STANDARD = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(verbose: int = 0) -> None:
    """JSON lines on stderr; warnings by default, info with ``-v``, debug with ``-vv``."""
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("nats").setLevel(max(level, logging.WARNING))


def start_metrics(port: int | None, registry: CollectorRegistry, addr: str = "127.0.0.1") -> None:
    """Serve ``registry`` on ``addr:port`` from a daemon thread (nothing when ``port`` is None)."""
    if port is not None:
        start_http_server(port, addr=addr, registry=registry)
        logging.getLogger("weightbus.cli").info("metrics served", extra={"url": f"http://{addr}:{port}/metrics"})


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print ``message`` to stderr and return an Exit to raise with ``code``."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine; Ctrl-C ends it quietly with exit code 130."""
    try:
        return asyncio.run(coro)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
