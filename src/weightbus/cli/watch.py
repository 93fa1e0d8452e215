"""``weightbus watch``: a live view of every policy on a NATS (versions, lag, drains, alerts), or its events as JSON.

It feeds and draws the pure reducer ``consumers.monitor``: history first, then live events (lag for those only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable, Collection, Iterator
from typing import Annotated, Final

import msgspec
import typer
from prometheus_client import CollectorRegistry
from rich import get_console
from rich.console import Console, ConsoleOptions, ConsoleRenderable, RenderableType
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
from weightbus.consumers.monitor import (
    LinkView,
    MonitorState,
    PolicyView,
    latest_alert,
    link_seen,
    reduce,
    waste_summary,
)
from weightbus.consumers.replicas import ConvergenceMetrics
from weightbus.consumers.tracker.heap import freeze_startup_heap
from weightbus.consumers.tracker.metrics import TrackerMetrics
from weightbus.errors import BusError, InvalidPolicyError, PermissionDeniedError, SlowConsumerError
from weightbus.process.logs import route_logs, setup_logging
from weightbus.rules.chain import TrackerAction
from weightbus.rules.replicas import DEFAULT_SHARES, ReplicaView
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


def _span(secs: float) -> str:
    """A duration as ``42s``, ``2m30s`` or ``1h05m``."""
    whole = int(secs)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def _version(view: PolicyView, detail: bool) -> str:
    version = _num(view.weights.version)
    if detail and view.rejected is not None:
        # What every tracker holds, and the lower version the rule rejected.
        version = f"{version} [bold red](rejected v{view.rejected.version} by {view.rejected.publisher})[/]"
    return version


def _status(view: PolicyView, stale: bool) -> str:
    if view.weights.version is None:
        status = "no version"
    elif view.rejected is not None:
        status = f"[bold red]rejected v{view.rejected.version}[/]"
    elif view.alert_count:
        status = f"[bold red]{view.alert_count} alert{'s' if view.alert_count > 1 else ''}[/]"
    else:
        status = "[green]ok[/]"
    return f"[dim]{status} (stale)[/]" if stale else status


def _engines(view: PolicyView) -> str:
    if view.applied_version is None:
        return "—"
    engines = f"v{view.applied_version}: {view.applied_ok} ok"
    if view.applied_failed:
        engines += f", [red]{view.applied_failed} failed[/]"
    return engines


def _replicas(view: PolicyView) -> str:
    """How many engines of the newest version's fleet serve it now (``rules.replicas``)."""
    conv = view.replicas.convergence()
    if conv is None:
        return "—"
    shown = f"{conv.serving}/{conv.fleet} on v{conv.version}"
    return shown if conv.converged else f"[yellow]{shown}[/]"


def _converged_in(view: PolicyView) -> str:
    """The newest fully converged version and its time from announcement to the last acknowledgement."""
    last = view.replicas.last_converged()
    seconds = None if last is None else last.time_to_converge(1.0)
    return "—" if last is None or seconds is None else f"v{last.version} in {seconds:.2f}s"


def _last_drain(view: PolicyView) -> str:
    last = view.last_drain
    return "—" if last is None else f"{last.kept}/{last.recycled}/{last.dropped}"


def _staleness(view: PolicyView) -> str:
    last = view.last_drain
    return "—" if last is None else f"{_num(last.staleness_avg, '{:.2f}')} / {_num(last.staleness_max)}"


_Cell = Callable[[PolicyView, float, bool], str]

# The policies table's columns in the order shown; _KEEP says which go last when the width is short.
_COLUMNS: Final[dict[str, _Cell]] = {
    "policy": lambda v, now, stale: v.policy,
    "version": lambda v, now, stale: _version(v, detail=False),
    "status": lambda v, now, stale: _status(v, stale),
    "epoch": lambda v, now, stale: _num(v.weights.epoch),
    "publisher": lambda v, now, stale: v.weights.publisher or "—",
    "lag": lambda v, now, stale: _num(v.lag, "{:.3f}s"),
    "since update": lambda v, now, stale: _ago(v.weights.updated_at, now),
    "engines": lambda v, now, stale: _engines(v),
    "replicas": lambda v, now, stale: _replicas(v),
    "converged": lambda v, now, stale: _converged_in(v),
    "last drain k/r/d": lambda v, now, stale: _last_drain(v),
    "total k/r/d": lambda v, now, stale: f"{v.kept}/{v.recycled}/{v.dropped}",
    "staleness avg/max": lambda v, now, stale: _staleness(v),
    "alerts": lambda v, now, stale: str(v.alert_count) if not v.alert_count else f"[bold red]{v.alert_count}[/]",
}
_DETAIL: Final = "version detail"
"""Not a column: the rejected version and its publisher next to the version held."""
_KEEP: Final = (
    "policy",
    "version",
    "status",
    "since update",
    "replicas",
    "epoch",
    "publisher",
    "alerts",
    _DETAIL,
    "lag",
    "converged",
    "engines",
    "last drain k/r/d",
    "staleness avg/max",
    "total k/r/d",
)
_ALWAYS: Final = 3
_UNBOUNDED: Final = 100_000
_LATEST_LINES: Final = 2
"""Lines the newest alert may take (enough for who sent a rogue version)."""
"""The policy, its version and its status are shown at any width."""


def _policies_table(state: MonitorState, now: float, shown: Collection[str], title: str, stale: bool) -> Table:
    table = Table(title=title, expand=False)
    for column in _COLUMNS:
        if column in shown:
            # A name shortened to a prefix could be another policy's: it folds onto more lines instead.
            table.add_column(column, no_wrap=column != "policy", overflow="fold" if column == "policy" else "ellipsis")
    for view in state.policies.values():
        cells = [_COLUMNS[c](view, now, stale) for c in _COLUMNS if c in shown]
        if _DETAIL in shown:
            cells[1] = _version(view, detail=True)
        table.add_row(*cells)
    return table


def _fitted_policies(
    state: MonitorState, now: float, title: str, stale: bool, console: Console, options: ConsoleOptions
) -> Table:
    """The policies table with as many columns as the width holds, dropping the last of ``_KEEP`` first."""
    unbounded = options.update_width(_UNBOUNDED)  # a measure is clamped to the width it is given
    for n in range(len(_KEEP), _ALWAYS, -1):
        table = _policies_table(state, now, frozenset(_KEEP[:n]), title, stale)
        if console.measure(table, options=unbounded).maximum <= options.max_width:
            return table
    return _policies_table(state, now, frozenset(_KEEP[:_ALWAYS]), title, stale)


def _alerts_table(state: MonitorState, now: float, rows: int | None) -> Table:
    alerts = Table(title="recent alerts", expand=False)
    for column in ("age", "policy", "kind"):
        alerts.add_column(column, no_wrap=True)
    # The only column that gives way to a narrow screen; fitted to the screen, each alert takes one line.
    alerts.add_column("alert")
    alert_rows = sorted(
        ((a.published_at, view.policy, a) for view in state.policies.values() for a in view.alerts),
        key=lambda item: item[0],
    )[-state.max_recent :]
    if rows is not None:
        alert_rows = alert_rows[-rows:] if rows > 0 else []
    for at, policy, a in alert_rows:
        summary = Text(a.summary, no_wrap=rows is not None, overflow="ellipsis")
        alerts.add_row(_ago(at, now), policy, Text(a.kind, style="red"), summary)
    return alerts


def _drains_table(state: MonitorState, now: float) -> Table:
    drains = Table(title="recent drains", expand=False)
    for column in ("age", "policy", "consumer", "seq", "current", "kept", "recycled", "dropped", "avg", "max"):
        drains.add_column(column, no_wrap=column != "policy", overflow="fold")
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
    return drains


def _waste_table(state: MonitorState) -> Table:
    waste = Table(title="waste and bias", expand=False)
    waste.add_column("policy", overflow="fold")
    waste.add_column("waste and bias")
    for view in state.policies.values():
        for line in waste_summary(view):
            waste.add_row(view.policy, line)
    return waste


def _one_line(text: Text, width: int) -> Text:
    text.no_wrap = True
    text.truncate(width, overflow="ellipsis")
    return text


def _at_most(text: Text, lines: int, console: Console, width: int) -> Text:
    """``text`` wrapped to ``width``, its first ``lines`` lines kept (the last ending in an ellipsis if cut)."""
    wrapped = text.wrap(console, width)
    if len(wrapped) <= lines:
        return text
    kept = list(wrapped)[:lines]
    kept[-1] = _one_line(Text.assemble(kept[-1], " ", wrapped[lines]), width)
    return Text("\n").join(kept)


class _Screen:
    """The whole view, laid out for the console's width (and, when ``fit_height``, its height)."""

    def __init__(self, state: MonitorState, now: float, link: LinkView | None, fit_height: bool) -> None:
        self.state, self.now, self.link, self.fit_height = state, now, link, fit_height

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[RenderableType]:
        state, now, width = self.state, self.now, options.max_width
        down = None if self.link is None else self.link.down_for(now)
        top: list[RenderableType] = []
        if self.link is not None and down is not None:
            banner = f" DISCONNECTED from {self.link.server} for {_span(down)}: the view below is stale "
            top.append(_one_line(Text(banner, style="bold white on red"), width))
        top.append(_at_most(self._latest(), _LATEST_LINES, console, width))
        title = f"weightbus — {len(state.policies)} policies, {state.events} events"
        if down is not None:
            title += f", as of {_span(down)} ago"
        top.append(_fitted_policies(state, now, title, down is not None, console, options))
        if not self.fit_height:
            yield from top
            yield from (_alerts_table(state, now, None), _drains_table(state, now), _waste_table(state))
            return
        # Live crops what is taller than the screen from the bottom: keep a line spare and show only what fits.
        left = (options.height or options.size.height) - 1
        for part in top:
            left -= len(console.render_lines(part, options, pad=False))
            yield part
        overhead = len(console.render_lines(_alerts_table(MonitorState(), now, 0), options, pad=False))
        alerts = _alerts_table(state, now, max(0, left - overhead))
        left -= len(console.render_lines(alerts, options, pad=False))
        yield alerts
        for part in (_drains_table(state, now), _waste_table(state)):
            if not part.row_count:
                continue
            lines = len(console.render_lines(part, options, pad=False))
            if lines > left:
                return
            left -= lines
            yield part

    def _latest(self) -> Text:
        newest = latest_alert(self.state)
        if newest is None:
            return Text("latest alert: none", style="dim")
        policy, alert = newest
        line = Text("latest alert: ", style="bold red")
        line.append(f"{_ago(alert.published_at, self.now)} ago  {policy}  ")
        line.append(alert.kind, style="red")
        line.append(f"  {alert.summary}")
        return line


def render(
    state: MonitorState, now: float, *, link: LinkView | None = None, fit_height: bool = False
) -> ConsoleRenderable:
    """Draw the view: a disconnected banner, the newest alert, the policies, then recent alerts, drains, waste.

    The policies table keeps the policy, its version and its status at any width and drops its other columns,
    least telling first, when the console is narrower than the whole table.

    Args:
        state: the monitor's view.
        now: the current Unix time (for "since update" and ages).
        link: the connection to the bus; while it is down a banner says since when, and the view is marked stale.
        fit_height: show only what the console's height holds (the newest alert stays on screen).
    """
    return _Screen(state, now, link, fit_height)


def _draw(
    view: Callable[[bool], ConsoleRenderable], console: Console | None, refresh_per_second: float
) -> contextlib.ExitStack:
    """Start drawing ``view`` live; closing the returned stack stops it and gives the logs back to stderr.

    ``view`` is told whether the console is a terminal (whose height the drawing must fit).
    """
    views = contextlib.ExitStack()
    shown_on = console if console is not None else get_console()
    terminal = shown_on.is_terminal
    live_view = Live(get_renderable=lambda: view(terminal), console=shown_on, refresh_per_second=refresh_per_second)
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
    convergence: ConvergenceMetrics | None = None,
    console: Console | None = None,
    refresh_per_second: float = 2.0,
    connected: Callable[[], bool] | None = None,
    server: str = "the bus",
) -> MonitorState:
    """Follow ``pattern`` and show it until ``duration`` seconds or ``count`` events have passed (else forever).

    Args:
        bus: the bus to watch.
        pattern: the subject pattern (``weightbus.>`` or ``weightbus.<policy>.>``).
        json_out: print each event as a JSON line instead of drawing the live view.
        duration: stop after this many seconds.
        count: stop after this many events.
        metrics: when given, the tracker-style gauges and histograms are kept up to date per policy.
        convergence: when given, the convergence gauges follow each policy's replica view and its histograms
            observe the activations and convergences that live events complete.
        console: where the live view is drawn (stdout by default).
        refresh_per_second: redraws of the live view per second.
        connected: whether the bus is connected now, asked at each redraw; while it is not, the view shows
            a DISCONNECTED banner with the outage's age and marks itself stale.
        server: the bus's address as the banner shows it (secrets redacted).

    Returns:
        The final view.
    """
    started = time.time()
    loop = asyncio.get_running_loop()
    deadline = None if duration is None else loop.time() + duration
    state = MonitorState()
    seen = 0
    link = LinkView(server) if connected is not None else None

    def frame(terminal: bool) -> ConsoleRenderable:
        nonlocal link
        now = time.time()
        if link is not None and connected is not None:
            link = link_seen(link, connected(), now)
        return render(state, now, link=link, fit_height=terminal)

    views = contextlib.ExitStack() if json_out else _draw(frame, console, refresh_per_second)
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
                        if convergence is not None:
                            _update_convergence(convergence, state, env, before, is_live)
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


def _update_convergence(
    metrics: ConvergenceMetrics, state: MonitorState, env: Envelope, before: PolicyView | None, is_live: bool
) -> None:
    policy = subjects.policy_of(env.subject)
    view = None if policy is None else state.policies.get(policy)
    if policy is None or view is None:
        return
    previous = before.replicas if before is not None else ReplicaView(max_versions=view.replicas.max_versions)
    metrics.for_policy(policy).update(previous, view.replicas, live=is_live)


def watch_command(
    policy: PolicyFilterOption = None,
    json_out: Annotated[
        bool, typer.Option("--json", help='Print each event as its wire JSON plus a "subject" key, one per line.')
    ] = False,
    duration: Annotated[float | None, typer.Option("--duration", help="Exit after this many seconds.")] = None,
    count: Annotated[int | None, typer.Option("--count", help="Exit after this many events.")] = None,
    metrics_port: MetricsPortOption = None,
    metrics_host: MetricsHostOption = "127.0.0.1",
    converge_share: Annotated[
        list[float] | None,
        typer.Option(
            "--converge-share",
            help="A share of a version's fleet (0 < share <= 1) whose time to acknowledge it is measured in "
            "weightbus_version_convergence_seconds{share} (repeatable; default 1 and 0.9; 1 is always measured).",
        ),
    ] = None,
    nats: NatsOption = DEFAULT_NATS,
    connection: ConnectOptions = ConnectOptions(),  # noqa: B008 (replaced by the NATS flags)
    verbose: VerboseOption = 0,
) -> None:
    """Watch versions, epochs, publishers, lag, replicas, drains and alerts of every policy (or one), live.

    Shows the current state at once (the stream's stored events), then follows live events.
    Versions go through the trackers' rule: a lower version is held and its event flagged as rejected.
    The replicas column counts the engines that acknowledged serving the newest version (an ok read-back, no
    alert since); converged is the newest version the whole fleet acknowledged, and how long that took.
    Works against `weightbus replay` of a recorded trace too.

    Exit codes: 0 done (--duration/--count), 2 bad arguments, 5 NATS unreachable, 77 permission denied,
    130/143 interrupted.
    """
    setup_logging(verbose)
    try:
        pattern = subjects.policy_pattern(policy)
    except InvalidPolicyError as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    shares = (1.0, *converge_share) if converge_share else DEFAULT_SHARES
    if any(not 0.0 < share <= 1.0 for share in shares):
        raise fail(f"--converge-share is a share of the fleet in (0, 1], not {converge_share}", EXIT_USAGE)

    async def _run() -> None:
        from weightbus.bus.nats import connect

        registry = CollectorRegistry()
        metrics = TrackerMetrics(registry) if metrics_port is not None else None
        convergence = ConvergenceMetrics(registry, shares) if metrics_port is not None else None
        start_metrics(metrics_port, registry, metrics_host)
        bus = await connect(nats, name="weightbus-watch", metrics=BusMetrics(registry), options=connection)
        freeze_startup_heap()  # a long-running process: its full collections must not stall delivery
        try:
            await watch(
                bus,
                pattern,
                json_out=json_out,
                duration=duration,
                count=count,
                metrics=metrics,
                convergence=convergence,
                connected=lambda: bus.client.is_connected,
                server=connection.redact(nats, nats),
            )
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
