"""The options ``weightbus`` commands share, each with one meaning and one environment variable.

``--nats`` (``WEIGHTBUS_NATS``, else ``NATS_URL``), ``--policy`` (``WEIGHTBUS_POLICY``), ``--api-key``
(``WEIGHTBUS_API_KEY``) and the rest; each value is checked (``cli.checks``) before the command connects.
``with_log_options(command)`` gives a command ``--log-level`` and ``--log-format`` (``LOG_FLAGS``); the root app
wraps every command with it, so each takes them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any, Final, TypeVar

import typer

from weightbus.bus.options import NATS_URL_ENV
from weightbus.cli.checks import check_nats_url, check_policy, check_port
from weightbus.cli.exits import EXIT_USAGE, fail
from weightbus.process.logs import LOG_FORMAT_ENV, LOG_FORMATS, LOG_LEVEL_ENV, LOG_LEVELS, choose_logging, setup_logging

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_NATS",
    "LOG_FLAGS",
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
    "with_log_options",
]

T = TypeVar("T")

#: The client default; weightbus never starts a server on 4222 itself.
DEFAULT_NATS: Final = "nats://127.0.0.1:4222"
POLICY_ENV: Final = "WEIGHTBUS_POLICY"
API_KEY_ENV: Final = "WEIGHTBUS_API_KEY"

NatsOption = Annotated[
    str,
    typer.Option(
        "--nats",
        "--server",
        "-s",
        envvar=list(NATS_URL_ENV),
        show_envvar=True,
        help="NATS URL (or several, comma-separated); else WEIGHTBUS_NATS, else NATS_URL, else the --context's url.",
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


def _check_choice(flag: str, allowed: tuple[str, ...]) -> Callable[[str | None], str | None]:
    def check(value: str | None) -> str | None:
        if value is None:
            return None
        if value.strip().lower() not in allowed:
            raise fail(f"{flag} {value!r}: expected one of {', '.join(allowed)}", EXIT_USAGE)
        return value.strip().lower()

    return check


#: ``--log-level`` and ``--log-format``, each also read from its WEIGHTBUS_LOG_* variable.
LOG_FLAGS = (
    inspect.Parameter(
        "log_level",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[
            str | None,
            typer.Option(
                "--log-level",
                envvar=LOG_LEVEL_ENV,
                show_envvar=True,
                metavar="|".join(LOG_LEVELS),
                rich_help_panel="Logs",
                help="Lowest level logged on stderr (default: warning; -v/-vv, where a command has them, go lower).",
                callback=_check_choice("--log-level", LOG_LEVELS),
            ),
        ],
    ),
    inspect.Parameter(
        "log_format",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[
            str | None,
            typer.Option(
                "--log-format",
                envvar=LOG_FORMAT_ENV,
                show_envvar=True,
                metavar="|".join(LOG_FORMATS),
                rich_help_panel="Logs",
                help="human (time level logger message key=value), json (one object per line), or auto "
                "(default: human on a terminal, json otherwise).",
                callback=_check_choice("--log-format", LOG_FORMATS),
            ),
        ],
    ),
)


def with_log_options(command: Callable[..., T]) -> Callable[..., T]:
    """Add ``LOG_FLAGS`` to a typer command: they set up the logs before it runs (it may still add ``-v``)."""
    signature = inspect.signature(command, eval_str=True)
    if any(p.name in signature.parameters for p in LOG_FLAGS):
        return command  # already wrapped (the app is built once per process, but tests may build it again)

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        choose_logging(kwargs.pop("log_level", None), kwargs.pop("log_format", None))
        setup_logging()
        try:
            return command(*args, **kwargs)
        finally:
            choose_logging()  # the choice is this invocation's, not the next one's (tests invoke many in one process)

    params = list(signature.parameters.values())
    wrapper.__signature__ = signature.replace(parameters=[*params, *LOG_FLAGS])  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in wrapper.__signature__.parameters.values()}  # type: ignore[attr-defined]
    return wrapper
