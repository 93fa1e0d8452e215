"""Prometheus metrics of the trainer side, on an injected ``CollectorRegistry`` (never the global one).

``weightbus_update_phase_seconds{policy, phase, outcome}`` times each phase an update ran, observed once when the
update ends (announced or failed); the ``weightbus_publisher_*`` gauges are read from the counter's ``.state``
snapshot at scrape time, so they always equal it; ``weightbus_catchup_total{policy, outcome}`` and
``weightbus_catchup_failures_total{policy, reason}`` count catch-ups. Families: docs/operations.md#metrics. Never a
version as a label.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from threading import Lock
from typing import Final, Literal

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from weightbus.producers.counter import FencedCounter

__all__ = ["PHASE_SECONDS_BUCKETS", "PHASES", "CatchupMetrics", "Outcome", "PublisherMetrics"]

#: The phases of an update, in the order they run (``take`` and ``pause`` overlap; ``quarantine`` only on failure).
PHASES: Final = ("take", "pause", "relabel", "push", "stamp", "announce", "resume", "quarantine")
#: Upper bounds of the phase histogram in seconds (+Inf is implied): a relabel takes milliseconds, a push minutes.
PHASE_SECONDS_BUCKETS: Final = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

#: How an update ended: ``announced`` (its ``WeightUpdated`` was acknowledged) or ``failed``.
Outcome = Literal["announced", "failed"]


class _PublisherGauges(Collector):
    """The counters' state as gauges, one series per policy, read at scrape time (the last counter watched wins)."""

    def __init__(self) -> None:
        self._lock = Lock()
        self._counters: dict[str, weakref.ref[FencedCounter]] = {}

    def watch(self, counter: FencedCounter) -> None:
        # A weak reference: a publisher that is gone must not be kept alive (or exported) by the registry.
        with self._lock:
            self._counters[counter.state.policy] = weakref.ref(counter)

    def collect(self) -> Iterator[Metric]:
        version, next_version, issued, epoch, fenced = families = self._families()
        with self._lock:
            watched = list(self._counters.items())
        for policy, ref in watched:
            counter = ref()
            if counter is None:
                with self._lock:
                    if self._counters.get(policy) is ref:
                        del self._counters[policy]
                continue
            state = counter.state
            if state.version is not None:
                version.add_metric([policy], state.version)
            next_version.add_metric([policy], state.next_version)
            issued.add_metric([policy], state.issued)
            if state.epoch is not None:
                epoch.add_metric([policy], state.epoch)
            fenced.add_metric([policy], 0 if state.fenced is None else 1)
        yield from families

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, ...]:
        version = GaugeMetricFamily(
            "weightbus_publisher_version",
            "The version this publisher last announced (absent while none is known).",
            labels=["policy"],
        )
        next_version = GaugeMetricFamily(
            "weightbus_publisher_next_version", "The number this publisher's next update will carry.", labels=["policy"]
        )
        issued = GaugeMetricFamily(
            "weightbus_publisher_issued",
            "The highest number this counter ever issued (reserved or announced).",
            labels=["policy"],
        )
        epoch = GaugeMetricFamily(
            "weightbus_publisher_epoch", "The epoch this publisher claimed (absent before start()).", labels=["policy"]
        )
        fenced = GaugeMetricFamily(
            "weightbus_publisher_fenced",
            "1 once another publisher took the counter over (every later update of this one fails); 0 otherwise.",
            labels=["policy"],
        )
        return version, next_version, issued, epoch, fenced


class PublisherMetrics:
    """The trainer side's metric families, registered once on ``registry`` (one per registry, every policy).

    ``VersionPublisher(metrics=...)`` watches its counter and reports each update's phases here.

    Args:
        registry: where the families are registered; a private one when None (scripts only, tests
            and services should inject theirs).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.phase_seconds = Histogram(
            "weightbus_update_phase_seconds",
            "Seconds each phase of a weight update took, by phase and by how the update ended.",
            ["policy", "phase", "outcome"],
            buckets=PHASE_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self._gauges = _PublisherGauges()
        self.registry.register(self._gauges)

    def watch(self, counter: FencedCounter) -> None:
        """Export ``counter``'s state as the ``weightbus_publisher_*`` gauges of its policy (held weakly)."""
        self._gauges.watch(counter)

    def observe_update(self, policy: str, phases: Mapping[str, float], outcome: Outcome) -> None:
        """Record the phases one update ran (``VersionUpdate.phases``), once, when it ended."""
        for phase, seconds in phases.items():
            self.phase_seconds.labels(policy, phase, outcome).observe(seconds)


class CatchupMetrics:
    """The catch-up's metric families, registered once on ``registry`` (one per registry, every policy).

    ``weightbus_catchup_total{policy, outcome}``: catch-ups by how they ended (``caught_up``, ``current``,
    ``ahead``, ``behind``, ``failed``); ``weightbus_catchup_failures_total{policy, reason}``: the failed ones by
    ``CatchupError.reason``.

    Args:
        registry: where the families are registered; a private one when None (scripts only).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.runs = Counter(
            "weightbus_catchup",
            "Catch-ups of one engine to the announced version, by how they ended.",
            ["policy", "outcome"],
            registry=self.registry,
        )
        self.failures = Counter(
            "weightbus_catchup_failures",
            "Catch-ups that failed (the engine quarantined, or left as it was), by reason.",
            ["policy", "reason"],
            registry=self.registry,
        )
