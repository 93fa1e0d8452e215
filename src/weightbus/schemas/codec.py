"""The one typed decode: bytes on a subject → an event of that subject's family, or ``InvalidEventError``.

``encode`` checks an event against the same types (msgspec's constructors check none) and raises
``UnsendableEventError`` naming the field; both buses encode through it, so no event a consumer drops is ever sent.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from weightbus.errors import InvalidEventError, UnsendableEventError
from weightbus.schemas.admission import AdmissionLedger, AdmissionMessage
from weightbus.schemas.alerts import (
    AlertMessage,
    EngineOutOfSync,
    FleetQuarantined,
    VersionRegressed,
    VersionRejected,
)
from weightbus.schemas.drains import DrainMessage, DrainReport
from weightbus.schemas.weights import (
    AppliedMessage,
    CounterHighWater,
    CounterMessage,
    PublisherClaimed,
    VersionReserved,
    WeightApplied,
    WeightMessage,
    WeightUpdated,
)

__all__ = ["FAMILIES", "MAX_EVENT_BYTES", "Event", "decode", "encode", "family_of", "json_schemas"]

#: Control events are small; anything larger is refused before parsing.
MAX_EVENT_BYTES: Final = 64 * 1024

Event = (
    WeightUpdated
    | PublisherClaimed
    | VersionReserved
    | WeightApplied
    | VersionRegressed
    | VersionRejected
    | EngineOutOfSync
    | FleetQuarantined
    | DrainReport
    | CounterHighWater
    | AdmissionLedger
)

#: subject family → the tagged union carried on it.
FAMILIES: Final[dict[str, Any]] = {
    "weights": WeightMessage,
    "applied": AppliedMessage,
    "alerts": AlertMessage,
    "drains": DrainMessage,
    "counter": CounterMessage,
    "admission": AdmissionMessage,
}

_DECODERS: Final[dict[str, msgspec.json.Decoder[Event]]] = {
    family: msgspec.json.Decoder(union) for family, union in FAMILIES.items()
}
_ENCODER: Final = msgspec.json.Encoder()
_FAMILY_OF_TYPE: Final[dict[type, str]] = {
    WeightUpdated: "weights",
    PublisherClaimed: "weights",
    VersionReserved: "weights",
    WeightApplied: "applied",
    VersionRegressed: "alerts",
    VersionRejected: "alerts",
    EngineOutOfSync: "alerts",
    FleetQuarantined: "alerts",
    DrainReport: "drains",
    CounterHighWater: "counter",
    AdmissionLedger: "admission",
}


def family_of(event: Event) -> str:
    """The subject family an event belongs on.

    Raises:
        TypeError: ``event`` is not a weightbus event.
    """
    try:
        return _FAMILY_OF_TYPE[type(event)]
    except KeyError:
        raise TypeError(f"not a weightbus event: {type(event).__name__}") from None


_CHECKERS: Final[dict[type, msgspec.json.Decoder[Event]]] = {cls: msgspec.json.Decoder(cls) for cls in _FAMILY_OF_TYPE}


def encode(event: Event) -> bytes:
    """Encode an event as its wire JSON (``{"type": <tag>, ...}``), checked against its type first.

    Raises:
        TypeError: ``event`` is not a weightbus event.
        UnsendableEventError: the encoded event would fail the typed decode (its ``path`` names the
            field, e.g. ``$.version``), or it is larger than ``MAX_EVENT_BYTES``.
    """
    family = family_of(event)
    data = _ENCODER.encode(event)
    if len(data) > MAX_EVENT_BYTES:
        raise _unsendable(event, family, "$", f"{len(data)} bytes > {MAX_EVENT_BYTES}")
    try:
        _CHECKERS[type(event)].decode(data)
    except msgspec.ValidationError as exc:
        detail = str(exc)
        _, _, at = detail.rpartition(" - at `")
        raise _unsendable(event, family, at.rstrip("`") if at else "$", detail) from None
    return data


def _unsendable(event: Event, family: str, path: str, detail: str) -> UnsendableEventError:
    policy = getattr(event, "policy", "?")
    return UnsendableEventError(f"weightbus.{policy}.{family}", family, type(event).__name__, path, detail)


def decode(subject: str, data: bytes) -> Event:
    """Decode ``data`` received on ``subject`` into its family's event type.

    Raises:
        InvalidEventError: with ``reason`` ``unknown_subject``, ``oversized``, ``malformed`` (not JSON)
            or ``invalid`` (JSON that is not a valid event: wrong type, constraint, unknown tag).
    """
    family = subject.rsplit(".", 1)[-1] if subject.startswith("weightbus.") else ""
    decoder = _DECODERS.get(family)
    if decoder is None:
        raise InvalidEventError(subject, "unknown", "unknown_subject", "subject is not weightbus.<policy>.<family>")
    if len(data) > MAX_EVENT_BYTES:
        raise InvalidEventError(subject, family, "oversized", f"{len(data)} bytes > {MAX_EVENT_BYTES}")
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise InvalidEventError(subject, family, "invalid", str(exc)) from None
    except msgspec.DecodeError as exc:
        raise InvalidEventError(subject, family, "malformed", str(exc)) from None


def json_schemas() -> dict[str, Any]:
    """The JSON Schema of each family's union, keyed by family, for non-Python subscribers."""
    out: dict[str, Any] = {}
    for family, union in FAMILIES.items():
        out[family] = msgspec.json.schema(union)
    return out
