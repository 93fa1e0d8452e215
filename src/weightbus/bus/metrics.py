"""Prometheus metrics of the bus boundary, registered on an injected ``CollectorRegistry``.

Only low-cardinality labels: the subject family and a fixed reason, never a subject or a payload value.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from weightbus.schemas.codec import FAMILIES

__all__ = ["BusMetrics"]


class BusMetrics:
    """Counters of the bus boundary.

    ``weightbus_invalid_events_total{family, reason}`` counts payloads that failed the typed decode
    (``malformed``, ``invalid``, ``oversized``, ``unknown_subject``). Pass None as the registry to get
    an unregistered private one (useful in scripts; tests should inject theirs).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.invalid_events = Counter(
            "weightbus_invalid_events",
            "Payloads that failed the typed decode at the bus boundary, by subject family and reason.",
            ["family", "reason"],
            registry=self.registry,
        )
        # Every pair at 0 from the start: a counter born at 1 on its first event shows no increase(), so an
        # alert on it would miss the first invalid payload.
        for family in FAMILIES:
            for reason in ("malformed", "invalid", "oversized"):
                self.invalid_events.labels(family, reason)
        self.invalid_events.labels("unknown", "unknown_subject")
