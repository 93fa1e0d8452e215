"""Alerts, any component → operators (``weightbus.<policy>.alerts``).

An alert is published when weightbus refuses to take something silently: a version that went
backwards, or an engine that does not serve the version it was stamped with.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from weightbus.schemas.common import Epoch, PolicyId, Timestamp, Version

__all__ = ["AlertEvent", "AlertMessage", "EngineOutOfSync", "VersionRegressed"]


class AlertEvent(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of alert events; encoded as ``{"type": <tag>, ...}``."""


class VersionRegressed(AlertEvent, tag="alert.version_regressed"):
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


class EngineOutOfSync(AlertEvent, tag="alert.engine_out_of_sync"):
    """Engine ``engine`` was stamped with ``expected`` but reported ``actual`` (or ``error``)."""

    policy: PolicyId
    engine: str
    expected: str
    actual: str | None
    trainer_id: str
    published_at: Timestamp
    error: str | None = None


AlertMessage = VersionRegressed | EngineOutOfSync
