"""Where a drop-in's settings come from: ``args.weightbus_<name>``, else ``WEIGHTBUS_<NAME>``, else a default.

One lookup for every host and both halves, so a setting has one name everywhere. Pure: no I/O beyond ``os.environ``.
"""

from __future__ import annotations

import os
from typing import Any, Final

__all__ = ["DEFAULT_METRICS_HOST", "DEFAULT_NATS", "metrics_address", "seconds", "setting"]

DEFAULT_NATS: Final = "nats://127.0.0.1:4222"
#: The interface a metrics port binds by default, as ``weightbus rollout --metrics-host``.
DEFAULT_METRICS_HOST: Final = "127.0.0.1"


def setting(args: Any, name: str, env: str, default: str | None = None) -> str | None:
    """``args.<name>`` when set and not empty, else ``$<env>``, else ``default``."""
    value = getattr(args, name, None)
    if value is None or value == "":
        value = os.environ.get(env) or default
    return None if value is None else str(value)


def metrics_address(args: Any, name: str, env: str) -> tuple[str, int] | None:
    """Where a half serves its metrics: ``(host, port)`` from ``args.<name>`` / ``$<env>`` and
    ``weightbus_metrics_host`` / ``WEIGHTBUS_METRICS_HOST`` (default 127.0.0.1), or None when no port is set.

    Raises:
        ValueError: a port that is not in 1-65535.
    """
    raw = setting(args, name, env)
    if raw is None:
        return None
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"{env} (args.{name}) must be a port, not {raw!r}") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"{env} (args.{name}) must be a port in 1-65535, not {port}")
    host = setting(args, "weightbus_metrics_host", "WEIGHTBUS_METRICS_HOST", DEFAULT_METRICS_HOST)
    return host or DEFAULT_METRICS_HOST, port


def seconds(args: Any, name: str, env: str, default: str) -> float:
    """``setting`` as a number of seconds >= 0.

    Raises:
        ValueError: not a number, or negative.
    """
    raw = setting(args, name, env, default)
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{env} (args.{name}) must be a number of seconds, not {raw!r}") from None
    if value < 0:
        raise ValueError(f"{env} (args.{name}) must be >= 0 seconds, not {value}")
    return value
