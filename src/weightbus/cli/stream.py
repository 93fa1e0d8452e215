"""``weightbus stream create|check``: the admin side of the ``WEIGHTBUS`` stream (docs/operations.md).

``create`` creates or upgrades the stream (``deny_delete``, ``deny_purge`` on by default); ``check`` only reads.
"""

from __future__ import annotations

from typing import Annotated, Final

import typer

from weightbus.bus.options import ConnectOptions
from weightbus.cli.connection import with_connection
from weightbus.cli.exits import EXIT_DENIED, fail, run_async
from weightbus.cli.options import DEFAULT_NATS, ConnectTimeoutOption, NatsOption, VerboseOption
from weightbus.errors import BusConnectError, BusError, PermissionDeniedError, StreamNotFoundError
from weightbus.process.logs import setup_logging

__all__ = ["EXIT_BUS", "EXIT_MISMATCH", "check_command", "create_command", "register"]

EXIT_MISMATCH: Final = 1
EXIT_BUS: Final = 5

HistoryOption = Annotated[int, typer.Option("--history", min=1, help="Events kept per subject (at least).")]
WindowOption = Annotated[
    float, typer.Option("--duplicate-window", min=1.0, help="Seconds a Nats-Msg-Id is remembered (at least).")
]
StreamOption = Annotated[str, typer.Option("--stream", help="Stream name.")]

stream_app = typer.Typer(
    name="stream",
    help="Create, upgrade or check the WEIGHTBUS JetStream stream (admin).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def create_command(
    allow_delete: Annotated[bool, typer.Option("--allow-delete", help="Leave deny_delete off.")] = False,
    allow_purge: Annotated[bool, typer.Option("--allow-purge", help="Leave deny_purge off.")] = False,
    history: HistoryOption = 256,  # weightbus.bus.stream.DEFAULT_HISTORY (not imported: nats-py is lazy here)
    duplicate_window: WindowOption = 120.0,
    stream: StreamOption = "WEIGHTBUS",
    nats: NatsOption = DEFAULT_NATS,
    connect_timeout: ConnectTimeoutOption = 5.0,
    verbose: VerboseOption = 0,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
) -> None:
    """Create the stream, or upgrade it: subjects, history, duplicate window, replicas (--replicas),
    deny_delete and deny_purge.

    Prints what was done: created, upgraded or unchanged, and the resulting configuration.
    """
    setup_logging(verbose)
    from weightbus.bus.nats import connect
    from weightbus.bus.stream import StreamRequirements

    async def _run() -> str:
        bus = await connect(
            nats,
            name="weightbus-stream",
            connect_timeout=connect_timeout,
            stream=stream,
            ensure_stream=False,
            options=connection,
        )
        try:
            req = StreamRequirements(history=history, duplicate_window=duplicate_window)
            outcome, described = await bus.create_or_upgrade_stream(
                req, replicas=connection.replicas, deny_delete=not allow_delete, deny_purge=not allow_purge
            )
            return f"{outcome}: {described}"
        finally:
            await bus.aclose()

    try:
        typer.echo(run_async(_run()))
    except BusConnectError as exc:
        code = EXIT_MISMATCH if exc.cause == "stream" else EXIT_BUS
        raise fail(str(exc), code) from None
    except PermissionDeniedError as exc:
        raise fail(str(exc), EXIT_DENIED) from None
    except BusError as exc:
        raise fail(str(exc), EXIT_BUS) from None


def check_command(
    history: HistoryOption = 256,  # weightbus.bus.stream.DEFAULT_HISTORY (not imported: nats-py is lazy here)
    duplicate_window: WindowOption = 120.0,
    stream: StreamOption = "WEIGHTBUS",
    nats: NatsOption = DEFAULT_NATS,
    connect_timeout: ConnectTimeoutOption = 5.0,
    verbose: VerboseOption = 0,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
) -> None:
    """Check, without changing anything, that the stream exists and gives weightbus what it relies on."""
    setup_logging(verbose)
    from weightbus.bus.nats import connect
    from weightbus.bus.stream import StreamRequirements

    async def _run() -> tuple[str, list[str]]:
        bus = await connect(
            nats,
            name="weightbus-stream",
            connect_timeout=connect_timeout,
            stream=stream,
            ensure_stream=False,
            options=connection,
        )
        try:
            return await bus.check_stream(StreamRequirements(history, duplicate_window))
        finally:
            await bus.aclose()

    try:
        described, problems = run_async(_run())
    except StreamNotFoundError:
        raise fail(
            f"stream {stream} does not exist (create it with `weightbus stream create`)", EXIT_MISMATCH
        ) from None
    except BusConnectError as exc:
        raise fail(str(exc), EXIT_MISMATCH if exc.cause == "stream" else EXIT_BUS) from None
    except PermissionDeniedError as exc:
        raise fail(str(exc), EXIT_DENIED) from None
    except BusError as exc:
        raise fail(str(exc), EXIT_BUS) from None
    typer.echo(described)
    if problems:
        raise fail("; ".join(problems), EXIT_MISMATCH)
    typer.echo("ok: the stream fits weightbus")


stream_app.command("create")(with_connection(create_command))
stream_app.command("check")(with_connection(check_command))


def register(app: typer.Typer) -> None:
    """Add ``stream create|check`` to ``app``."""
    app.add_typer(stream_app, name="stream")
