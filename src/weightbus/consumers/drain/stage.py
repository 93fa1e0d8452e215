"""The staleness stage: keep, recycle or drop each drained group, and the window's statistics.

Every decision has a reason; groups not kept take ``on_stale`` (filter rejects are dropped). ``judge_groups`` is the
one-call helper for host frameworks (no bus, no buffer); the result types are re-exported from ``decisions``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Literal

from weightbus.consumers.drain.decisions import Action, Decision, DrainStats, Judgement
from weightbus.consumers.drain.metrics import DrainMetrics
from weightbus.consumers.drain.tally import DrainTally
from weightbus.consumers.drain.window import DrainWindow, HeldSlots
from weightbus.rules.staleness import UNKNOWN_POLICIES, Reason, UnknownPolicy, group_versions, judge
from weightbus.schemas.rollouts import Group

if TYPE_CHECKING:
    from weightbus.consumers.drain.reports import DrainReporter

__all__ = [
    "Action",
    "Decision",
    "DrainStats",
    "DrainTally",
    "DrainWindow",
    "Judgement",
    "OnStale",
    "StalenessStage",
    "judge_groups",
]

OnStale = Literal["drop", "recycle"]


class StalenessStage:
    """Decides per group: keep, recycle (the prompt group is reset and goes back) or drop.

    Args:
        max_staleness: the largest staleness kept, in versions; None measures without filtering.
        on_stale: what happens to groups not kept (stale, unknown version, aborted): ``drop`` or
            ``recycle``.
        unknown: ``stale`` (default) filters groups with a non-version label or no label as
            ``unknown_version``; ``ignore`` skips non-numeric labels as miles does.
        metrics: the policy's metrics, updated once per judgement; None for none.

    Raises:
        ValueError: a negative ``max_staleness``, or an unknown ``on_stale`` or ``unknown``.
    """

    def __init__(
        self,
        *,
        max_staleness: int | None = None,
        on_stale: OnStale = "drop",
        unknown: UnknownPolicy = "stale",
        metrics: DrainMetrics | None = None,
    ) -> None:
        if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
            raise ValueError(f"max_staleness must be an int >= 0 or None, got {max_staleness!r}")
        if on_stale not in ("drop", "recycle"):
            raise ValueError(f"on_stale must be 'drop' or 'recycle', got {on_stale!r}")
        if unknown not in UNKNOWN_POLICIES:
            raise ValueError(f"unknown must be 'stale' or 'ignore', got {unknown!r}")
        self.max_staleness = max_staleness
        self.on_stale: OnStale = on_stale
        self.unknown: UnknownPolicy = unknown
        self.metrics = metrics
        self.unused_action = Action.RECYCLED if on_stale == "recycle" else Action.DROPPED

    def decide(self, group: Group, current: int | None) -> Decision:
        """Judge one group on its own (its newest version may raise ``current``, see ``judge``)."""
        if group.is_aborted:
            return Decision(self.unused_action, Reason.ABORTED)
        verdict = judge(group_versions(group), current, max_staleness=self.max_staleness, unknown=self.unknown)
        action = Action.KEPT if verdict.keep else self.unused_action
        return Decision(action, verdict.reason, verdict)

    def window(
        self,
        *,
        on_unused: Callable[[Group], None] | None = None,
        reporter: DrainReporter | None = None,
        slots: HeldSlots | None = None,
    ) -> DrainWindow:
        """A drain engine with this configuration (one per host: a buffer, an adapter); see ``DrainWindow``."""
        return DrainWindow(self, on_unused=on_unused, reporter=reporter, slots=slots)

    def judge(self, groups: Iterable[Group], current: int | None) -> Judgement:
        """Judge a batch of groups against one snapshot of ``current``: one window of one judgement.

        Kept groups keep their input order. Groups not kept are reset for a retry under
        ``on_stale="recycle"``; metrics are updated once.
        """
        w = DrainWindow(self)
        t = w.begin(current)
        unused = w.take_many(t, groups)
        recycled: list[Group] = []
        dropped: list[Group] = []
        if self.unused_action is Action.RECYCLED:
            recycled = [g.reset_for_retry() for g in unused]
        else:
            dropped = unused
        kept = w.close(t)
        return Judgement(kept=kept, recycled=recycled, dropped=dropped, stats=w.finish())


def judge_groups(
    groups: Iterable[Group],
    current: int | None,
    *,
    max_staleness: int | None = None,
    on_stale: OnStale = "drop",
    unknown: UnknownPolicy = "stale",
    metrics: DrainMetrics | None = None,
) -> Judgement:
    """Judge ``groups`` against ``current`` in one call, without a bus or a buffer.

    For host frameworks that keep their own buffer: call it with the groups taken for a training
    step and the tracker's current version, train on ``kept``, re-queue ``recycled`` (already reset),
    and log ``metrics``.

    Args:
        groups: the groups to judge.
        current: the policy's current version, or None before the first publish (filter off).
        max_staleness: the largest staleness kept; None measures without filtering.
        on_stale: ``drop`` or ``recycle`` the groups not kept.
        unknown: ``stale`` or ``ignore`` non-version labels.
        metrics: optional Prometheus metrics of the policy.

    Raises:
        ValueError: invalid ``max_staleness``, ``on_stale`` or ``unknown``.
    """
    stage = StalenessStage(max_staleness=max_staleness, on_stale=on_stale, unknown=unknown, metrics=metrics)
    return stage.judge(groups, current)
