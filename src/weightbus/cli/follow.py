"""``weightbus follow``: run a ``VersionTracker`` for one policy and print each version change.

One line per change, held regression, rejected event and deaf or back transition. Exit codes: docs/cli.md.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Annotated, Final

import msgspec
import typer
from prometheus_client import CollectorRegistry

from weightbus.bus.metrics import BusMetrics
from weightbus.bus.options import ConnectOptions
from weightbus.cli.connection import with_connection
from weightbus.cli.exits import EXIT_DENIED, EXIT_USAGE, fail, run_async
from weightbus.cli.metrics_server import start_metrics
from weightbus.cli.options import (
    DEFAULT_NATS,
    MetricsHostOption,
    MetricsPortOption,
    NatsOption,
    PolicyOption,
    VerboseOption,
)
from weightbus.consumers.tracker.metrics import TrackerMetrics
from weightbus.consumers.tracker.tracker import TrackerStatus, VersionChange, VersionTracker
from weightbus.errors import BusError, InvalidPolicyError, PermissionDeniedError, VersionRegressionError
from weightbus.process.logs import setup_logging
from weightbus.rules.chain import RegressionMode

__all__ = ["EXIT_REGRESSION", "follow_command", "format_change", "register"]

EXIT_REGRESSION: Final = 3
EXIT_NATS: Final = 5
_encoder = msgspec.json.Encoder()


def format_change(change: VersionChange, *, json_out: bool = False) -> str:
    """One output line for a change: human text, or a JSON object with every field."""
    if json_out:
        return _encoder.encode(msgspec.structs.asdict(change)).decode()
    parts = [f"{change.action}", f"epoch {change.epoch}", change.publisher]
    if change.lag is not None:
        parts.append(f"lag {change.lag:.3f}s")
    if change.replayed:
        parts.append("replayed")
    if change.action == "held":
        return f"{change.policy}: held v{change.version}, ignored v{change.incoming} ({', '.join(parts)})"
    if change.action == "rejected":
        return (
            f"{change.policy}: held v{change.version}, rejected v{change.incoming}: {change.reason} "
            f"({', '.join(parts)})"
        )
    return f"{change.policy}: v{change.version} ({', '.join(parts)})"


def _emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def follow_command(
    policy: PolicyOption,
    regression: Annotated[
        RegressionMode,
        typer.Option("--regression", help="On a lower version: hold (keep the higher), follow, or raise (exit 3)."),
    ] = RegressionMode.HOLD,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object per change.")] = False,
    duration: Annotated[float | None, typer.Option("--duration", help="Exit after this many seconds.")] = None,
    observer: Annotated[
        str | None, typer.Option("--observer", help="Name in regression alerts (default host:pid).")
    ] = None,
    metrics_port: MetricsPortOption = None,
    metrics_host: MetricsHostOption = "127.0.0.1",
    nats: NatsOption = DEFAULT_NATS,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
    verbose: VerboseOption = 0,
) -> None:
    """Follow POLICY's weight version and print each change (the current one first).

    Exit codes: 0 done (--duration), 2 bad arguments, 3 a lower version in --regression raise mode,
    5 NATS unreachable, 77 permission denied, 130/143 interrupted.
    """
    setup_logging(verbose)

    async def _run() -> None:
        from weightbus.bus.nats import connect

        registry = CollectorRegistry()
        metrics = TrackerMetrics(registry)
        start_metrics(metrics_port, registry, metrics_host)
        bus = await connect(nats, name="weightbus-follow", metrics=BusMetrics(registry), options=connection)
        try:

            def _status(status: TrackerStatus) -> None:
                if status in (TrackerStatus.DEAF, TrackerStatus.NO_VALID_VERSION):
                    _emit(f"{policy}: tracker {status.value}, not ready ({tracker.deaf_reason or 'no valid event'})")
                elif status in (TrackerStatus.CURRENT, TrackerStatus.NEVER_PUBLISHED) and seen_unready:
                    _emit(f"{policy}: tracker ready again ({status.value})")
                if status not in (TrackerStatus.CURRENT, TrackerStatus.NEVER_PUBLISHED, TrackerStatus.STARTING):
                    seen_unready.append(status)

            seen_unready: list[TrackerStatus] = []
            tracker = VersionTracker(
                bus,
                policy,
                regression=regression,
                metrics=metrics,
                observer=observer,
                on_status=_status,
                freeze_heap=True,  # a long-running process: its full collections must not stall delivery
            )
            async with tracker:
                try:
                    async with asyncio.timeout(duration):
                        if await tracker.wait_ready() is None and not json_out:
                            _emit(f"{policy}: no version published yet (staleness unknown)")
                        async for change in tracker.changes(include_regressions=True):
                            _emit(format_change(change, json_out=json_out))
                except TimeoutError:
                    return
        finally:
            await bus.aclose()

    try:
        run_async(_run())
    except InvalidPolicyError as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    except VersionRegressionError as exc:
        raise fail(str(exc), code=EXIT_REGRESSION) from None
    except PermissionDeniedError as exc:
        raise fail(str(exc), EXIT_DENIED) from None
    except BusError as exc:
        raise fail(str(exc), EXIT_NATS) from None


def register(app: typer.Typer) -> None:
    """Add ``follow`` to ``app``."""
    app.command("follow")(with_connection(follow_command))
