"""The names ``weightbus`` commands shared before they were split by role; kept so their imports work.

Each lives in its role's module (``options``, ``checks``, ``connection``, ``exits``, ``metrics_server``, ``logs``).
"""

from __future__ import annotations

from weightbus.cli.checks import check_nats_url, check_policy, check_port, check_writable_dir, check_writable_file
from weightbus.cli.connection import CONNECTION_FLAGS, with_connection
from weightbus.cli.exits import EXIT_USAGE, fail, run_async
from weightbus.cli.metrics_server import start_metrics
from weightbus.cli.options import (
    DEFAULT_NATS,
    ApiKeyOption,
    ConnectTimeoutOption,
    EngineTimeoutOption,
    MetricsHostOption,
    MetricsPortOption,
    NatsOption,
    PolicyOption,
    RouterOption,
    VerboseOption,
)
from weightbus.process.logs import setup_logging

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
    "check_policy",
    "check_port",
    "check_writable_dir",
    "check_writable_file",
    "fail",
    "run_async",
    "setup_logging",
    "start_metrics",
    "with_connection",
]
