"""What every ``weightbus`` command shares: the NATS option, logging setup, metrics server, async entry.

Commands are tiny: parse options, call ``setup_logging``, then ``run_async(coroutine)``. Logging is
structured (one JSON object per line on stderr) and quiet by default (warnings only; ``-v`` for info).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import sys
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, TypeVar

import typer
from prometheus_client import CollectorRegistry, start_http_server

from weightbus.bus.options import ENV, ConnectOptions
from weightbus.errors import BusConfigError

__all__ = [
    "CONNECTION_FLAGS",
    "DEFAULT_NATS",
    "ConnectTimeoutOption",
    "MetricsPortOption",
    "NatsOption",
    "PolicyOption",
    "RouterOption",
    "VerboseOption",
    "fail",
    "with_connection",
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


def _flag(name: str, field: str, help_text: str, *, is_int: bool = False) -> inspect.Parameter:
    kind = int | None if is_int else str | None
    option = typer.Option(f"--{name}", envvar=ENV[field], help=help_text, show_envvar=True, rich_help_panel="NATS")
    return inspect.Parameter(field, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[kind, option])


#: The connection flags ``with_connection`` adds to a command (each also read from its WEIGHTBUS_* variable).
CONNECTION_FLAGS = (
    _flag("creds", "creds", "NATS .creds file (JWT and NKEY seed; needs the auth extra)."),
    _flag("nkey", "nkey_seed", "File holding an NKEY user seed (needs the auth extra)."),
    _flag("token", "token", "NATS authentication token."),
    _flag("user", "user", "NATS user name."),
    _flag("password", "password", "NATS password (with --user)."),
    _flag("tls-ca", "tls_ca", "CA certificate (PEM) that signed the server's certificate; enables TLS."),
    _flag("tls-cert", "tls_cert", "Client certificate (PEM), for servers that verify clients."),
    _flag("tls-key", "tls_key", "Private key (PEM) of --tls-cert."),
    _flag("replicas", "replicas", "Replicas of the WEIGHTBUS stream if this command creates it.", is_int=True),
)


def with_connection(command: Callable[..., T]) -> Callable[..., T]:
    """Add the ``CONNECTION_FLAGS`` to a typer command that takes ``connection: ConnectOptions``.

    The command sees one ``connection`` argument built from the flags (and their environment variables)
    and passes it to ``connect(..., options=connection)``. Invalid combinations exit with code 2.
    """
    signature = inspect.signature(command, eval_str=True)
    params = [p for p in signature.parameters.values() if p.name != "connection"]
    flags = [p.name for p in CONNECTION_FLAGS]

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        values = {name: kwargs.pop(name, None) for name in flags}
        try:
            kwargs["connection"] = ConnectOptions(**{k: v for k, v in values.items() if v is not None})
        except BusConfigError as exc:
            raise fail(str(exc), 2) from None
        return command(*args, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*params, *CONNECTION_FLAGS])  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in wrapper.__signature__.parameters.values()}  # type: ignore[attr-defined]
    return wrapper


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
