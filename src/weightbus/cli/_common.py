"""What every ``weightbus`` command shares: the NATS option, logging setup, metrics server, async entry.

Commands are tiny: parse options, call ``setup_logging``, then ``run_async(coroutine)``. Logging is
structured (one JSON object per line on stderr) and quiet by default (warnings only; ``-v`` for info).

Invariants: a bad option value (an empty or malformed NATS URL, a port outside 1-65535, an output
path in a missing or unwritable directory) ends the command before it connects to anything, with one
``error: ...`` line on stderr and exit code 2; SIGINT and SIGTERM cancel the running coroutine, so its
``finally`` blocks run (engines paused by the command are resumed) before the process exits 130 or 143.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Annotated, Any, TypeVar
from urllib.parse import urlsplit

import typer
from prometheus_client import CollectorRegistry, start_http_server

from weightbus.bus.options import ENV, ConnectOptions
from weightbus.errors import BusConfigError
from weightbus.process.eventloop import EventLoopError
from weightbus.process.eventloop import run as run_on_loop

__all__ = [
    "CONNECTION_FLAGS",
    "DEFAULT_NATS",
    "EXIT_USAGE",
    "ApiKeyOption",
    "ConnectTimeoutOption",
    "EngineTimeoutOption",
    "MetricsHostOption",
    "MetricsPortOption",
    "NatsOption",
    "PolicyOption",
    "RouterOption",
    "VerboseOption",
    "check_nats_url",
    "check_port",
    "check_writable_dir",
    "check_writable_file",
    "fail",
    "with_connection",
    "run_async",
    "setup_logging",
    "start_metrics",
]

T = TypeVar("T")

#: Exit code of a bad option or argument (click's own usage errors use it too).
EXIT_USAGE = 2
_NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print ``message`` to stderr as one ``error:`` line and return an Exit to raise with ``code``."""
    typer.echo(f"error: {' '.join(str(message).split())}", err=True)
    return typer.Exit(code)


def check_nats_url(value: str | None) -> str | None:
    """Validate a NATS URL list (comma-separated ``scheme://[user:pass@]host:port``); None passes through.

    Raises:
        typer.Exit: (code 2, after one ``error:`` line) the value is empty or a URL is malformed.
    """
    if value is None:
        return None
    urls = [u.strip() for u in value.split(",")]
    if not value.strip() or not all(urls):
        raise fail(f"--nats {value!r}: empty NATS URL (expected e.g. nats://127.0.0.1:4222)", EXIT_USAGE)
    for url in urls:
        parsed = urlsplit(url if "://" in url else f"nats://{url}")
        try:
            port = parsed.port
        except ValueError:
            raise fail(f"--nats {url!r}: the port is not a number in 1-65535", EXIT_USAGE) from None
        if parsed.scheme not in _NATS_SCHEMES:
            raise fail(f"--nats {url!r}: the scheme must be one of {', '.join(_NATS_SCHEMES)}", EXIT_USAGE)
        if not parsed.hostname or any(c.isspace() for c in url):
            raise fail(f"--nats {url!r}: no host name", EXIT_USAGE)
        if port == 0:
            raise fail(f"--nats {url!r}: port 0 is not a server port", EXIT_USAGE)
    return value


def check_port(value: int | None) -> int | None:
    """Validate a TCP port (1-65535); None passes through.

    Raises:
        typer.Exit: (code 2, after one ``error:`` line) the port is out of range.
    """
    if value is not None and not 1 <= value <= 65535:
        raise fail(f"port {value} is not in 1-65535", EXIT_USAGE)
    return value


def check_writable_file(value: Path | None) -> Path | None:
    """Validate an output file: ``-`` (stdout), or a path whose directory exists and is writable.

    Raises:
        typer.Exit: (code 2, after one ``error:`` line) the file cannot be written.
    """
    if value is None or str(value) == "-":
        return value
    parent = value.parent if str(value.parent) else Path(".")
    if value.is_dir():
        raise fail(f"{value} is a directory, not a file", EXIT_USAGE)
    if not parent.is_dir():
        raise fail(f"cannot write {value}: directory {parent} does not exist", EXIT_USAGE)
    if not os.access(parent, os.W_OK) or (value.exists() and not os.access(value, os.W_OK)):
        raise fail(f"cannot write {value}: permission denied", EXIT_USAGE)
    return value


def check_writable_dir(value: Path | None) -> Path | None:
    """Validate a directory to write in: it is created if missing, and a file can be created in it.

    None passes through.

    Raises:
        typer.Exit: (code 2, after one ``error:`` line) the directory cannot be created or written.
    """
    if value is None:
        return None
    if value.exists() and not value.is_dir():
        raise fail(f"{value} is not a directory", EXIT_USAGE)
    try:
        value.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=value):
            pass
    except OSError as exc:
        raise fail(f"cannot write in {value}: {exc.strerror or exc}", EXIT_USAGE) from None
    return value


NatsOption = Annotated[
    str,
    typer.Option(
        "--nats",
        envvar="WEIGHTBUS_NATS",
        help="NATS URL (or several, comma-separated).",
        show_default=True,
        callback=check_nats_url,
    ),
]
MetricsPortOption = Annotated[
    int | None,
    typer.Option(
        "--metrics-port",
        help="Serve Prometheus metrics on http://HOST:PORT/metrics (see --metrics-host).",
        callback=check_port,
    ),
]
MetricsHostOption = Annotated[
    str,
    typer.Option(
        "--metrics-host",
        envvar="WEIGHTBUS_METRICS_HOST",
        help="Interface the metrics server binds (0.0.0.0 to let a cluster scrape it).",
    ),
]
ApiKeyOption = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="WEIGHTBUS_API_KEY",
        help="Bearer token for engines started with --api-key.",
        show_envvar=True,
    ),
]
EngineTimeoutOption = Annotated[
    float, typer.Option("--engine-timeout", min=0.001, help="Seconds per engine HTTP request.")
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
    """Serve ``registry`` on ``addr:port`` from a daemon thread (nothing when ``port`` is None).

    Raises:
        typer.Exit: (code 2, after one ``error:`` line) the address cannot be bound (in use, unknown host).
    """
    if port is None:
        return
    try:
        start_http_server(port, addr=addr, registry=registry)
    except (OSError, OverflowError, ValueError) as exc:
        raise fail(
            f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}"
            if isinstance(exc, OSError)
            else f"cannot serve metrics on {addr}:{port}: {exc}",
            EXIT_USAGE,
        ) from None
    logging.getLogger("weightbus.cli").info("metrics served", extra={"url": f"http://{addr}:{port}/metrics"})


async def _cancel_on_sigterm(coro: Coroutine[Any, Any, T]) -> T:
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    installed = False
    if task is not None:
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread
            loop.add_signal_handler(signal.SIGTERM, task.cancel)
            installed = True
    try:
        return await coro
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGTERM)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine on weightbus's loop (uvloop where installed, ``WEIGHTBUS_EVENT_LOOP``).

    Ctrl-C (exit 130) and SIGTERM (exit 143) cancel it, so its cleanup runs.
    """
    try:
        return run_on_loop(_cancel_on_sigterm(coro))
    except EventLoopError as exc:
        coro.close()  # the wrapper was closed unstarted, so the command's own coroutine never ran either
        raise fail(str(exc), EXIT_USAGE) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except asyncio.CancelledError:
        raise typer.Exit(143) from None
