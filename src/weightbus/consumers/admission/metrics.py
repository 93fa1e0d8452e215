"""Prometheus metrics of the shared admission budget, on an injected ``CollectorRegistry`` (never the global one).

Families ``weightbus_admission_*`` (docs/operations.md#metrics); labels ``policy`` and ``reason``, never a holder id.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from weightbus.rules.admission import LEDGER_REJECTIONS

__all__ = ["AdmissionMetrics", "PolicyAdmissionMetrics"]


class PolicyAdmissionMetrics:
    """The families of ``AdmissionMetrics`` with one policy's gauge child made (``AdmissionMetrics.for_policy``).

    Attributes:
        rejected, clipped, tampered, over_admission: the counter families (label them with the policy).
        starved: the policy's starvation gauge (``set_function`` it).
    """

    __slots__ = ("clipped", "over_admission", "rejected", "starved", "tampered")

    def __init__(self, families: AdmissionMetrics, policy: str) -> None:
        self.rejected = families.rejected
        self.clipped = families.clipped
        self.tampered = families.tampered
        self.over_admission = families.over_admission
        self.starved = families.starved.labels(policy)
        # Every series an alert watches exists at 0 before its first event (increase() needs a start).
        for reason in LEDGER_REJECTIONS:
            self.rejected.labels(policy, reason)
        for family in (self.clipped, self.tampered, self.over_admission):
            family.labels(policy)


class AdmissionMetrics:
    """The shared budget's metric families on ``registry``; see the module docstring."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.rejected = Counter(
            "weightbus_admission_ledgers_rejected",
            "Admission ledgers refused as transitions from the last valid one, by reason",
            ["policy", "reason"],
            registry=registry,
        )
        self.clipped = Counter(
            "weightbus_admission_leases_clipped",
            "Admission holdings whose claimed lease went beyond the configured one (clipped)",
            ["policy"],
            registry=registry,
        )
        self.tampered = Counter(
            "weightbus_admission_holding_tampered",
            "Admission ledgers that erased or altered this holder's holding without being its write",
            ["policy"],
            registry=registry,
        )
        self.over_admission = Counter(
            "weightbus_admission_over_admission",
            "Accepted admission ledgers whose holdings had more in use than the total",
            ["policy"],
            registry=registry,
        )
        self.starved = Gauge(
            "weightbus_admission_starved_seconds",
            "Seconds this holder has wanted an admission slot and held none (0: holds one or wants none)",
            ["policy"],
            registry=registry,
        )

    def for_policy(self, policy: str) -> PolicyAdmissionMetrics:
        """The families, with ``policy``'s gauge made."""
        return PolicyAdmissionMetrics(self, policy)
