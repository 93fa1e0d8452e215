"""The options ``weightbus`` commands share, each with one meaning and one environment variable.

``--nats`` (``WEIGHTBUS_NATS``, else ``NATS_URL``), ``--policy`` (``WEIGHTBUS_POLICY``), ``--api-key``
(``WEIGHTBUS_API_KEY``) and the rest; each value is checked (``cli.checks``) before the command connects.
"""

from __future__ import annotations

from typing import Annotated, Final

import typer

from weightbus.bus.options import NATS_URL_ENV
from weightbus.cli.checks import check_nats_url, check_policy, check_port

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_NATS",
    "POLICY_ENV",
    "ApiKeyOption",
    "ConnectTimeoutOption",
    "EngineTimeoutOption",
    "MetricsHostOption",
    "MetricsPortOption",
    "NatsOption",
    "PolicyFilterOption",
    "PolicyOption",
    "RouterOption",
    "VerboseOption",
]

#: The client default; weightbus never starts a server on 4222 itself.
DEFAULT_NATS: Final = "nats://127.0.0.1:4222"
POLICY_ENV: Final = "WEIGHTBUS_POLICY"
API_KEY_ENV: Final = "WEIGHTBUS_API_KEY"

NatsOption = Annotated[
    str,
    typer.Option(
        "--nats",
        envvar=list(NATS_URL_ENV),
        show_envvar=True,
        help="NATS URL (or several, comma-separated); else WEIGHTBUS_NATS, else NATS_URL.",
        show_default=True,
        callback=check_nats_url,
    ),
]
PolicyOption = Annotated[
    str,
    typer.Option(
        "--policy",
        "-p",
        envvar=POLICY_ENV,
        show_envvar=True,
        help="Policy id (letters, digits, '_' and '-').",
        callback=check_policy,
    ),
]
PolicyFilterOption = Annotated[
    str | None,
    typer.Option(
        "--policy",
        "-p",
        envvar=POLICY_ENV,
        show_envvar=True,
        help="Only this policy (default: every policy; WEIGHTBUS_POLICY= watches every one).",
        callback=check_policy,
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
        "--api-key", envvar=API_KEY_ENV, help="Bearer token of engines started with --api-key.", show_envvar=True
    ),
]
EngineTimeoutOption = Annotated[
    float, typer.Option("--engine-timeout", min=0.001, help="Seconds per engine HTTP request.")
]
RouterOption = Annotated[
    str | None, typer.Option("--router", help="Router whose GET /workers lists the engines (instead of --engine).")
]
ConnectTimeoutOption = Annotated[float, typer.Option("--connect-timeout", help="Seconds to wait for NATS.")]
VerboseOption = Annotated[int, typer.Option("--verbose", "-v", count=True, help="More logs: -v info, -vv debug.")]
