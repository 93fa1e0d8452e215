"""Alerts, any component → operators (``weightbus.<policy>.alerts``): what weightbus refuses to take silently."""

from __future__ import annotations

from typing import Literal

import msgspec

from weightbus.schemas.common import Epoch, PolicyId, Timestamp, Version

__all__ = [
    "PENDING_PREFIX",
    "QUARANTINE_PREFIX",
    "AlertEvent",
    "AlertMessage",
    "EngineOutOfSync",
    "FleetQuarantined",
    "RejectReason",
    "VersionRegressed",
    "VersionRejected",
]

#: Engine labels that start with this are quarantine labels: never a version, so always judged stale.
QUARANTINE_PREFIX = "quarantine:"
#: Engines carry ``pending:<v>`` from the pause to the stamp of update ``v`` when its push does not label them.
PENDING_PREFIX = "pending:"

RejectReason = Literal[
    "not_owner",
    "stale_claim",
    "unexplained_jump",
    "counter_reset",
    "unexplained_claim",
    "unexplained_mark",
    "unexplained_base",
    "conflicting_artifact",
]


class AlertEvent(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of alert events; encoded as ``{"type": <tag>, ...}``."""


class VersionRegressed(AlertEvent, frozen=True, tag="alert.version_regressed"):
    """A tracker saw ``incoming`` after ``current`` (lower) and handled it as ``action``.

    Attributes:
        action: ``hold`` (kept ``current``), ``follow`` (moved to ``incoming``) or ``raise``.
        observer: who noticed (a tracker's id).
    """

    policy: PolicyId
    current: Version
    incoming: Version
    incoming_epoch: Epoch
    publisher: str
    action: Literal["hold", "follow", "raise"]
    observer: str
    published_at: Timestamp
    event_seq: int | None = None


class VersionRejected(AlertEvent, frozen=True, tag="alert.version_rejected"):
    """A tracker refused a weights event that is not a plain regression, and held ``current``.

    Attributes:
        reason: ``not_owner`` (not from the owner of the latest claim), ``stale_claim`` (a claim that
            does not supersede the owner), ``unexplained_jump`` (a version above anything the owner
            reserved), ``counter_reset`` (a takeover whose counter is below the held version, or,
            with ``event_type`` ``CounterHighWater``, a held version below what the counter's
            high-water mark says was announced: the weights history was evicted or overwritten),
            ``unexplained_claim`` (a takeover whose version or reservation is more than one above
            the highest number the chain had seen), ``unexplained_mark`` (with ``event_type``
            ``CounterHighWater``: a high-water mark above what the chain explained when it was
            stored, or superseded by a lower one; ignored, ``incoming`` is the mark's version),
            ``unexplained_base`` (a delta whose base the chain never announced, though it saw every
            announcement since: a reserved-but-aborted number, a refused update), ``conflicting_artifact``
            (the held version announced again with another manifest digest: one number for two sets of bytes).
        event_type: the class name of the refused event (``CounterHighWater`` for the mark).
        current: the version the tracker holds (None: none).
        incoming: its version (None for a claim without one; the mark's ``announced`` for the mark).
        incoming_epoch, publisher: the event's (or the mark's) epoch and trainer id.
        event_seq: its stream sequence (the mark's), so each refused event is alerted once.
    """

    policy: PolicyId
    reason: RejectReason
    event_type: str
    current: Version | None
    incoming: Version | None
    incoming_epoch: Epoch
    publisher: str
    observer: str
    published_at: Timestamp
    event_seq: int | None = None


class EngineOutOfSync(AlertEvent, frozen=True, tag="alert.engine_out_of_sync"):
    """Engine ``engine`` was expected to serve ``expected`` but reported ``actual`` (or ``error``).

    ``reason`` is ``read_back`` (a stamp did not take), ``unexpected_label`` (before stamping, the
    engine reported a label that is neither the last published version nor the one being stamped,
    e.g. ``"default"`` after a restart), or ``not_covered`` (a delta push did not bring the engine to
    ``expected``: it did not hold what the delta is the difference from; it was quarantined, not stamped).
    """

    policy: PolicyId
    engine: str
    expected: str
    actual: str | None
    trainer_id: str
    published_at: Timestamp
    error: str | None = None
    reason: str = "read_back"


class FleetQuarantined(AlertEvent, frozen=True, tag="alert.fleet_quarantined"):
    """Engines were relabelled ``label`` (non-numeric) because their weights may not match a number.

    Attributes:
        reason: ``update_failed`` (an exception or engine failure after the engines may have been
            touched), ``publish_failed`` (the announcement was not confirmed), ``fenced`` (another
            publisher took over mid-update), ``catchup_failed`` (a catch-up, ``producers.catchup``, could not bring
            the engine to ``version``; ``detail`` starts with its reason).
        version: the reserved number of the update that failed; it is never issued again (``catchup_failed``: the
            announced version the catch-up was bringing the engine to).
        engines: the engines relabelled; ``failed`` those that could not be (listed with errors).
        resumed: whether this publisher resumes the engines right after this alert (it held them
            paused). The alert is published before the resume, so no engine generates again before it
            is on the bus (unless its publish fails or takes over 5 s); a resume that then fails is
            logged and noted on the update's error. A fenced publisher resumes them too.
    """

    policy: PolicyId
    label: str
    reason: str
    version: Version
    trainer_id: str
    published_at: Timestamp
    engines: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    resumed: bool = False
    detail: str | None = None


AlertMessage = VersionRegressed | VersionRejected | EngineOutOfSync | FleetQuarantined
