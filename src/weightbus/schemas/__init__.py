"""The wire contract: msgspec event types, one tagged union per subject family, and the one decode.

Families: ``weights``, ``counter``, ``applied``, ``alerts``, ``drains``, ``admission``; rollout data is ``rollouts``.
"""

from weightbus.schemas.admission import AdmissionLedger, AdmissionMessage, Holding
from weightbus.schemas.alerts import (
    PENDING_PREFIX,
    QUARANTINE_PREFIX,
    AlertMessage,
    EngineOutOfSync,
    FleetQuarantined,
    VersionRegressed,
    VersionRejected,
)
from weightbus.schemas.codec import FAMILIES, MAX_EVENT_BYTES, Event, decode, encode, family_of, json_schemas
from weightbus.schemas.common import MAX_VERSION, Epoch, PolicyId, Timestamp, Version, now
from weightbus.schemas.drains import DrainMessage, DrainReport
from weightbus.schemas.rollouts import Group, Sample, SampleStatus, TokenSpan, parse_version
from weightbus.schemas.weights import (
    AppliedMessage,
    ClaimStanding,
    CounterHighWater,
    CounterMessage,
    LoraAdapter,
    PublisherClaimed,
    VersionReserved,
    WeightApplied,
    WeightArtifact,
    WeightMessage,
    WeightUpdated,
)

__all__ = [
    "AdmissionLedger",
    "AdmissionMessage",
    "Holding",
    "FAMILIES",
    "MAX_EVENT_BYTES",
    "MAX_VERSION",
    "PENDING_PREFIX",
    "QUARANTINE_PREFIX",
    "AlertMessage",
    "AppliedMessage",
    "ClaimStanding",
    "CounterHighWater",
    "CounterMessage",
    "DrainMessage",
    "DrainReport",
    "EngineOutOfSync",
    "Epoch",
    "FleetQuarantined",
    "Event",
    "Group",
    "LoraAdapter",
    "PolicyId",
    "PublisherClaimed",
    "Sample",
    "SampleStatus",
    "Timestamp",
    "TokenSpan",
    "Version",
    "VersionRegressed",
    "VersionRejected",
    "VersionReserved",
    "WeightApplied",
    "WeightArtifact",
    "WeightMessage",
    "WeightUpdated",
    "decode",
    "encode",
    "family_of",
    "json_schemas",
    "now",
    "parse_version",
]
