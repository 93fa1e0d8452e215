"""``weightbus record`` and ``weightbus replay``: capture events to JSON Lines and republish them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from weightbus.bus.options import ConnectOptions
from weightbus.bus.protocol import Deliver
from weightbus.bus.trace import read_trace
from weightbus.bus.trace import record as record_events
from weightbus.bus.trace import replay as replay_events
from weightbus.cli._common import (
    DEFAULT_NATS,
    MetricsPortOption,
    NatsOption,
    VerboseOption,
    fail,
    run_async,
    setup_logging,
    start_metrics,
    with_connection,
)
from weightbus.errors import BusError

__all__ = ["register"]


def record_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="Trace file to write (JSON Lines; '-' for stdout).")],
    subjects: Annotated[str, typer.Option("--subjects", help="Subject pattern to record.")] = "weightbus.>",
    deliver: Annotated[
        Deliver, typer.Option("--deliver", help="new: from now on; last_per_subject: current first; all: history.")
    ] = Deliver.NEW,
    count: Annotated[int | None, typer.Option("--count", help="Stop after this many events.")] = None,
    duration: Annotated[float | None, typer.Option("--duration", help="Stop after this many seconds.")] = None,
    nats: NatsOption = DEFAULT_NATS,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
    metrics_port: MetricsPortOption = None,
    verbose: VerboseOption = 0,
) -> None:
    """Record events (subject, headers, receive time, wire JSON) to a JSON Lines trace until Ctrl-C.

    The format is documented in docs/trace-format.md; `weightbus replay` republishes a trace.
    """
    setup_logging(verbose)

    async def _run() -> int:
        from prometheus_client import CollectorRegistry

        from weightbus.bus.metrics import BusMetrics
        from weightbus.bus.nats import connect

        registry = CollectorRegistry()
        start_metrics(metrics_port, registry)
        bus = await connect(nats, name="weightbus-record", metrics=BusMetrics(registry), options=connection)
        try:
            if str(out) == "-":
                return await record_events(
                    bus, sys.stdout.buffer, pattern=subjects, deliver=deliver, count=count, duration=duration
                )
            with open(out, "ab") as f:
                return await record_events(bus, f, pattern=subjects, deliver=deliver, count=count, duration=duration)
        finally:
            await bus.close()

    try:
        n = run_async(_run())
    except BusError as exc:
        raise fail(str(exc)) from None
    typer.echo(f"recorded {n} events", err=True)


def replay_command(
    trace: Annotated[Path, typer.Argument(help="A trace written by `weightbus record`.", exists=True, dir_okay=False)],
    speed: Annotated[
        float, typer.Option("--speed", help="0: as fast as possible; X: recorded pacing divided by X.")
    ] = 0.0,
    new_ids: Annotated[
        bool, typer.Option("--new-ids", help="Suffix message ids, to replay into the stream the trace came from.")
    ] = False,
    nats: NatsOption = DEFAULT_NATS,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
    verbose: VerboseOption = 0,
) -> None:
    """Republish a recorded trace, in order, into a NATS (keeping each event's Nats-Msg-Id unless --new-ids)."""
    setup_logging(verbose)

    async def _run() -> int:
        import time

        from weightbus.bus.nats import connect

        try:
            records = list(read_trace(trace))
        except ValueError as exc:
            raise fail(str(exc)) from None
        bus = await connect(nats, name="weightbus-replay", options=connection)
        try:
            suffix = f":replay-{time.time_ns()}" if new_ids else None
            acks = await replay_events(records, bus, speed=speed or None, msg_id_suffix=suffix)
        finally:
            await bus.close()
        return sum(1 for ack in acks if not ack.duplicate)

    try:
        n = run_async(_run())
    except BusError as exc:
        raise fail(str(exc)) from None
    typer.echo(f"replayed {n} new events", err=True)


def register(app: typer.Typer) -> None:
    """Add ``record`` and ``replay`` to ``app``."""
    app.command("record")(with_connection(record_command))
    app.command("replay")(with_connection(replay_command))
