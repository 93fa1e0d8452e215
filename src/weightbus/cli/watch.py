"""``weightbus watch``: a live view of every policy on a NATS (versions, lag, drains, alerts), or its events as JSON.

It feeds and draws the pure reducer ``consumers.monitor``: history first, then live events (lag for those only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable
from typing import Annotated, Final

import msgspec
import typer
from prometheus_client import CollectorRegistry
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from weightbus.bus import subjects
from weightbus.bus.metrics import BusMetrics
from weightbus.bus.options import ConnectOptions
from weightbus.bus.protocol import Bus, Deliver, Envelope
from weightbus.bus.trace import is_replayed
from weightbus.cli.connection import with_connection
from weightbus.cli.exits import EXIT_DENIED, EXIT_USAGE, fail, run_async
from weightbus.cli.metrics_server import start_metrics
from weightbus.cli.options import (
    DEFAULT_NATS,
    MetricsHostOption,
    MetricsPortOption,
    NatsOption,
    PolicyFilterOption,
    VerboseOption,
)
from weightbus.consumers.monitor import MonitorState, PolicyView, reduce, waste_summary
from weightbus.consumers.tracker.heap import freeze_startup_heap
from weightbus.consumers.tracker.metrics import TrackerMetrics
from weightbus.errors import BusError, InvalidPolicyError, PermissionDeniedError, SlowConsumerError
from weightbus.process.logs import route_logs, setup_logging
from weightbus.rules.chain import TrackerAction
from weightbus.schemas.weights import WeightUpdated

__all__ = ["register", "render", "watch", "watch_command"]

log = logging.getLogger("weightbus.consumers")

EXIT_NATS: Final = 5
_LIVE_UPDATES: Final = frozenset({TrackerAction.ADOPTED, TrackerAction.ADVANCED, TrackerAction.FOLLOWED})
_json_encoder = msgspec.json.Encoder()


def _ago(ts: float | None, now: float) -> str:
    if ts is None:
        return "—"
    secs = max(0.0, now - ts)
    if secs < 120:
        return f"{secs:.1f}s"
    if secs < 7200:
        return f"{secs / 60:.1f}m"
    return f"{secs / 3600:.1f}h"


def _num(value: float | int | None, fmt: str = "{}") -> str:
    return "—" if value is None else fmt.format(value)


def _policy_row(view: PolicyView, now: float) -> list[str]:
    w = view.weights
    version = _num(w.version)
    if view.rejected is not None:
        # What every tracker holds, and the lower version the rule rejected.
        version = f"{version} [bold red](rejected v{view.rejected.version} by {view.rejected.publisher})[/]"
    last = view.last_drain
    engines = "—"
    if view.applied_version is not None:
        engines = f"v{view.applied_version}: {view.applied_ok} ok"
        if view.applied_failed:
            engines += f", [red]{view.applied_failed} failed[/]"
    alerts = str(view.alert_count) if not view.alert_count else f"[bold red]{view.alert_count}[/]"
    return [
        view.policy,
        version,
        _num(w.epoch),
        w.publisher or "—",
        _num(view.lag, "{:.3f}s"),
        _ago(w.updated_at, now),
        engines,
        "—" if last is None else f"{last.kept}/{last.recycled}/{last.dropped}",
        f"{view.kept}/{view.recycled}/{view.dropped}",
        "—" if last is None else f"{_num(last.staleness_avg, '{:.2f}')} / {_num(last.staleness_max)}",
        alerts,
    ]


def render(state: MonitorState, now: float) -> Group:
    """Draw the view: a table of policies, then recent drains and alerts (newest last).

    Args:
        state: the monitor's view.
        now: the current Unix time (for "since update" and ages).
    """
    policies = Table(title=f"weightbus — {len(state.policies)} policies, {state.events} events", expand=False)
    for column in (
        "policy",
        "version",
        "epoch",
        "publisher",
        "lag",
        "since update",
        "engines",
        "last drain k/r/d",
        "total k/r/d",
        "staleness avg/max",
        "alerts",
    ):
        policies.add_column(column, no_wrap=True)
    for view in state.policies.values():
        policies.add_row(*_policy_row(view, now))
    drains = Table(title="recent drains", expand=False)
    for column in ("age", "policy", "consumer", "seq", "current", "kept", "recycled", "dropped", "avg", "max"):
        drains.add_column(column, no_wrap=True)
    drain_rows = sorted(
        ((d.published_at, view.policy, d) for view in state.policies.values() for d in view.drains),
        key=lambda item: item[0],
    )[-state.max_recent :]
    for at, policy, d in drain_rows:
        drains.add_row(
            _ago(at, now),
            policy,
            d.consumer,
            str(d.seq),
            _num(d.current),
            str(d.kept),
            str(d.recycled),
            str(d.dropped),
            _num(d.staleness_avg, "{:.2f}"),
            _num(d.staleness_max),
        )
    alerts = Table(title="recent alerts", expand=False)
    for column in ("age", "policy", "kind", "alert"):
        alerts.add_column(column)
    alert_rows = sorted(
        ((a.published_at, view.policy, a) for view in state.policies.values() for a in view.alerts),
        key=lambda item: item[0],
    )[-state.max_recent :]
    for at, policy, a in alert_rows:
        alerts.add_row(_ago(at, now), policy, f"[red]{a.kind}[/]", a.summary)
    waste = Table(title="waste and bias", expand=False)
    for column in ("policy", "waste and bias"):
        waste.add_column(column)
    for view in state.policies.values():
        for line in waste_summary(view):
            waste.add_row(view.policy, line)
    return Group(policies, drains, waste, alerts)


def _draw(view: Callable[[], Group], console: Console | None, refresh_per_second: float) -> contextlib.ExitStack:
    """Start drawing ``view`` live; closing the returned stack stops it and gives the logs back to stderr."""
    views = contextlib.ExitStack()
    live_view = Live(get_renderable=view, console=console, refresh_per_second=refresh_per_second)
    live_view.start()
    views.callback(live_view.stop)
    if live_view.console.is_terminal:
        # A line written to stderr behind the display's back shifts it down one row, and the next
        # redraw leaves the old header on screen: log lines go through the display's console instead.
        live_console = live_view.console
        views.enter_context(route_logs(lambda line: live_console.print(Text(line), soft_wrap=True)))
    return views


def _json_line(env: Envelope) -> str:
    wire = msgspec.json.decode(env.data)
    return _json_encoder.encode({"subject": env.subject, **wire}).decode()


async def watch(
    bus: Bus,
    pattern: str,
    *,
    json_out: bool = False,
    duration: float | None = None,
    count: int | None = None,
    metrics: TrackerMetrics | None = None,
    console: Console | None = None,
    refresh_per_second: float = 2.0,
) -> MonitorState:
    """Follow ``pattern`` and show it until ``duration`` seconds or ``count`` events have passed (else forever).

    Args:
        bus: the bus to watch.
        pattern: the subject pattern (``weightbus.>`` or ``weightbus.<policy>.>``).
        json_out: print each event as a JSON line instead of drawing the live view.
        duration: stop after this many seconds.
        count: stop after this many events.
        metrics: when given, the tracker-style gauges and histograms are kept up to date per policy.
        console: where the live view is drawn (stdout by default).
        refresh_per_second: redraws of the live view per second.

    Returns:
        The final view.
    """
    started = time.time()
    loop = asyncio.get_running_loop()
    deadline = None if duration is None else loop.time() + duration
    state = MonitorState()
    seen = 0
    views = (
        contextlib.ExitStack() if json_out else _draw(lambda: render(state, time.time()), console, refresh_per_second)
    )
    # The live view replays each subject's retained history, so versions are folded exactly as a
    # tracker that starts now folds them (a rogue lower version stored last is held, not shown).
    deliver = Deliver.LAST_PER_SUBJECT if json_out else Deliver.ALL
    try:
        while count is None or seen < count:
            try:
                async with bus.subscribe(pattern, deliver=deliver) as sub:
                    while count is None or seen < count:
                        timeout = None if deadline is None else deadline - loop.time()
                        if timeout is not None and timeout <= 0:
                            return state
                        try:
                            async with asyncio.timeout(timeout):
                                env = await anext(sub)
                        except TimeoutError:
                            return state
                        except StopAsyncIteration:
                            return state
                        seen += 1
                        published_at = getattr(env.event, "published_at", 0.0)
                        # A republished trace event (weightbus replay) carries its recorded time: not a live lag.
                        is_live = published_at >= started and not is_replayed(env.headers)
                        before = state.policies.get(subjects.policy_of(env.subject) or "")
                        state = reduce(state, env.subject, env.event, received_at=env.received_at, live=is_live)
                        if json_out:
                            sys.stdout.write(_json_line(env) + "\n")
                            sys.stdout.flush()
                        if metrics is not None:
                            _update_metrics(metrics, state, env, before, is_live)
            except SlowConsumerError as exc:
                log.warning("watch fell behind; resubscribing", extra={"pattern": pattern, "error": str(exc)})
                deliver = Deliver.LAST_PER_SUBJECT  # the history is folded already
        return state
    finally:
        views.close()


def _update_metrics(
    metrics: TrackerMetrics, state: MonitorState, env: Envelope, before: PolicyView | None, is_live: bool
) -> None:
    policy = subjects.policy_of(env.subject)
    if policy is None or not env.subject.endswith(".weights"):
        return
    view = state.policies[policy]
    m = metrics.for_policy(policy)
    m.set_state(view.weights.version, view.weights.epoch, view.weights.updated_at)
    if is_live and isinstance(env.event, WeightUpdated) and view.last_action in _LIVE_UPDATES and view.lag is not None:
        m.observe_lag(view.lag)
    if view.regressions > (before.regressions if before is not None else 0):
        m.count_regression()


def watch_command(
    policy: PolicyFilterOption = None,
    json_out: Annotated[
        bool, typer.Option("--json", help='Print each event as its wire JSON plus a "subject" key, one per line.')
    ] = False,
    duration: Annotated[float | None, typer.Option("--duration", help="Exit after this many seconds.")] = None,
    count: Annotated[int | None, typer.Option("--count", help="Exit after this many events.")] = None,
    metrics_port: MetricsPortOption = None,
    metrics_host: MetricsHostOption = "127.0.0.1",
    nats: NatsOption = DEFAULT_NATS,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
    verbose: VerboseOption = 0,
) -> None:
    """Watch versions, epochs, publishers, lag, drains and alerts of every policy (or one), live.

    Shows the current state at once (the stream's stored events), then follows live events.
    Versions go through the trackers' rule: a lower version is held and its event flagged as rejected.
    Works against `weightbus replay` of a recorded trace too.

    Exit codes: 0 done (--duration/--count), 2 bad arguments, 5 NATS unreachable, 77 permission denied,
    130/143 interrupted.
    """
    setup_logging(verbose)
    try:
        pattern = subjects.policy_pattern(policy)
    except InvalidPolicyError as exc:
        raise fail(str(exc), EXIT_USAGE) from None

    async def _run() -> None:
        from weightbus.bus.nats import connect

        registry = CollectorRegistry()
        metrics = TrackerMetrics(registry) if metrics_port is not None else None
        start_metrics(metrics_port, registry, metrics_host)
        bus = await connect(nats, name="weightbus-watch", metrics=BusMetrics(registry), options=connection)
        freeze_startup_heap()  # a long-running process: its full collections must not stall delivery
        try:
            await watch(bus, pattern, json_out=json_out, duration=duration, count=count, metrics=metrics)
        finally:
            await bus.aclose()

    try:
        run_async(_run())
    except PermissionDeniedError as exc:
        raise fail(str(exc), EXIT_DENIED) from None
    except BusError as exc:
        raise fail(str(exc), EXIT_NATS) from None


def register(app: typer.Typer) -> None:
    """Add ``watch`` to ``app``."""
    app.command("watch")(with_connection(watch_command))
