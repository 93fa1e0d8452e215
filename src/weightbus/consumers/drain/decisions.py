"""The staleness stage's results: each group's ``Decision`` and each judgement's ``Judgement`` and ``DrainStats``.

Frozen values holding no rule; every ``Decision`` has a ``Reason``; ``DrainStats.metrics`` omits unknowns, never 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from weightbus.rules.staleness import Reason, Verdict
from weightbus.schemas.rollouts import Group

__all__ = ["Action", "Decision", "DrainStats", "Judgement"]

_M: Final = "rollout/fully_async/"


class Action(StrEnum):
    """What happened to a group."""

    KEPT = "kept"
    RECYCLED = "recycled"
    DROPPED = "dropped"


@dataclass(frozen=True, slots=True)
class Decision:
    """One group's fate: ``action``, ``reason`` and the rule's ``verdict`` (staleness, current used)."""

    action: Action
    reason: Reason
    verdict: Verdict | None = None


@dataclass(frozen=True, slots=True)
class DrainStats:
    """The statistics of one drain (or one ``judge_groups`` call).

    Attributes:
        current: the version groups were judged against (raised to the newest seen when the tracker
            was behind), or None when staleness was unknown (filter off).
        tracker_current: the tracker's version as snapshotted at the start.
        kept, recycled, dropped: groups by action.
        reasons: groups not kept, by reason.
        staleness_avg, staleness_max: over every group judged with a known staleness, filtered ones
            too; None when there was none.
        staleness_count: how many groups had a known staleness.
        tracker_behind: groups holding a version newer than ``tracker_current``.
        unknown_label_groups: groups with a non-version label or no label at all (in either mode).
        queue_size: groups left in the buffer after the drain (0 outside a buffer).
        buffer_avg_staleness, buffer_max_staleness: of the groups left, against the last known version.
        dynamic_filter: dynamic-filter drops by the host's reason.
        version_state: ``current`` (a tracker's version), ``never_published`` (filter off: the policy
            never announced a version) or ``given`` (passed directly by the caller, or miles' own
            version while the tracker was not ready) or ``regressed`` (miles' own version after it
            went backwards with nothing on the bus; labels above it judged stale); a window of several
            judgements reports the least trusted (``VERSION_STATES``).
        tokens_generated: response tokens of the groups admitted in the window.
        tokens_trained: response tokens of the groups kept.
        tokens_not_trained: response tokens of the groups not kept, by reason (``stale``,
            ``unknown_version``, ``aborted``, ``filtered``), counted before a recycled group is reset.
        early_aborts, tokens_saved: groups the host aborted while generating because they had to be
            stale (``rules.abort``), and at most how many tokens that saved.
        in_flight_versions_avg, in_queue_versions_avg: the judged groups' staleness split into versions
            that passed while generating and while waiting in the buffer (they add up to the staleness);
            None without host stamps (``Group.generated_version``).
        in_flight_s_avg, in_queue_s_avg: the same split in seconds (``Group.started_at``/``generated_at``).
        by_length, by_reward: groups by outcome (``kept``, ``recycled``, ``dropped``, ``aborted``) and by
            mean response-length bucket or mean reward bucket (``accounts.LENGTH_BUCKETS``,
            ``accounts.REWARD_BUCKETS``): whether the filter starves long or hard prompts.
    """

    current: int | None
    tracker_current: int | None
    kept: int
    recycled: int
    dropped: int
    reasons: dict[str, int] = field(default_factory=dict)
    staleness_avg: float | None = None
    staleness_max: int | None = None
    staleness_count: int = 0
    tracker_behind: int = 0
    unknown_label_groups: int = 0
    queue_size: int = 0
    buffer_avg_staleness: float | None = None
    buffer_max_staleness: int | None = None
    dynamic_filter: dict[str, int] = field(default_factory=dict)
    version_state: str = "given"
    tokens_generated: int = 0
    tokens_trained: int = 0
    tokens_not_trained: dict[str, int] = field(default_factory=dict)
    early_aborts: int = 0
    tokens_saved: int = 0
    in_flight_versions_avg: float | None = None
    in_queue_versions_avg: float | None = None
    in_flight_s_avg: float | None = None
    in_queue_s_avg: float | None = None
    by_length: dict[str, dict[str, int]] = field(default_factory=dict)
    by_reward: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def tokens_not_trained_total(self) -> int:
        """Every response token of the window not trained on (every reason)."""
        return sum(self.tokens_not_trained.values())

    @property
    def metrics(self) -> dict[str, float]:
        """Flat metrics: miles' exact ``rollout/fully_async/*`` names plus ``weightbus/*``.

        ``avg_staleness``/``max_staleness`` and ``buffer_*`` are omitted when unknown, as in miles.
        """
        out: dict[str, float] = {
            f"{_M}queue_size": self.queue_size,
            f"{_M}aborted_groups_filtered": self.reasons.get(Reason.ABORTED, 0),
            f"{_M}stale_groups_filtered": self.reasons.get(Reason.STALE, 0),
            "weightbus/kept": self.kept,
            "weightbus/recycled": self.recycled,
            "weightbus/dropped": self.dropped,
            "weightbus/unknown_version": self.reasons.get(Reason.UNKNOWN_VERSION, 0),
            "weightbus/unknown_label_groups": self.unknown_label_groups,
            "weightbus/tracker_behind": self.tracker_behind,
        }
        if self.staleness_avg is not None and self.staleness_max is not None:
            out[f"{_M}avg_staleness"] = self.staleness_avg
            out[f"{_M}max_staleness"] = self.staleness_max
        if self.buffer_avg_staleness is not None and self.buffer_max_staleness is not None:
            out[f"{_M}buffer_avg_staleness"] = self.buffer_avg_staleness
            out[f"{_M}buffer_max_staleness"] = self.buffer_max_staleness
        if self.current is not None:
            out["weightbus/current_version"] = self.current
        for reason, n in self.dynamic_filter.items():
            if reason:
                out[f"rollout/dynamic_filter/drop_{reason}"] = n
        out["weightbus/tokens_generated"] = self.tokens_generated
        out["weightbus/tokens_trained"] = self.tokens_trained
        out["weightbus/tokens_not_trained"] = self.tokens_not_trained_total
        for reason, n in self.tokens_not_trained.items():
            out[f"weightbus/tokens_not_trained/{reason}"] = n
        if self.early_aborts:
            out["weightbus/early_aborts"] = self.early_aborts
            out["weightbus/tokens_saved"] = self.tokens_saved
        for key, value in (
            ("in_flight_versions", self.in_flight_versions_avg),
            ("in_queue_versions", self.in_queue_versions_avg),
            ("in_flight_seconds", self.in_flight_s_avg),
            ("in_queue_seconds", self.in_queue_s_avg),
        ):
            if value is not None:
                out[f"weightbus/staleness/{key}"] = value
        return out


@dataclass(frozen=True, slots=True)
class Judgement:
    """The groups of one judgement by action, and its statistics.

    ``recycled`` holds the flat prompt groups, already reset for a retry.
    """

    kept: list[Group]
    recycled: list[Group]
    dropped: list[Group]
    stats: DrainStats

    @property
    def metrics(self) -> dict[str, float]:
        """``stats.metrics``."""
        return self.stats.metrics
