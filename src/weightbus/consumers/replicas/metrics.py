"""Prometheus metrics of version convergence and of version-constrained requests, on an injected ``CollectorRegistry``.

Families ``weightbus_*`` (docs/operations.md#metrics), labels ``policy`` and, on the convergence histogram, ``share``
(from the configured shares only: low cardinality). Histograms observe live events only (neither a history replayed at
start nor events republished by ``weightbus replay``); the gauges follow the view, history included.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from weightbus.rules.replicas import DEFAULT_SHARES, ReplicaView, newly_activated, newly_converged

__all__ = [
    "CONVERGENCE_BUCKETS",
    "VERSION_BUCKETS",
    "ConvergenceMetrics",
    "PolicyConvergenceMetrics",
    "PolicyRequestMetrics",
    "RequestMetrics",
    "share_label",
]

#: Upper bounds of the activation and convergence histograms, in seconds: a stamp read back beside its announcement
#: takes milliseconds, a replica that loads the weights itself takes seconds to minutes.
CONVERGENCE_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def share_label(share: float) -> str:
    """The ``share`` label of a share of the fleet: ``1``, ``0.9``."""
    return f"{share:g}"


class ConvergenceMetrics:
    """The convergence families, registered once on ``registry``.

    Args:
        registry: where the families are registered (inject the process's).
        shares: the shares of a version's fleet whose convergence time is observed, each in (0, 1].

    Raises:
        ValueError: a share outside (0, 1].
    """

    def __init__(self, registry: CollectorRegistry, shares: Iterable[float] = DEFAULT_SHARES) -> None:
        self.shares = tuple(sorted(set(shares), reverse=True))
        for share in self.shares:
            if not 0.0 < share <= 1.0:
                raise ValueError(f"a share of the fleet is in (0, 1], not {share}")
        self.registry = registry
        self.activation = Histogram(
            "weightbus_engine_activation_seconds",
            "From a version's announcement (WeightUpdated.published_at) to one engine's activation acknowledgement "
            "(its ok WeightApplied.published_at); live events only.",
            ["policy"],
            buckets=CONVERGENCE_BUCKETS,
            registry=registry,
        )
        self.convergence = Histogram(
            "weightbus_version_convergence_seconds",
            "From a version's announcement to the acknowledgement that brought `share` of its fleet to it; "
            "live events only.",
            ["policy", "share"],
            buckets=CONVERGENCE_BUCKETS,
            registry=registry,
        )
        self.serving_newest = Gauge(
            "weightbus_replicas_serving_newest",
            "Engines of the newest announced version's fleet that acknowledged serving it (or newer) and were not "
            "alerted since.",
            ["policy"],
            registry=registry,
        )
        self.fleet = Gauge(
            "weightbus_replicas_fleet",
            "Engines the newest announced version is meant to reach (announced, acknowledged, or alerted for it).",
            ["policy"],
            registry=registry,
        )
        self.unconverged_since = Gauge(
            "weightbus_unconverged_since_timestamp_seconds",
            "Announcement time of the oldest version announced after the newest one that reached its whole fleet "
            "(0: every version converged).",
            ["policy"],
            registry=registry,
        )
        self._bound: dict[str, PolicyConvergenceMetrics] = {}

    def for_policy(self, policy: str) -> PolicyConvergenceMetrics:
        """The metrics of ``policy``, with its labelled children cached (every series exported from the start)."""
        bound = self._bound.get(policy)
        if bound is None:
            bound = self._bound[policy] = PolicyConvergenceMetrics(self, policy)
        return bound


class PolicyConvergenceMetrics:
    """The convergence metrics of one policy."""

    def __init__(self, families: ConvergenceMetrics, policy: str) -> None:
        self.policy = policy
        self.shares = families.shares
        self._activation = families.activation.labels(policy)
        self._convergence = {share: families.convergence.labels(policy, share_label(share)) for share in self.shares}
        self._serving = families.serving_newest.labels(policy)
        self._fleet = families.fleet.labels(policy)
        self._since = families.unconverged_since.labels(policy)

    def update(self, before: ReplicaView, after: ReplicaView, *, live: bool) -> None:
        """Follow the view from ``before`` to ``after`` (one event); observe what became known if ``live``."""
        if after is before:
            return
        if live:
            for activation in newly_activated(before, after):
                self._activation.observe(activation.seconds)
            for converged in newly_converged(before, after, self.shares):
                assert converged.share is not None
                self._convergence[converged.share].observe(converged.seconds)
        conv = after.convergence()
        if conv is not None:
            self._serving.set(conv.serving)
            self._fleet.set(conv.fleet)
        since = after.unconverged_since()
        self._since.set(0.0 if since is None else since)


#: Upper bounds of the request version histograms, in versions.
VERSION_BUCKETS: Final = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0)


class RequestMetrics:
    """The families of version-constrained requests (``VersionRouter``), registered once on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.over_requested = Histogram(
            "weightbus_request_version_over_requested",
            "Versions the engine a constrained request was sent to served above the version it asked for "
            "(0: exactly the one asked for).",
            ["policy"],
            buckets=VERSION_BUCKETS,
            registry=registry,
        )
        self.behind_newest = Histogram(
            "weightbus_request_version_behind_newest",
            "Versions the engine a constrained request was sent to served below the newest announced version.",
            ["policy"],
            buckets=VERSION_BUCKETS,
            registry=registry,
        )
        self.unavailable = Counter(
            "weightbus_request_version_unavailable",
            "Constrained requests that found no engine serving an allowed version within their wait "
            "(VersionUnavailableError), by constraint (min or exact).",
            ["policy", "constraint"],
            registry=registry,
        )
        self._bound: dict[str, PolicyRequestMetrics] = {}

    def for_policy(self, policy: str) -> PolicyRequestMetrics:
        """The metrics of ``policy`` (every series exported from the start)."""
        bound = self._bound.get(policy)
        if bound is None:
            bound = self._bound[policy] = PolicyRequestMetrics(self, policy)
        return bound


class PolicyRequestMetrics:
    """The request metrics of one policy."""

    def __init__(self, families: RequestMetrics, policy: str) -> None:
        self._over = families.over_requested.labels(policy)
        self._behind = families.behind_newest.labels(policy)
        self._unavailable = {kind: families.unavailable.labels(policy, kind) for kind in ("min", "exact")}

    def picked(self, requested: int | None, served: int, newest: int | None) -> None:
        """One request sent to an engine serving ``served``, asked for ``requested``, ``newest`` announced."""
        if requested is not None:
            self._over.observe(max(0, served - requested))
        if newest is not None:
            self._behind.observe(max(0, newest - served))

    def unavailable(self, exact: bool) -> None:
        """One request that found no engine in time."""
        self._unavailable["exact" if exact else "min"].inc()
