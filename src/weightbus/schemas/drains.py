"""Drain reports, rollout side → monitors (``weightbus.<policy>.drains``).

One ``DrainReport`` per drain of the fully-async buffer (or per call of the staleness helper):
counts by action and reason and the staleness statistics of the window, in versions.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from weightbus.schemas.common import PolicyId, Timestamp, Version

__all__ = ["DrainEvent", "DrainMessage", "DrainReport"]

Count = Annotated[int, Meta(ge=0)]


class DrainEvent(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of drain events; encoded as ``{"type": <tag>, ...}``."""


class DrainReport(DrainEvent, tag="drain.report"):
    """What one drain decided.

    Attributes:
        consumer: who drained (a rollout manager's id); ``seq`` counts its drains from 1.
        current: the version the drain judged against, or None when staleness was unknown (filter off).
        kept, recycled, dropped: groups by action.
        reasons: groups not kept, by reason (``stale``, ``unknown_version``, ``aborted``).
        staleness_avg, staleness_max: over every group judged with a known staleness, filtered ones too.
        tracker_behind: groups newer than ``current`` (the tracker lagged; the drain used the newest seen).
        queue_size: groups left in the buffer after the drain.
        version_state: where ``current`` came from: ``current`` (a tracker's known version),
            ``never_published`` (the policy never announced a version: the filter was off),
            ``given`` (the caller passed the version, or None, directly).
    """

    policy: PolicyId
    consumer: str
    seq: Count
    current: Version | None
    kept: Count
    recycled: Count
    dropped: Count
    published_at: Timestamp
    reasons: dict[str, Count] = {}
    staleness_avg: float | None = None
    staleness_max: int | None = None
    tracker_behind: Count = 0
    queue_size: Count = 0
    version_state: str | None = None


DrainMessage = DrainReport
