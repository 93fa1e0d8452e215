"""The NATS credential, TLS and stream flags a connecting command takes, gathered into one ``ConnectOptions``.

``with_connection(command)`` adds ``CONNECTION_FLAGS``; a bad combination is one ``error:`` line, exit 2.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from weightbus.bus.options import ENV, NATS_CONTEXT_ENV, NATS_ENV, ConnectOptions, NatsContext, load_context
from weightbus.cli.checks import check_nats_url
from weightbus.cli.config_flags import CONFIG_FILE_PARAM
from weightbus.cli.exits import EXIT_USAGE, fail
from weightbus.errors import BusConfigError

__all__ = ["CONNECTION_FLAGS", "with_connection"]

T = TypeVar("T")


#: The parameters a command's NATS URL may have; a context's ``url`` fills the one left at its default.
_URL_PARAMS = ("nats", "nats_url")
#: The parameters a command's ``--config FILE`` may have (``cli.config_flags`` names it ``CONFIG_FILE_PARAM``).
_CONFIG_PARAMS = ("config", CONFIG_FILE_PARAM)
#: The parameter through which typer hands the wrapper its context (where each value came from).
_TYPER_CONTEXT = inspect.Parameter("_typer_context", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)


def _flag(name: str, field: str, help_text: str, *, is_int: bool = False) -> inspect.Parameter:
    kind = int | None if is_int else str | None
    if field in NATS_ENV:
        help_text = f"{help_text} Else {NATS_ENV[field]}, else the --context."
    option = typer.Option(f"--{name}", envvar=ENV[field], help=help_text, show_envvar=True, rich_help_panel="NATS")
    return inspect.Parameter(field, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[kind, option])


_CONTEXT_FLAG = inspect.Parameter(
    "context",
    inspect.Parameter.KEYWORD_ONLY,
    default=None,
    annotation=Annotated[
        str | None,
        typer.Option(
            "--context",
            envvar=NATS_CONTEXT_ENV,
            show_envvar=True,
            rich_help_panel="NATS",
            help="nats CLI context (~/.config/nats/context/NAME.json): its url, creds, nkey, token, user,"
            " password, ca, cert and key fill what no flag or variable gives.",
        ),
    ],
)

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
    _CONTEXT_FLAG,
)


def _config_file_names_url(kwargs: dict[str, Any]) -> bool:
    """Whether the command's ``--config`` file sets ``nats_url`` (an explicit value, above a context)."""
    path = next((kwargs[name] for name in _CONFIG_PARAMS if kwargs.get(name) is not None), None)
    if path is None:
        return False
    try:
        data = json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
        return False  # the command itself reports an unreadable config file, before it connects
    return isinstance(data, dict) and "nats_url" in data


def _url_from_context(kwargs: dict[str, Any], context: NatsContext, typer_context: typer.Context | None) -> None:
    """Put the context's URL in the command's URL parameter when no flag, variable or config file set one."""
    if not context.url or _config_file_names_url(kwargs):
        return
    for name in _URL_PARAMS:
        if name not in kwargs:
            continue
        source = typer_context.get_parameter_source(name) if typer_context is not None else None
        if kwargs[name] is None or (source is not None and source.name in ("DEFAULT", "DEFAULT_MAP")):
            kwargs[name] = check_nats_url(context.url)


def with_connection(command: Callable[..., T]) -> Callable[..., T]:
    """Add the ``CONNECTION_FLAGS`` to a typer command that takes ``connection: ConnectOptions``.

    The command sees one ``connection`` argument built from the flags, their environment variables and
    the ``--context`` (see the module docstring) and passes it to ``connect(..., options=connection)``.
    Invalid combinations and unreadable contexts exit with code 2.
    """
    signature = inspect.signature(command, eval_str=True)
    params = [p for p in signature.parameters.values() if p.name != "connection"]
    flags = [p.name for p in CONNECTION_FLAGS if p.name != "context"]

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        values = {name: kwargs.pop(name, None) for name in flags}
        context_name = kwargs.pop("context", None)
        typer_context = kwargs.pop(_TYPER_CONTEXT.name, None)
        try:
            context = load_context(context_name) if context_name else None
            if context is not None:
                _url_from_context(kwargs, context, typer_context)
            connection = ConnectOptions.from_sources(values, os.environ, context=context)
            # A missing or unreadable CA, certificate or key is a bad flag: named now, before anything starts.
            connection.check_files()
            connection.tls_context()
            kwargs["connection"] = connection
        except BusConfigError as exc:
            raise fail(str(exc), EXIT_USAGE) from None
        return command(*args, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*params, *CONNECTION_FLAGS, _TYPER_CONTEXT])  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in wrapper.__signature__.parameters.values()}  # type: ignore[attr-defined]
    return wrapper
