"""The live monitor's view model: a pure reducer from received events to a per-policy view state.

``reduce(state, subject, event, received_at=..., live=...)`` returns a new ``MonitorState`` and never
mutates its input; it does no I/O and reads no clock (times come in as arguments), so the view can
be tested and replayed from a trace. ``weightbus watch`` renders it.

Invariants:

* Versions go through the same rule as ``VersionTracker`` (``rules.chain.decide``, ``hold`` mode):
  the monitor shows what every tracker holds, never a version the rule rejected. The newest event
  the rule did not take (a lower version, or one that is not from the owner or that nothing
  explains, such as a claim far above the chain) is kept in ``rejected`` and recorded as a
  ``regression_seen`` or ``rejected_seen`` alert, next to the alerts trackers published.
* Lag is measured only for events the caller marks ``live``; the stored events a subscription
  replays at start are ages, not lags.
* Recent drains and alerts are bounded (``max_recent`` per policy); totals are kept separately.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TypeVar

from weightbus.bus.subjects import policy_of
from weightbus.rules.chain import RegressionMode, TrackerAction, TrackerState, decide
from weightbus.schemas.alerts import EngineOutOfSync, FleetQuarantined, VersionRegressed, VersionRejected
from weightbus.schemas.codec import Event
from weightbus.schemas.drains import DrainReport
from weightbus.schemas.weights import PublisherClaimed, VersionReserved, WeightApplied, WeightUpdated

__all__ = ["AlertView", "DrainView", "MonitorState", "PolicyView", "RejectedView", "reduce"]

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
        applied_version, applied_ok, applied_failed: engine read-backs of the newest stamped version.
        drains: the most recent drain reports, newest last.
        kept, recycled, dropped: totals over every drain report seen.
        alerts: the most recent alerts, newest last; ``alert_count`` counts all of them.
        regressions: lower versions seen on the weights subject.
        rejected: the newest event the rule rejected (its version and publisher), or None.
        events: events received for this policy.
    """

    policy: str
    weights: TrackerState = TrackerState()
    lag: float | None = None
    last_action: TrackerAction | None = None
    applied_version: int | None = None
    applied_ok: int = 0
    applied_failed: int = 0
    drains: tuple[DrainView, ...] = ()
    kept: int = 0
    recycled: int = 0
    dropped: int = 0
    alerts: tuple[AlertView, ...] = ()
    alert_count: int = 0
    regressions: int = 0
    rejected: RejectedView | None = None
    events: int = 0

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
    match event:
        case WeightUpdated() | PublisherClaimed() | VersionReserved():
            d = decide(view.weights, event, RegressionMode.HOLD)
            lag = view.lag
            if d.is_update and live:
                lag = max(0.0, received_at - event.published_at)
            out = replace(view, weights=d.state, lag=lag, last_action=d.action)
            if d.is_regression:
                summary = (
                    f"v{d.previous.version} → v{d.incoming} on the weights subject "
                    f"(epoch {event.epoch}, by {event.trainer_id}): rejected, v{d.previous.version} held"
                )
                alert = AlertView("regression_seen", summary, event.published_at)
                rejected = RejectedView(
                    d.incoming if d.incoming is not None else -1,
                    d.previous.version,
                    event.epoch,
                    event.trainer_id,
                    event.published_at,
                )
                out = replace(
                    out,
                    regressions=view.regressions + 1,
                    rejected=rejected,
                    alerts=_push(view.alerts, alert, limit),
                    alert_count=view.alert_count + 1,
                )
            elif d.reason is not None:
                summary = (
                    f"{type(event).__name__} v{d.incoming} (epoch {event.epoch}, by {event.trainer_id}) "
                    f"{'not accepted' if d.reason != 'counter_reset' else 'names a lower counter'}: {d.reason}"
                )
                out = _alert(out, AlertView("rejected_seen", summary, event.published_at), limit)
                if d.reason != "counter_reset":
                    rejected = RejectedView(
                        d.incoming if d.incoming is not None else -1,
                        d.previous.version,
                        event.epoch,
                        event.trainer_id,
                        event.published_at,
                    )
                    out = replace(out, rejected=rejected)
            return out
        case WeightApplied():
            if view.applied_version is None or event.version > view.applied_version:
                view = replace(view, applied_version=event.version, applied_ok=0, applied_failed=0)
            if event.version == view.applied_version:
                if event.ok:
                    return replace(view, applied_ok=view.applied_ok + 1)
                return replace(view, applied_failed=view.applied_failed + 1)
            return view
        case DrainReport():
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
            )
            return replace(
                view,
                drains=_push(view.drains, drain, limit),
                kept=view.kept + event.kept,
                recycled=view.recycled + event.recycled,
                dropped=view.dropped + event.dropped,
            )
        case VersionRegressed():
            summary = (
                f"v{event.current} → v{event.incoming} (epoch {event.incoming_epoch}, by {event.publisher}): "
                f"{event.action} at {event.observer}"
            )
            return _alert(view, AlertView("version_regressed", summary, event.published_at), limit)
        case VersionRejected():
            summary = (
                f"{event.event_type} v{event.incoming} (epoch {event.incoming_epoch}, by {event.publisher}) "
                f"not accepted at {event.observer}: {event.reason}"
            )
            return _alert(view, AlertView("version_rejected", summary, event.published_at), limit)
        case FleetQuarantined():
            summary = (
                f"engines relabelled {event.label} after v{event.version} failed ({event.reason}); "
                f"{len(event.engines)} relabelled, {len(event.failed)} failed, resumed={event.resumed}"
            )
            return _alert(view, AlertView("fleet_quarantined", summary, event.published_at), limit)
        case EngineOutOfSync():
            got = event.actual if event.actual is not None else "nothing"
            summary = f"engine {event.engine}: stamped {event.expected}, reports {got}"
            if event.error:
                summary += f" ({event.error})"
            return _alert(view, AlertView("engine_out_of_sync", summary, event.published_at), limit)
    return view


def _alert(view: PolicyView, alert: AlertView, limit: int) -> PolicyView:
    return replace(view, alerts=_push(view.alerts, alert, limit), alert_count=view.alert_count + 1)
