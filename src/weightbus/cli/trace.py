"""``weightbus record`` and ``weightbus replay``: capture events to JSON Lines and republish them.

``replay`` validates the whole trace before it publishes anything (docs/trace-format.md).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import IO, Annotated, Final

import msgspec
import typer

from weightbus.bus import subjects
from weightbus.bus.options import ConnectOptions
from weightbus.bus.protocol import Deliver
from weightbus.bus.trace import TraceRecord, read_trace
from weightbus.bus.trace import record as record_events
from weightbus.bus.trace import replay as replay_events
from weightbus.cli.checks import check_policy, check_writable_file
from weightbus.cli.connection import with_connection
from weightbus.cli.exits import EXIT_DENIED, EXIT_USAGE, fail, run_async
from weightbus.cli.metrics_server import start_metrics
from weightbus.cli.options import DEFAULT_NATS, MetricsHostOption, MetricsPortOption, NatsOption, VerboseOption
from weightbus.errors import BusError, InvalidEventError, InvalidPolicyError, PermissionDeniedError
from weightbus.process.logs import setup_logging
from weightbus.schemas import decode, encode

__all__ = ["EXIT_LIVE_POLICY", "prepare_replay", "record_command", "recording_line", "register", "replay_command"]

EXIT_LIVE_POLICY: Final = 3
EXIT_NATS: Final = 5


def record_command(
    out: Annotated[
        Path,
        typer.Option(
            "--out", "-o", help="Trace file to write (JSON Lines; '-' for stdout).", callback=check_writable_file
        ),
    ],
    subjects_: Annotated[str, typer.Option("--subjects", help="Subject pattern to record.")] = "weightbus.>",
    deliver: Annotated[
        Deliver,
        typer.Option(
            "--deliver",
            help="new: only events published from now on (an idle bus records nothing); last_per_subject: the "
            "latest stored event of each subject first; all: the retained history from its start first.",
        ),
    ] = Deliver.NEW,
    count: Annotated[int | None, typer.Option("--count", min=1, help="Stop after this many events.")] = None,
    duration: Annotated[float | None, typer.Option("--duration", min=0.0, help="Stop after this many seconds.")] = None,
    nats: NatsOption = DEFAULT_NATS,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
    metrics_port: MetricsPortOption = None,
    metrics_host: MetricsHostOption = "127.0.0.1",
    verbose: VerboseOption = 0,
) -> None:
    """Record events (subject, headers, receive time, wire JSON) to a JSON Lines trace until Ctrl-C.

    By default only new events are recorded (--deliver new): on an idle bus, --count N waits for N new
    events; --deliver all records the retained history first. One line on stderr says which at start.
    The format is documented in docs/trace-format.md; `weightbus replay` republishes a trace.
    Exit codes: 0 done, 2 bad arguments or unwritable --out, 5 NATS unreachable, 77 denied, 130/143 interrupted.
    """
    setup_logging(verbose)
    pattern = subjects_.strip()
    if not pattern or any(c.isspace() for c in pattern) or "" in pattern.split("."):
        raise fail(f"--subjects {subjects_!r} is not a subject pattern (e.g. 'weightbus.>')", EXIT_USAGE)

    async def _run(sink: IO[bytes]) -> int:
        from prometheus_client import CollectorRegistry

        from weightbus.bus.metrics import BusMetrics
        from weightbus.bus.nats import connect

        registry = CollectorRegistry()
        start_metrics(metrics_port, registry, metrics_host)
        bus = await connect(nats, name="weightbus-record", metrics=BusMetrics(registry), options=connection)
        try:
            typer.echo(recording_line(pattern, deliver, out), err=True)
            return await record_events(bus, sink, pattern=pattern, deliver=deliver, count=count, duration=duration)
        finally:
            await bus.aclose()

    try:
        with contextlib.ExitStack() as files:
            # Opened before connecting (and outside the loop): a path that cannot be written fails first.
            sink = sys.stdout.buffer if str(out) == "-" else files.enter_context(open(out, "ab"))
            n = run_async(_run(sink))
    except OSError as exc:
        raise fail(f"cannot write {out}: {exc.strerror or exc}", EXIT_USAGE) from None
    except PermissionDeniedError as exc:
        raise fail(str(exc), EXIT_DENIED) from None
    except BusError as exc:
        raise fail(str(exc), EXIT_NATS) from None
    typer.echo(f"recorded {n} events", err=True)


_WHAT: Final = {
    Deliver.NEW: "new events only, from now on (--deliver all records the retained history too)",
    Deliver.LAST_PER_SUBJECT: "the latest stored event of each subject, then new events",
    Deliver.ALL: "the retained history from its start, then new events",
}


def recording_line(pattern: str, deliver: Deliver, out: Path | str) -> str:
    """The line ``record`` prints when it starts: what it records, and where."""
    where = "stdout" if str(out) == "-" else str(out)
    return f"recording {pattern} to {where}: {_WHAT[deliver]}"


def _rewrite_msg_id(msg_id: str, old: str, new: str) -> str:
    return f"{new}:{msg_id[len(old) + 1 :]}" if msg_id.startswith(f"{old}:") else f"{new}:{msg_id}"


def prepare_replay(records: list[TraceRecord], *, source: str, policy: str | None = None) -> list[TraceRecord]:
    """Validate every record of a trace, and rewrite it under ``policy`` when given.

    Args:
        records: the trace's records, in order.
        source: the trace's name, for error messages.
        policy: replay under this policy id instead of the recorded one (the trace must hold one policy).

    Returns:
        The records to publish.

    Raises:
        ValueError: a subject is not a concrete weightbus subject, a payload fails the typed decode
            (e.g. a negative version, an oversized event), ``policy`` is invalid, or the trace holds
            several policies and ``policy`` was given.
    """
    if policy is not None:
        subjects.validate_policy(policy)
    out: list[TraceRecord] = []
    seen: set[str] = set()
    for n, rec in enumerate(records, 1):
        where = f"{source}: record {n}"
        subject = rec.subject
        old = subjects.policy_of(subject) if subject == subject.strip() else None
        if old is None or any(c.isspace() for c in subject) or "*" in subject or ">" in subject:
            raise ValueError(f"{where}: subject {subject!r} is not a concrete weightbus.<policy>.<family> subject")
        try:
            subjects.validate_policy(old)
            event = decode(subject, bytes(rec.event))
        except (InvalidEventError, InvalidPolicyError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        if getattr(event, "policy", old) != old:
            raise ValueError(f"{where}: the event's policy {event.policy!r} does not match its subject {subject!r}")
        seen.add(old)
        if policy is None:
            out.append(rec)
            continue
        if len(seen) > 1:
            raise ValueError(
                f"{where}: the trace holds several policies ({', '.join(sorted(seen))}); --as-policy needs one"
            )
        event = msgspec.structs.replace(event, policy=policy)
        headers = dict(rec.headers)
        if "Nats-Msg-Id" in headers:
            headers["Nats-Msg-Id"] = _rewrite_msg_id(headers["Nats-Msg-Id"], old, policy)
        new_subject = f"{subjects.PREFIX}.{policy}.{subject.rsplit('.', 1)[1]}"
        out.append(
            TraceRecord(
                subject=new_subject,
                received_at=rec.received_at,
                event=msgspec.Raw(encode(event)),
                headers=headers,
                seq=rec.seq,
            )
        )
    return out


class _LivePolicyError(Exception):
    pass


def replay_command(
    trace: Annotated[Path, typer.Argument(help="A trace written by `weightbus record`.", exists=True, dir_okay=False)],
    speed: Annotated[
        float, typer.Option("--speed", min=0.0, help="0: as fast as possible; X: recorded pacing divided by X.")
    ] = 0.0,
    new_ids: Annotated[
        bool, typer.Option("--new-ids", help="Suffix message ids, to replay into the stream the trace came from.")
    ] = False,
    as_policy: Annotated[
        str | None,
        typer.Option(
            "--as-policy", help="Replay under this policy id (rewrites subjects and events).", callback=check_policy
        ),
    ] = None,
    force: Annotated[
        bool,
        typer.Option("--force", help="Replay into a policy that already has events (re-stores old versions)."),
    ] = False,
    nats: NatsOption = DEFAULT_NATS,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
    verbose: VerboseOption = 0,
) -> None:
    """Republish a recorded trace, in order, into a NATS (keeping each event's Nats-Msg-Id unless --new-ids).

    Every record is validated first (concrete subject, valid event); nothing is published if one fails.
    A policy whose weights subject already has events needs --force (replaying would fence its trainer);
    --as-policy NEW replays the trace under another policy id.

    Exit codes: 0 done, 2 invalid trace or arguments, 3 target policy has events (no --force), 5 NATS unreachable,
    77 denied.
    """
    setup_logging(verbose)
    try:
        records = prepare_replay(list(read_trace(trace)), source=str(trace), policy=as_policy)
    except (ValueError, OSError) as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    targets = sorted({p for r in records if (p := subjects.policy_of(r.subject)) is not None})

    async def _run() -> int:
        import time

        from weightbus.bus.nats import connect

        bus = await connect(nats, name="weightbus-replay", options=connection)
        try:
            if not force:
                for target in targets:
                    try:
                        stored = await bus.last(subjects.weights(target)) is not None
                    except InvalidEventError:
                        stored = True
                    if stored:
                        raise _LivePolicyError(
                            f"policy {target!r} already has events on {subjects.weights(target)}; replaying would "
                            "re-store old versions and fence its trainer: pass --force, or --as-policy NEW"
                        )
            suffix = f":replay-{time.time_ns()}" if new_ids else None
            acks = await replay_events(records, bus, speed=speed or None, msg_id_suffix=suffix)
        finally:
            await bus.aclose()
        return sum(1 for ack in acks if not ack.duplicate)

    try:
        n = run_async(_run())
    except _LivePolicyError as exc:
        raise fail(str(exc), EXIT_LIVE_POLICY) from None
    except PermissionDeniedError as exc:
        raise fail(str(exc), EXIT_DENIED) from None
    except BusError as exc:
        raise fail(str(exc), EXIT_NATS) from None
    typer.echo(f"replayed {n} new events", err=True)


def register(app: typer.Typer) -> None:
    """Add ``record`` and ``replay`` to ``app``."""
    app.command("record")(with_connection(record_command))
    app.command("replay")(with_connection(replay_command))
