"""The NATS credential, TLS and stream flags a connecting command takes, gathered into one ``ConnectOptions``.

``with_connection(command)`` adds ``CONNECTION_FLAGS``; a bad combination is one ``error:`` line, exit 2.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

from weightbus.bus.options import ENV, ConnectOptions
from weightbus.cli.exits import EXIT_USAGE, fail
from weightbus.errors import BusConfigError

__all__ = ["CONNECTION_FLAGS", "with_connection"]

T = TypeVar("T")


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
            connection = ConnectOptions(**{k: v for k, v in values.items() if v is not None})
            # A missing or unreadable CA, certificate or key is a bad flag: named now, before anything starts.
            connection.check_files()
            connection.tls_context()
            kwargs["connection"] = connection
        except BusConfigError as exc:
            raise fail(str(exc), EXIT_USAGE) from None
        return command(*args, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*params, *CONNECTION_FLAGS])  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in wrapper.__signature__.parameters.values()}  # type: ignore[attr-defined]
    return wrapper
