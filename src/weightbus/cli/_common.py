"""The names ``weightbus`` commands shared before they were split by role; kept so their imports work.

Each lives in the module of its role: ``weightbus.cli.options`` (the shared options and their
environment variables), ``weightbus.cli.checks`` (option checks), ``weightbus.cli.connection`` (the
NATS credential and TLS flags), ``weightbus.cli.exits`` (exit codes, the ``error:`` line, signals),
``weightbus.cli.metrics_server`` (``--metrics-port``) and ``weightbus.process.logs`` (log formatting).
New code imports from those modules.
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
