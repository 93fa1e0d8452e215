"""Log formatting for weightbus processes: one JSON object per line on stderr, quiet by default.

``route_logs(write)`` sends the same lines elsewhere for a while (``watch``'s console), then restores the handlers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["JsonFormatter", "level_of", "route_logs", "setup_logging"]

_STANDARD = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...extra, "exc"?}``, one line per record."""

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


def level_of(verbose: int) -> int:
    """The root level for a ``-v`` count: warning, info (1), debug (2 or more)."""
    return logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG


def setup_logging(verbose: int = 0) -> None:
    """JSON lines on stderr; warnings by default, info with ``-v``, debug with ``-vv``."""
    level = level_of(verbose)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
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
