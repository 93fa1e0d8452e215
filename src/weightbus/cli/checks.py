"""The checks a ``weightbus`` option value passes before a command connects to anything.

Each ``check_*`` returns the value or ends the command with one ``error:`` line and exit 2, before any connection.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from weightbus.bus.subjects import validate_policy
from weightbus.cli.exits import EXIT_USAGE, fail
from weightbus.errors import InvalidPolicyError

__all__ = [
    "check_nats_url",
    "check_policy",
    "check_port",
    "check_writable_dir",
    "check_writable_file",
]

_NATS_SCHEMES = ("nats", "tls", "ws", "wss")


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


def check_policy(value: str | None) -> str | None:
    """Validate a policy id (one subject token of ``[A-Za-z0-9_-]``); None passes through.

    Raises:
        typer.Exit: (code 2, after one ``error:`` line) the id is not a valid policy id.
    """
    if value is None:
        return None
    try:
        validate_policy(value)
    except InvalidPolicyError as exc:
        raise fail(str(exc), EXIT_USAGE) from None
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
