"""Prometheus metrics of the staleness stage, on an injected ``CollectorRegistry`` (never the global one).

Families ``weightbus_*`` (docs/operations.md#metrics), updated once per drain: one ``Histogram.observe`` costs about
2 µs, so the staleness histogram is a custom collector. Never a version or a group id as a label.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from threading import Lock
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from weightbus.consumers.drain.accounts import TokenAccounts

__all__ = ["STALENESS_BUCKETS", "WAIT_SECONDS_BUCKETS", "DrainMetrics", "StalenessMetrics"]

#: Upper bounds of the staleness histogram, in versions (+Inf is implied).
STALENESS_BUCKETS: Final = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
#: Upper bounds of the wait histogram in seconds (+Inf is implied).
WAIT_SECONDS_BUCKETS: Final = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_PHASES: Final = ("in_flight", "in_queue")


class _BatchHistogram(Collector):
    """A histogram fed with whole drains of observations at once, one series per label values.

    prometheus-client's ``Histogram`` takes one observation per call under a lock; a drain observes
    hundreds, so the counts are added in one pass and exported at scrape time.
    """

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], labels: tuple[str, ...]) -> None:
        self._name = name
        self._doc = documentation
        self._buckets = buckets
        self._labels = list(labels)
        self._bounds = (*map(str, map(float, buckets)), "+Inf")
        self._lock = Lock()
        # label values -> (bucket counts, non-cumulative, last = +Inf; [sum, count])
        self._series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def add(self, *values: str) -> None:
        """Export the series of ``values`` from 0, before its first observation."""
        with self._lock:
            self._series.setdefault(values, ([0] * (len(self._buckets) + 1), [0.0, 0]))

    def observe_many(self, values: tuple[str, ...], observations: Iterable[float]) -> None:
        buckets, totals = self._series[values]
        added = [0] * len(buckets)
        s = 0.0
        n = 0
        for v in observations:
            added[bisect_left(self._buckets, v)] += 1
            s += v
            n += 1
        if not n:
            return
        with self._lock:
            for i, c in enumerate(added):
                buckets[i] += c
            totals[0] += s
            totals[1] += n

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labels)
        with self._lock:
            snapshot = [(k, list(b), list(t)) for k, (b, t) in self._series.items()]
        for key, buckets, (total, _count) in snapshot:
            cumulative = 0
            rows = []
            for bound, c in zip(self._bounds, buckets, strict=True):
                cumulative += c
                rows.append((bound, cumulative))
            family.add_metric(list(key), rows, total)
        yield family

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self._name, self._doc, labels=self._labels)


class StalenessMetrics:
    """The metric families of the staleness stage, registered once on ``registry``.

    Bind them to a policy with ``for_policy``; one ``StalenessMetrics`` serves every policy of a
    process (registering the families twice on one registry would raise).
    """

    def __init__(self, registry: CollectorRegistry, *, prefix: str = "weightbus") -> None:
        self.registry = registry
        self.staleness = _BatchHistogram(
            f"{prefix}_group_staleness",
            "Staleness of groups judged at drain time, in versions.",
            STALENESS_BUCKETS,
            ("policy",),
        )
        registry.register(self.staleness)
        self.groups = Counter(
            f"{prefix}_groups",
            "Groups by the action taken (kept, recycled, dropped) and its reason.",
            ["policy", "action", "reason"],
            registry=registry,
        )
        self.buffer_groups = Gauge(
            f"{prefix}_buffer_groups", "Groups waiting in the buffer.", ["policy"], registry=registry
        )
        self.buffer_avg_staleness = Gauge(
            f"{prefix}_buffer_avg_staleness",
            "Average staleness of buffered groups against the last known version, after a drain.",
            ["policy"],
            registry=registry,
        )
        self.buffer_max_staleness = Gauge(
            f"{prefix}_buffer_max_staleness",
            "Maximum staleness of buffered groups against the last known version, after a drain.",
            ["policy"],
            registry=registry,
        )
        self.tracker_behind = Counter(
            f"{prefix}_tracker_behind",
            "Groups holding a version newer than the tracker's current one (the drain used the newest).",
            ["policy"],
            registry=registry,
        )
        self.version_regressions = Counter(
            f"{prefix}_host_version_regressions",
            "Times the host's own version went backwards with no version on the bus (drains judged 'regressed').",
            ["policy"],
            registry=registry,
        )
        self.version_mismatches = Counter(
            f"{prefix}_host_version_mismatches",
            "Updates after which the host's own version count was not the bus's announced version (the bus's won).",
            ["policy"],
            registry=registry,
        )
        self.drain_current_version = Gauge(
            f"{prefix}_drain_current_version",
            "The version the last drain judged against (unset until one is known).",
            ["policy"],
            registry=registry,
        )
        self.report_failures = Counter(
            f"{prefix}_drain_report_failures",
            "Drain reports that could not be published.",
            ["policy"],
            registry=registry,
        )
        self.reports_dropped = Counter(
            f"{prefix}_drain_reports_dropped",
            "Drain reports dropped because the reporter's bounded queue was full.",
            ["policy"],
            registry=registry,
        )
        self.tokens_generated = Counter(
            f"{prefix}_tokens_generated",
            "Response tokens of the groups admitted to the drain.",
            ["policy"],
            registry=registry,
        )
        self.tokens_trained = Counter(
            f"{prefix}_tokens_trained",
            "Response tokens of the groups kept (handed to the trainer).",
            ["policy"],
            registry=registry,
        )
        self.tokens_not_trained = Counter(
            f"{prefix}_tokens_not_trained",
            "Response tokens of the groups not kept, by action (recycled, dropped) and reason.",
            ["policy", "action", "reason"],
            registry=registry,
        )
        self.early_aborts = Counter(
            f"{prefix}_early_aborts",
            "Groups aborted at the engine while generating because they had to be stale.",
            ["policy"],
            registry=registry,
        )
        self.tokens_saved = Counter(
            f"{prefix}_tokens_saved",
            "At most how many tokens early aborts saved (what the aborted requests could still have generated).",
            ["policy"],
            registry=registry,
        )
        self.wait_versions = _BatchHistogram(
            f"{prefix}_group_wait_versions",
            "Judged groups' staleness split into versions in flight (generating) and in queue (buffered).",
            tuple(float(b) for b in STALENESS_BUCKETS),
            ("policy", "phase"),
        )
        registry.register(self.wait_versions)
        self.wait_seconds = _BatchHistogram(
            f"{prefix}_group_wait_seconds",
            "Judged groups' seconds in flight (generating) and in queue (buffered).",
            WAIT_SECONDS_BUCKETS,
            ("policy", "phase"),
        )
        registry.register(self.wait_seconds)
        self.by_length = Counter(
            f"{prefix}_groups_by_length",
            "Groups by outcome (kept, recycled, dropped, aborted) and mean response-length bucket.",
            ["policy", "outcome", "length"],
            registry=registry,
        )
        self.by_reward = Counter(
            f"{prefix}_groups_by_reward",
            "Groups by outcome (kept, recycled, dropped, aborted) and mean reward bucket.",
            ["policy", "outcome", "reward"],
            registry=registry,
        )
        self._bound: dict[str, DrainMetrics] = {}

    def for_policy(self, policy: str) -> DrainMetrics:
        """The metrics of ``policy``, with its labelled children cached."""
        bound = self._bound.get(policy)
        if bound is None:
            bound = self._bound[policy] = DrainMetrics(self, policy)
        return bound


class DrainMetrics:
    """The staleness metrics of one policy; every update is per drain, with cached label children."""

    def __init__(self, families: StalenessMetrics, policy: str) -> None:
        self.policy = policy
        self._families = families
        families.staleness.add(policy)
        for phase in _PHASES:
            families.wait_versions.add(policy, phase)
            families.wait_seconds.add(policy, phase)
        self._tokens_generated = families.tokens_generated.labels(policy)
        self._tokens_trained = families.tokens_trained.labels(policy)
        self._early_aborts = families.early_aborts.labels(policy)
        self._tokens_saved = families.tokens_saved.labels(policy)
        self._groups: dict[tuple[str, str], Counter] = {}
        self._buffer_groups = families.buffer_groups.labels(policy)
        self._buffer_avg = families.buffer_avg_staleness.labels(policy)
        self._buffer_max = families.buffer_max_staleness.labels(policy)
        self._behind = families.tracker_behind.labels(policy)
        self._current = families.drain_current_version.labels(policy)
        self._regressions = families.version_regressions.labels(policy)
        self._mismatches = families.version_mismatches.labels(policy)
        self._report_failures = families.report_failures.labels(policy)
        self._reports_dropped = families.reports_dropped.labels(policy)

    def count_groups(self, action: str, reason: str, n: int = 1) -> None:
        """Add ``n`` groups to ``weightbus_groups_total{action, reason}``."""
        if n <= 0:
            return
        child = self._groups.get((action, reason))
        if child is None:
            child = self._groups[(action, reason)] = self._families.groups.labels(self.policy, action, reason)
        child.inc(n)

    def observe_staleness(self, values: Iterable[int]) -> None:
        """Add a drain's staleness values to the histogram."""
        self._families.staleness.observe_many((self.policy,), values)

    def tracker_behind(self, n: int) -> None:
        """Count ``n`` groups that were newer than the tracker."""
        if n > 0:
            self._behind.inc(n)

    def version_regressed(self) -> None:
        """Count one regression of the host's own version (``weightbus_host_version_regressions_total``)."""
        self._regressions.inc()

    def version_mismatched(self) -> None:
        """Count one update after which the host's count was not the bus's (``*_host_version_mismatches_total``)."""
        self._mismatches.inc()

    def set_current(self, current: int | None) -> None:
        """Record the version a drain judged against (left unchanged when None)."""
        if current is not None:
            self._current.set(current)

    def track_buffer(self, size: Callable[[], int]) -> None:
        """Read ``weightbus_buffer_groups`` from ``size`` at every scrape (``set_buffer`` sizes are then ignored)."""
        self._buffer_groups.set_function(size)

    def set_buffer(self, size: int, avg: float | None = None, maximum: int | None = None) -> None:
        """Record the buffer's size and, when known, its staleness against the last known version."""
        self._buffer_groups.set(size)
        if avg is not None:
            self._buffer_avg.set(avg)
        if maximum is not None:
            self._buffer_max.set(maximum)

    def report_failed(self) -> None:
        """Count one drain report that could not be published."""
        self._report_failures.inc()

    def report_dropped(self) -> None:
        """Count one drain report dropped at a full reporter queue."""
        self._reports_dropped.inc()

    def record_accounts(self, accounts: TokenAccounts) -> None:
        """Add one window's token, wait and bias accounts (``DrainWindow.finish``)."""
        f = self._families
        p = self.policy
        if accounts.generated:
            self._tokens_generated.inc(accounts.generated)
        if accounts.trained:
            self._tokens_trained.inc(accounts.trained)
        for (action, reason), n in accounts.not_trained.items():
            if n:
                f.tokens_not_trained.labels(p, action, reason).inc(n)
        if accounts.early_aborts:
            self._early_aborts.inc(accounts.early_aborts)
        if accounts.saved:
            self._tokens_saved.inc(accounts.saved)
        f.wait_versions.observe_many((p, "in_flight"), accounts.flight_versions)
        f.wait_versions.observe_many((p, "in_queue"), accounts.queue_versions)
        f.wait_seconds.observe_many((p, "in_flight"), accounts.flight_seconds)
        f.wait_seconds.observe_many((p, "in_queue"), accounts.queue_seconds)
        for (outcome, bucket), n in accounts.by_length.items():
            f.by_length.labels(p, outcome, bucket).inc(n)
        for (outcome, bucket), n in accounts.by_reward.items():
            f.by_reward.labels(p, outcome, bucket).inc(n)
