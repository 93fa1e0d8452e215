"""The ``weightbus`` command line: ``weightbus <command> --help`` explains each command.

Each command is a module with ``register(app)``; heavy imports (torch, starlette) happen inside the commands.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version
from typing import Annotated

import typer

from weightbus.cli import catchup, demo, engine, follow, publish, rl, schema, server, status, stream, trace, watch
from weightbus.cli.exits import CommandGroup as _CommandGroup
from weightbus.cli.options import with_log_options as _with_log_options

__all__ = ["app", "main", "package_version"]

app = typer.Typer(
    name="weightbus",
    cls=_CommandGroup,
    help=(
        "Weight versions for fully-async RL over NATS JetStream: trainers publish the version after each "
        "engine push; rollout managers follow it and judge the staleness of drained groups.\n\n"
        "Exit codes shared by every command: 0 success, 1 runtime failure, 2 bad arguments, 5 NATS "
        "unreachable, 77 permission denied, 130 interrupted (Ctrl-C), 143 terminated (SIGTERM); each command's "
        "--help lists its own.\n\n"
        "The NATS URL is --nats (-s, --server), else WEIGHTBUS_NATS, else NATS_URL, else the url of the nats CLI "
        "context named by --context or NATS_CONTEXT; the policy is --policy, else WEIGHTBUS_POLICY.\n\n"
        "Commands run on uvloop when it is installed; WEIGHTBUS_EVENT_LOOP=asyncio runs them on asyncio's own loop."
    ),
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)


def package_version() -> str:
    """The installed weightbus version."""
    try:
        return _dist_version("weightbus")
    except PackageNotFoundError:
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"weightbus {package_version()}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """The root options (--version); the help text is the app's."""


for _module in (server, stream, schema, trace, publish, status, catchup, watch, follow, engine, rl, demo):
    _module.register(app)


def _add_log_options(group: typer.Typer) -> None:
    """Every command, in sub-groups too, takes ``--log-level`` and ``--log-format`` (``cli.options.LOG_FLAGS``)."""
    for command in group.registered_commands:
        if command.callback is not None:
            command.callback = _with_log_options(command.callback)
    for sub in group.registered_groups:
        if sub.typer_instance is not None:
            _add_log_options(sub.typer_instance)


_add_log_options(app)


def main() -> None:
    """Console-script entry point."""
    app()
