"""Log formatting for weightbus processes: one line per record on stderr, quiet (warnings) by default.

The level is ``--log-level`` (``WEIGHTBUS_LOG_LEVEL``; ``-v``/``-vv`` raise it, the most verbose wins), the format
``--log-format``: ``human`` (``12:01:02 WARNING logger msg key=value``), ``json`` (one object per line), or ``auto``
(human on a terminal, JSON otherwise). Every record keeps its ``extra`` fields: key=value pairs or JSON keys.
``route_logs(write)`` sends the same lines elsewhere for a while (``watch``'s console), then restores the handlers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Final, TextIO

__all__ = [
    "LOG_FORMATS",
    "LOG_FORMAT_ENV",
    "LOG_LEVELS",
    "LOG_LEVEL_ENV",
    "HumanFormatter",
    "JsonFormatter",
    "choose_logging",
    "level_of",
    "logging_env",
    "route_logs",
    "setup_logging",
]

LOG_LEVEL_ENV: Final = "WEIGHTBUS_LOG_LEVEL"
LOG_FORMAT_ENV: Final = "WEIGHTBUS_LOG_FORMAT"
#: The ``--log-level`` names, most verbose first.
LOG_LEVELS: Final = ("debug", "info", "warning", "error")
LOG_FORMATS: Final = ("auto", "human", "json")

#: A record's own attributes, not ``extra`` fields (uvicorn's ``color_message`` is its message with ANSI colours).
_STANDARD = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime", "color_message"}
#: What the command line chose (``choose_logging``); ``None`` falls back to the environment, then the default.
_chosen: dict[str, str | None] = {"level": None, "format": None}


def _extra(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...extra, "exc"?}``, one line per record."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_extra(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def _value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    # A value with spaces or quotes stays one token, so a line still splits into key=value pairs.
    return json.dumps(text) if not text or any(c in text for c in ' "=\n') else text


class HumanFormatter(logging.Formatter):
    """``HH:MM:SS LEVEL logger message key=value ...`` (local time), then the traceback, if any, below."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields = "".join(f" {k}={_value(v)}" for k, v in _extra(record).items())
        line = f"{stamp} {record.levelname} {record.name} {record.getMessage()}{fields}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def level_of(verbose: int) -> int:
    """The root level for a ``-v`` count: warning, info (1), debug (2 or more)."""
    return logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG


def _pick(kind: str, env: str, allowed: tuple[str, ...], default: str) -> str:
    value = (_chosen[kind] or os.environ.get(env) or default).strip().lower()
    return value if value in allowed else default


def choose_logging(level: str | None = None, fmt: str | None = None) -> None:
    """Record the command line's ``--log-level``/``--log-format`` (``None``: the environment, else the default).

    Raises:
        ValueError: a level or format that is not one of ``LOG_LEVELS``/``LOG_FORMATS``.
    """
    if level is not None and level.lower() not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, not {level!r}")
    if fmt is not None and fmt.lower() not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {fmt!r}")
    _chosen["level"] = level
    _chosen["format"] = fmt


def logging_env() -> dict[str, str]:
    """The environment that gives a child process this command line's log choice (empty when none was made)."""
    env = {LOG_LEVEL_ENV: _chosen["level"], LOG_FORMAT_ENV: _chosen["format"]}
    return {name: value for name, value in env.items() if value is not None}


def _formatter(stream: TextIO) -> logging.Formatter:
    fmt = _pick("format", LOG_FORMAT_ENV, LOG_FORMATS, "auto")
    if fmt == "auto":
        isatty = getattr(stream, "isatty", None)
        fmt = "human" if isatty is not None and isatty() else "json"
    return HumanFormatter() if fmt == "human" else JsonFormatter()


def setup_logging(verbose: int = 0) -> None:
    """One handler on stderr at the chosen level (warning by default; ``-v`` info, ``-vv`` debug) and format."""
    chosen = logging.getLevelNamesMapping()[_pick("level", LOG_LEVEL_ENV, LOG_LEVELS, "warning").upper()]
    level = min(chosen, level_of(verbose))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_formatter(sys.stderr))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("nats").setLevel(max(level, logging.WARNING))


class _LineHandler(logging.Handler):
    def __init__(self, write: Callable[[str], None], formatter: logging.Formatter) -> None:
        super().__init__()
        self._write = write
        self.setFormatter(formatter)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._write(self.format(record))
        except Exception:  # noqa: BLE001 - logging's own contract: report, never raise into the caller
            self.handleError(record)


@contextlib.contextmanager
def route_logs(write: Callable[[str], None]) -> Iterator[None]:
    """While inside, hand each formatted log line to ``write`` instead of the root handlers' streams.

    The lines are formatted by the first root handler's formatter (``JsonFormatter`` when there is none),
    at the root level already set; the root handlers are restored on exit.
    """
    root = logging.getLogger()
    previous = root.handlers[:]
    formatter = next((h.formatter for h in previous if h.formatter is not None), None) or JsonFormatter()
    root.handlers[:] = [_LineHandler(write, formatter)]
    try:
        yield
    finally:
        root.handlers[:] = previous
