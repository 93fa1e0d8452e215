"""The ``weightbus`` command line: ``weightbus <command> --help`` explains each command.

Each command lives in its own module with a ``register(app)`` function; this module only assembles
them. Heavy imports (torch, starlette) happen inside the commands that need them.
"""

from __future__ import annotations

import typer

from weightbus.cli import demo, engine, follow, publish, schema, server, status, stream, trace, watch

__all__ = ["app", "main"]

app = typer.Typer(
    name="weightbus",
    help=(
        "Weight versions for fully-async RL over NATS JetStream: trainers publish the version after each "
        "engine push; rollout managers follow it and judge the staleness of drained groups."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

for _module in (server, stream, schema, trace, publish, status, watch, follow, engine, demo):
    _module.register(app)


def main() -> None:
    """Console-script entry point."""
    app()
