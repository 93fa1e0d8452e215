"""The live monitor's view model: a pure reducer from received events to a per-policy view state.

``reduce`` never mutates its input, does no I/O and reads no clock; versions go through the trackers' rule (``hold``);
lag is for ``live`` events only; recent items are bounded (``max_recent``). Which version each engine serves and how
each version converged is the one replica fold, ``rules.replicas``, fed every announcement, read-back and alert.
``link_seen`` folds the bus connection's state the same way (the caller passes the time). ``weightbus watch`` renders
both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TypeVar

from weightbus.bus.subjects import policy_of
from weightbus.rules.chain import RegressionMode, TrackerAction, TrackerState, WeightsEvent, decide
from weightbus.rules.replicas import ReplicaView, observe
from weightbus.schemas.alerts import EngineOutOfSync, FleetQuarantined, VersionRegressed, VersionRejected
from weightbus.schemas.codec import Event
from weightbus.schemas.drains import DrainReport
from weightbus.schemas.weights import PublisherClaimed, VersionReserved, WeightApplied, WeightUpdated

__all__ = [
    "AlertView",
    "DrainView",
    "LinkView",
    "MonitorState",
    "PolicyView",
    "RejectedView",
    "kept_share",
    "latest_alert",
    "link_seen",
    "reduce",
    "waste_summary",
]

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class DrainView:
    """One ``DrainReport``, as shown."""

    consumer: str
    seq: int
    current: int | None
    kept: int
    recycled: int
    dropped: int
    staleness_avg: float | None
    staleness_max: int | None
    published_at: float
    tokens_generated: int = 0
    tokens_not_trained: int = 0
    early_aborts: int = 0
    in_flight_versions_avg: float | None = None
    in_queue_versions_avg: float | None = None
    in_flight_s_avg: float | None = None
    in_queue_s_avg: float | None = None


@dataclass(frozen=True, slots=True)
class AlertView:
    """One alert, as shown.

    Attributes:
        kind: ``version_regressed`` (a tracker's alert), ``engine_out_of_sync``, or ``regression_seen``
            (the monitor itself saw a lower version on the weights subject).
        summary: one human line.
        published_at: the event's publish time.
    """

    kind: str
    summary: str
    published_at: float


@dataclass(frozen=True, slots=True)
class RejectedView:
    """An event the tracker rule rejected: its version, epoch and publisher, and the version held instead."""

    version: int
    held: int | None
    epoch: int
    publisher: str
    published_at: float


@dataclass(frozen=True, slots=True)
class PolicyView:
    """Everything the monitor knows about one policy.

    Attributes:
        weights: version, epoch, publisher and time of the last update (``TrackerState``).
        lag: publish-to-receive delay of the latest live weight update, in seconds.
        last_action: what the latest weights event did (``advanced``, ``claimed``, ``followed``...).
        applied_version: the newest version an engine read back.
        applied: each engine's latest read-back of ``applied_version`` (True: it matched); an engine
            reported twice (the trainer's read-back and a catch-up's, or a redelivery) counts once.
        applied_ok, applied_failed: how many engines of ``applied`` matched, and how many did not.
        replicas: the replica view (``rules.replicas``): what each engine acknowledged serving, and each
            version's announcement and acknowledgement times.
        drains: the most recent drain reports, newest last.
        kept, recycled, dropped: totals over every drain report seen.
        alerts: the most recent alerts, newest last; ``alert_count`` counts all of them.
        regressions: lower versions seen on the weights subject.
        rejected: the newest event the rule rejected (its version and publisher), or None.
        events: events received for this policy.
        tokens_generated, tokens_trained: response tokens over every drain report seen.
        tokens_not_trained: response tokens not trained on, by reason, over every report.
        early_aborts, tokens_saved: groups aborted while generating, and at most the tokens that saved.
        by_length, by_reward: groups by outcome and bucket, over every report.
    """

    policy: str
    weights: TrackerState = TrackerState()
    lag: float | None = None
    last_action: TrackerAction | None = None
    applied_version: int | None = None
    applied: Mapping[str, bool] = field(default_factory=lambda: MappingProxyType({}))
    replicas: ReplicaView = ReplicaView()
    drains: tuple[DrainView, ...] = ()
    kept: int = 0
    recycled: int = 0
    dropped: int = 0
    alerts: tuple[AlertView, ...] = ()
    alert_count: int = 0
    regressions: int = 0
    rejected: RejectedView | None = None
    events: int = 0
    tokens_generated: int = 0
    tokens_trained: int = 0
    tokens_not_trained: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    early_aborts: int = 0
    tokens_saved: int = 0
    by_length: Mapping[str, Mapping[str, int]] = field(default_factory=lambda: MappingProxyType({}))
    by_reward: Mapping[str, Mapping[str, int]] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def applied_ok(self) -> int:
        """Engines whose latest read-back of ``applied_version`` matched."""
        return sum(self.applied.values())

    @property
    def applied_failed(self) -> int:
        """Engines whose latest read-back of ``applied_version`` did not match."""
        return len(self.applied) - self.applied_ok

    @property
    def last_drain(self) -> DrainView | None:
        """The newest drain report, if any."""
        return self.drains[-1] if self.drains else None


@dataclass(frozen=True, slots=True)
class MonitorState:
    """The monitor's whole view: one ``PolicyView`` per policy seen, in order of appearance."""

    policies: Mapping[str, PolicyView] = field(default_factory=lambda: MappingProxyType({}))
    events: int = 0
    max_recent: int = 8


@dataclass(frozen=True, slots=True)
class LinkView:
    """The monitor's connection to the bus, as shown.

    Attributes:
        server: where it connects, as it may be shown (secrets redacted).
        down_since: when the connection was first seen down (Unix seconds); None while it is up.
    """

    server: str
    down_since: float | None = None

    def down_for(self, now: float) -> float | None:
        """Seconds the connection has been down at ``now``, or None while it is up."""
        return None if self.down_since is None else max(0.0, now - self.down_since)


def link_seen(link: LinkView, connected: bool, now: float) -> LinkView:
    """The link after seeing the connection ``connected`` (or not) at ``now``: an outage keeps its first time."""
    if connected:
        return link if link.down_since is None else replace(link, down_since=None)
    return link if link.down_since is not None else replace(link, down_since=now)


def latest_alert(state: MonitorState) -> tuple[str, AlertView] | None:
    """The newest alert of any policy and its policy, or None before any alert."""
    newest: tuple[str, AlertView] | None = None
    for view in state.policies.values():
        if view.alerts and (newest is None or view.alerts[-1].published_at >= newest[1].published_at):
            newest = (view.policy, view.alerts[-1])
    return newest


def reduce(state: MonitorState, subject: str, event: Event, *, received_at: float, live: bool = True) -> MonitorState:
    """Apply one received event to the view.

    Args:
        state: the view before the event.
        subject: the subject it arrived on (names the policy).
        event: the decoded event.
        received_at: local receive time (Unix seconds).
        live: whether the event was published while watching (only live updates measure lag).

    Returns:
        The new view; ``state`` is unchanged. Events on subjects outside the scheme only bump ``events``.
    """
    policy = policy_of(subject) or getattr(event, "policy", None)
    if policy is None:
        return replace(state, events=state.events + 1)
    view = state.policies.get(policy) or PolicyView(policy)
    view = _apply(view, event, received_at, live, state.max_recent)
    view = replace(view, events=view.events + 1)
    policies = dict(state.policies)
    policies[policy] = view
    return replace(state, policies=MappingProxyType(policies), events=state.events + 1)


def _push(items: tuple[_T, ...], item: _T, limit: int) -> tuple[_T, ...]:
    return (*items, item)[-limit:] if limit > 0 else ()


def _apply(view: PolicyView, event: Event, received_at: float, live: bool, limit: int) -> PolicyView:
    replicas = observe(view.replicas, event)
    if replicas is not view.replicas:
        view = replace(view, replicas=replicas)
    match event:
        case WeightUpdated() | PublisherClaimed() | VersionReserved():
            return _apply_weights(view, event, received_at, live, limit)
        case WeightApplied():
            if view.applied_version is None or event.version > view.applied_version:
                view = replace(view, applied_version=event.version, applied=MappingProxyType({}))
            if event.version == view.applied_version:
                return replace(view, applied=MappingProxyType({**view.applied, event.engine: event.ok}))
            return view
        case DrainReport():
            return _apply_drain(view, event, limit)
        case VersionRegressed() | VersionRejected() | FleetQuarantined() | EngineOutOfSync():
            return _alert(view, _alert_view(event), limit)
    return view


def _apply_weights(view: PolicyView, event: WeightsEvent, received_at: float, live: bool, limit: int) -> PolicyView:
    """The chain rule on one weights event; a regression or a rejection is kept and shown as an alert."""
    d = decide(view.weights, event, RegressionMode.HOLD)
    lag = view.lag
    if d.is_update and live:
        lag = max(0.0, received_at - event.published_at)
    out = replace(view, weights=d.state, lag=lag, last_action=d.action)
    rejected = RejectedView(
        d.incoming if d.incoming is not None else -1,
        d.previous.version,
        event.epoch,
        event.trainer_id,
        event.published_at,
    )
    if d.is_regression:
        summary = (
            f"v{d.previous.version} → v{d.incoming} on the weights subject "
            f"(epoch {event.epoch}, by {event.trainer_id}): rejected, v{d.previous.version} held"
        )
        alert = AlertView("regression_seen", summary, event.published_at)
        return replace(
            out,
            regressions=view.regressions + 1,
            rejected=rejected,
            alerts=_push(view.alerts, alert, limit),
            alert_count=view.alert_count + 1,
        )
    if d.reason is not None:
        summary = (
            f"{type(event).__name__} v{d.incoming} (epoch {event.epoch}, by {event.trainer_id}) "
            f"{'not accepted' if d.reason != 'counter_reset' else 'names a lower counter'}: {d.reason}"
        )
        out = _alert(out, AlertView("rejected_seen", summary, event.published_at), limit)
        if d.reason != "counter_reset":
            out = replace(out, rejected=rejected)
    return out


def _apply_drain(view: PolicyView, event: DrainReport, limit: int) -> PolicyView:
    """One drain report: the newest drains, and the totals of groups, tokens and the bias buckets."""
    drain = DrainView(
        consumer=event.consumer,
        seq=event.seq,
        current=event.current,
        kept=event.kept,
        recycled=event.recycled,
        dropped=event.dropped,
        staleness_avg=event.staleness_avg,
        staleness_max=event.staleness_max,
        published_at=event.published_at,
        tokens_generated=event.tokens_generated,
        tokens_not_trained=sum(event.tokens_not_trained.values()),
        early_aborts=event.early_aborts,
        in_flight_versions_avg=event.in_flight_versions_avg,
        in_queue_versions_avg=event.in_queue_versions_avg,
        in_flight_s_avg=event.in_flight_s_avg,
        in_queue_s_avg=event.in_queue_s_avg,
    )
    return replace(
        view,
        drains=_push(view.drains, drain, limit),
        kept=view.kept + event.kept,
        recycled=view.recycled + event.recycled,
        dropped=view.dropped + event.dropped,
        tokens_generated=view.tokens_generated + event.tokens_generated,
        tokens_trained=view.tokens_trained + event.tokens_trained,
        tokens_not_trained=_add(view.tokens_not_trained, event.tokens_not_trained),
        early_aborts=view.early_aborts + event.early_aborts,
        tokens_saved=view.tokens_saved + event.tokens_saved,
        by_length=_add_nested(view.by_length, event.by_length),
        by_reward=_add_nested(view.by_reward, event.by_reward),
    )


def _alert_view(event: VersionRegressed | VersionRejected | FleetQuarantined | EngineOutOfSync) -> AlertView:
    """An alert event as one line of the view."""
    match event:
        case VersionRegressed():
            summary = (
                f"v{event.current} → v{event.incoming} (epoch {event.incoming_epoch}, by {event.publisher}): "
                f"{event.action} at {event.observer}"
            )
            return AlertView("version_regressed", summary, event.published_at)
        case VersionRejected():
            summary = (
                f"{event.event_type} v{event.incoming} (epoch {event.incoming_epoch}, by {event.publisher}) "
                f"not accepted at {event.observer}: {event.reason}"
            )
            return AlertView("version_rejected", summary, event.published_at)
        case FleetQuarantined():
            summary = (
                f"engines relabelled {event.label} after v{event.version} failed ({event.reason}); "
                f"{len(event.engines)} relabelled, {len(event.failed)} failed, resumed={event.resumed}"
            )
            return AlertView("fleet_quarantined", summary, event.published_at)
    got = event.actual if event.actual is not None else "nothing"
    summary = f"engine {event.engine}: stamped {event.expected}, reports {got}"
    if event.error:
        summary += f" ({event.error})"
    return AlertView("engine_out_of_sync", summary, event.published_at)


def _alert(view: PolicyView, alert: AlertView, limit: int) -> PolicyView:
    return replace(view, alerts=_push(view.alerts, alert, limit), alert_count=view.alert_count + 1)


def _add(total: Mapping[str, int], more: Mapping[str, int]) -> Mapping[str, int]:
    if not more:
        return total
    out = dict(total)
    for key, n in more.items():
        out[key] = out.get(key, 0) + n
    return MappingProxyType(out)


def _add_nested(
    total: Mapping[str, Mapping[str, int]], more: Mapping[str, Mapping[str, int]]
) -> Mapping[str, Mapping[str, int]]:
    if not more:
        return total
    out = dict(total)
    for key, counts in more.items():
        out[key] = _add(out.get(key, MappingProxyType({})), counts)
    return MappingProxyType(out)


def kept_share(counts: Mapping[str, Mapping[str, int]]) -> dict[str, float]:
    """The share of groups kept in each bucket (``by_length`` or ``by_reward``: outcome → bucket → groups).

    A bucket whose share is far below the others' is one the filter starves.
    """
    totals: dict[str, int] = {}
    kept: dict[str, int] = {}
    for outcome, buckets in counts.items():
        for bucket, n in buckets.items():
            totals[bucket] = totals.get(bucket, 0) + n
            if outcome == "kept":
                kept[bucket] = kept.get(bucket, 0) + n
    return {bucket: kept.get(bucket, 0) / n for bucket, n in totals.items() if n}


def waste_summary(view: PolicyView) -> list[str]:
    """What ``watch`` shows of a policy's waste and bias, one line per topic (empty before any token)."""
    lines: list[str] = []
    generated = view.tokens_generated
    if generated:
        not_trained = sum(view.tokens_not_trained.values())
        reasons = ", ".join(
            f"{reason} {n / generated:.1%}" for reason, n in sorted(view.tokens_not_trained.items()) if n
        )
        line = f"tokens: {generated} generated, {not_trained / generated:.1%} not trained"
        lines.append(line + (f" ({reasons})" if reasons else ""))
    if view.early_aborts:
        lines.append(f"early aborts: {view.early_aborts} groups, at most {view.tokens_saved} tokens saved")
    last = view.last_drain
    if last is not None and last.in_flight_versions_avg is not None and last.in_queue_versions_avg is not None:
        flight, queue = last.in_flight_versions_avg, last.in_queue_versions_avg
        line = f"staleness: {flight:.2f} versions in flight, {queue:.2f} in queue"
        if last.in_flight_s_avg is not None and last.in_queue_s_avg is not None:
            line += f" ({last.in_flight_s_avg:.2f}s / {last.in_queue_s_avg:.2f}s)"
        lines.append(line)
    for name, counts in (("length", view.by_length), ("reward", view.by_reward)):
        share = kept_share(counts)
        if share:
            lines.append(f"kept by {name}: " + ", ".join(f"{bucket} {v:.0%}" for bucket, v in share.items()))
    return lines
