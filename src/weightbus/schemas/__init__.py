"""The wire contract: msgspec event types, one tagged union per subject family, and the one decode.

Families and their subjects: ``weights`` (``WeightUpdated``, ``PublisherClaimed``), ``applied``
(``WeightApplied``), ``alerts`` (``VersionRegressed``, ``EngineOutOfSync``), ``drains``
(``DrainReport``). Rollout data: ``Sample``, ``Group``, ``TokenSpan`` (module ``rollouts``).
"""

from weightbus.schemas.alerts import AlertMessage, EngineOutOfSync, VersionRegressed
from weightbus.schemas.codec import FAMILIES, MAX_EVENT_BYTES, Event, decode, encode, family_of, json_schemas
from weightbus.schemas.common import Epoch, PolicyId, Timestamp, Version, now
from weightbus.schemas.drains import DrainMessage, DrainReport
from weightbus.schemas.rollouts import Group, Sample, SampleStatus, TokenSpan, parse_version
from weightbus.schemas.weights import (
    AppliedMessage,
    LoraAdapter,
    PublisherClaimed,
    WeightApplied,
    WeightMessage,
    WeightUpdated,
)

__all__ = [
    "FAMILIES",
    "MAX_EVENT_BYTES",
    "AlertMessage",
    "AppliedMessage",
    "DrainMessage",
    "DrainReport",
    "EngineOutOfSync",
    "Epoch",
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
    "WeightApplied",
    "WeightMessage",
    "WeightUpdated",
    "decode",
    "encode",
    "family_of",
    "json_schemas",
    "now",
    "parse_version",
]
