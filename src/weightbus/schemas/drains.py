"""Drain reports, rollout side → monitors (``weightbus.<policy>.drains``).

One ``DrainReport`` per drain: counts by action and reason, staleness statistics, tokens wasted, selection bias.
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


class DrainReport(DrainEvent, frozen=True, tag="drain.report"):
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
            ``given`` (the caller passed the version, or None, directly), ``regressed`` (miles' own
            version after it went backwards with nothing on the bus: labels above it were judged stale).
        tokens_generated, tokens_trained: response tokens of the groups admitted, and of those kept.
        tokens_not_trained: response tokens of the groups not kept, by reason.
        early_aborts, tokens_saved: groups aborted while generating because they had to be stale,
            and at most how many tokens that saved.
        in_flight_versions_avg, in_queue_versions_avg, in_flight_s_avg, in_queue_s_avg: the judged
            groups' staleness split into generating and buffered time, in versions and in seconds.
        by_length, by_reward: groups by outcome (``kept``, ``recycled``, ``dropped``, ``aborted``) and
            by mean response-length or mean reward bucket.
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
    tokens_generated: Count = 0
    tokens_trained: Count = 0
    tokens_not_trained: dict[str, Count] = {}
    early_aborts: Count = 0
    tokens_saved: Count = 0
    in_flight_versions_avg: float | None = None
    in_queue_versions_avg: float | None = None
    in_flight_s_avg: float | None = None
    in_queue_s_avg: float | None = None
    by_length: dict[str, dict[str, Count]] = {}
    by_reward: dict[str, dict[str, Count]] = {}


DrainMessage = DrainReport
