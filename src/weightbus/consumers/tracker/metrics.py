"""Prometheus metrics of the version follower, on an injected ``CollectorRegistry`` (never the global one).

Families ``weightbus_*`` (docs/operations.md#metrics), label ``policy`` only; one ``TrackerMetrics`` per process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Protocol, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from weightbus.schemas.alerts import RejectReason

__all__ = ["LAG_BUCKETS", "PolicyTrackerMetrics", "TrackerMetrics"]


class _State(Protocol):
    @property
    def version(self) -> int | None: ...
    @property
    def epoch(self) -> int | None: ...
    @property
    def updated_at(self) -> float | None: ...


#: Upper bounds of the propagation-lag histogram, in seconds: loopback delivery is ~0.1 ms, a
#: reconnect costs seconds, and anything past a minute is an outage.
LAG_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class TrackerMetrics:
    """The tracker's metric families, registered once on ``registry``.

    Args:
        registry: where the families are registered; a private one when None (scripts only, tests
            and services should inject theirs).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.current_version = Gauge(
            "weightbus_current_version",
            "The weight version the tracker holds (unset until one is known).",
            ["policy"],
            registry=self.registry,
        )
        self.epoch = Gauge(
            "weightbus_epoch",
            "Publisher epoch of the held version, or of the latest takeover claim.",
            ["policy"],
            registry=self.registry,
        )
        self.last_update = Gauge(
            "weightbus_last_update_timestamp_seconds",
            "Unix time at which the last accepted weight update was published.",
            ["policy"],
            registry=self.registry,
        )
        self.lag = Histogram(
            "weightbus_propagation_lag_seconds",
            "Delay from a live weight update's publish to its receipt by the tracker "
            "(not the retained history read at start, not events republished by weightbus replay).",
            ["policy"],
            buckets=LAG_BUCKETS,
            registry=self.registry,
        )
        self.replayed = Counter(
            "weightbus_events_replayed",
            "Weights events republished from a trace (weightbus replay) that the tracker received live; "
            "their lag is not observed (their published_at is the recorded one).",
            ["policy"],
            registry=self.registry,
        )
        self.regressions = Counter(
            "weightbus_version_regressions",
            "Weight updates with a lower version than the one held, whatever the tracker did with them.",
            ["policy"],
            registry=self.registry,
        )
        self.resubscribes = Counter(
            "weightbus_tracker_resubscribes",
            "Subscriptions to the weights subject re-established after a failure.",
            ["policy"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "weightbus_events_rejected",
            "Weights events the tracker refused "
            "(not from the owner, stale claim, unexplained jump, claim, mark or base, counter reset).",
            ["policy", "reason"],
            registry=self.registry,
        )
        self.unverified_bases = Counter(
            "weightbus_unverified_bases",
            "Delta updates taken whose base the tracker could not vouch for (older than the history it saw, "
            "or after a gap in it): taken as current, their lineage unchecked.",
            ["policy"],
            registry=self.registry,
        )
        self.ready = Gauge(
            "weightbus_tracker_ready",
            "1 while the tracker knows the current state of the policy (replayed, subscribed); 0 otherwise.",
            ["policy"],
            registry=self.registry,
        )
        self.marks_unread = Gauge(
            "weightbus_tracker_marks_unread",
            "1 while the tracker follows without the counter's high-water marks (their read failed when it last "
            "subscribed): it cannot report a counter reset until it subscribes again; 0 otherwise.",
            ["policy"],
            registry=self.registry,
        )
        self._bound: dict[str, PolicyTrackerMetrics] = {}

    def for_policy(self, policy: str) -> PolicyTrackerMetrics:
        """The metrics of ``policy``, with its labelled children cached."""
        bound = self._bound.get(policy)
        if bound is None:
            bound = self._bound[policy] = PolicyTrackerMetrics(self, policy)
        return bound


class PolicyTrackerMetrics:
    """The tracker metrics of one policy (cached label children)."""

    def __init__(self, families: TrackerMetrics, policy: str) -> None:
        self.policy = policy
        self._current = families.current_version.labels(policy)
        self._epoch = families.epoch.labels(policy)
        self._last_update = families.last_update.labels(policy)
        self._lag = families.lag.labels(policy)
        self._replayed = families.replayed.labels(policy)
        self._regressions = families.regressions.labels(policy)
        self._resubscribes = families.resubscribes.labels(policy)
        self._unverified_bases = families.unverified_bases.labels(policy)
        # Every reason at 0 from the start: a counter born at 1 on its first event shows no increase(), so an
        # alert on it would miss the first rejected event of each reason.
        self._rejected = {reason: families.rejected.labels(policy, reason) for reason in get_args(RejectReason)}
        self._ready_family = families.ready
        self._ready_bound = False
        self._marks_unread = families.marks_unread.labels(policy)

    def set_marks_unread(self, unread: bool) -> None:
        """Whether the counter's marks could not be read at the last subscribe (``weightbus_tracker_marks_unread``)."""
        self._marks_unread.set(1 if unread else 0)

    def set_state(self, version: int | None, epoch: int | None, updated_at: float | None) -> None:
        """Set the version, epoch and last-update gauges now (``watch``); a None leaves its gauge as it was."""
        if version is not None:
            self._current.set(version)
        if epoch is not None:
            self._epoch.set(epoch)
        if updated_at is not None:
            self._last_update.set(updated_at)

    def track(self, read: Callable[[], _State]) -> None:
        """Read the version, epoch and last-update gauges from ``read()`` at scrape time (0 while unknown).

        The per-event path then pays nothing for them. Trackers of one policy in one process share
        these gauges; the one that bound last is shown.
        """
        # Readiness is exported by trackers only (``watch`` binds these metrics without one): 0 until ready.
        if not self._ready_bound:
            self.set_ready(False)
        self._current.set_function(lambda: read().version or 0)
        self._epoch.set_function(lambda: read().epoch or 0)
        self._last_update.set_function(lambda: read().updated_at or 0.0)

    def observe_lag(self, seconds: float) -> None:
        """Record one live update's publish-to-observe delay."""
        self._lag.observe(seconds)

    def count_replayed(self) -> None:
        """Count one live-received event republished from a trace (its lag is not observed)."""
        self._replayed.inc()

    def count_regression(self) -> None:
        """Count one lower version seen."""
        self._regressions.inc()

    def count_resubscribe(self) -> None:
        """Count one subscription re-established after a failure."""
        self._resubscribes.inc()

    def count_unverified_base(self) -> None:
        """Count one delta taken whose base the tracker could not check."""
        self._unverified_bases.inc()

    def count_rejected(self, reason: RejectReason) -> None:
        """Count one refused weights event by ``reason``."""
        self._rejected[reason].inc()

    def set_ready(self, ready: bool) -> None:
        """Mirror the tracker's readiness."""
        self._ready_bound = True
        self._ready_family.labels(self.policy).set(1 if ready else 0)
