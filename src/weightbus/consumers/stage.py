"""The staleness stage: keep, recycle or drop each drained group, and the window's statistics.

Invariants:

* every decision carries a reason (``fresh``/``unmeasured`` for keeps, ``stale``, ``unknown_version``,
  ``aborted``, ``filtered`` otherwise); groups not kept all take the ``on_stale`` action, except
  dynamic-filter rejects, which are always dropped;
* ``current`` is read once per judgement; a group newer than it raises the judgement's current to
  the newest version seen (``tracker_behind``) and the groups already kept are judged again, so no
  group is admitted because its staleness came out negative;
* statistics cover every group judged with a known staleness, filtered ones included (miles
  semantics); a recycled group is reset after it was measured;
* Prometheus is touched once per judgement, never per group.

``judge_groups`` is the one-call helper for host frameworks (miles, slime): no bus, no buffer. The
result types (``Action``, ``Decision``, ``DrainStats``, ``Judgement``) live in ``decisions`` and are
re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Final, Literal

from weightbus.consumers.decisions import Action, Decision, DrainStats, Judgement
from weightbus.consumers.metrics import DrainMetrics
from weightbus.consumers.staleness import (
    UNKNOWN_POLICIES,
    Reason,
    UnknownPolicy,
    group_versions,
    judge,
    raw_scan,
)
from weightbus.schemas.rollouts import ABORTED, HAS_UNKNOWN, HAS_VERSION, NO_NEWEST, NO_OLDEST, Group, SampleStatus

__all__ = [
    "Action",
    "Decision",
    "DrainStats",
    "Judgement",
    "OnStale",
    "StalenessStage",
    "judge_groups",
]

OnStale = Literal["drop", "recycle"]
_ABORTED: Final = SampleStatus.ABORTED


class _Tally:
    """One judgement's running state: what was kept, the staleness values and counts by reason."""

    __slots__ = (
        "snapshot",
        "current",
        "max_staleness",
        "strict",
        "kept",
        "kept_oldest",
        "evicted",
        "stale_oldest",
        "n_stale",
        "n_unknown",
        "n_aborted",
        "behind",
        "unknown_labels",
        "final_values",
    )

    def __init__(self, current: int | None, max_staleness: int | None, strict: bool) -> None:
        self.snapshot = current
        self.current = current
        self.max_staleness = max_staleness
        self.strict = strict
        self.kept: list[Group] = []
        self.kept_oldest: list[int | None] = []
        self.evicted: list[Group] = []  # kept groups that a later raise of ``current`` made stale
        # oldest versions of stale groups; every staleness is taken against the final current in ``finish``
        self.stale_oldest: list[int] = []
        self.n_stale = 0
        self.n_unknown = 0
        self.n_aborted = 0
        self.behind = 0
        self.unknown_labels = 0
        self.final_values: list[int] = []

    def add(self, group: Group) -> Reason:
        """Judge one group; a kept group is recorded here, any other is the caller's to route."""
        # The flat scan is inlined (scan_group's loop, sentinels included): this is the hot path.
        lo = NO_OLDEST
        hi = NO_NEWEST
        flags = 0
        try:
            for s in group.samples:
                f, o, n = s._v
                if o < lo:
                    lo = o
                if n > hi:
                    hi = n
                flags |= f
        except AttributeError:
            lo, hi, flags = raw_scan(group)
        else:
            if group.trajectories or group.status == _ABORTED:
                lo, hi, flags = raw_scan(group)
        return self._judge(group, lo, hi, flags)

    def _judge(self, group: Group, lo: float, hi: int, flags: int) -> Reason:
        """The full rule on a group whose labels were already scanned into ``(lo, hi, flags)``."""
        if flags & ABORTED:
            self.n_aborted += 1
            return Reason.ABORTED
        unknown = flags & HAS_UNKNOWN or not flags & HAS_VERSION
        if unknown:
            self.unknown_labels += 1
        cur = self.current
        if cur is None:
            self.kept.append(group)
            self.kept_oldest.append(None)
            return Reason.UNMEASURED
        if hi > self.snapshot:  # type: ignore[operator]  # snapshot is an int whenever cur is
            self.behind += 1
            if hi > cur:
                self._raise_current(hi)
                cur = hi
        mx = self.max_staleness
        if unknown and self.strict and mx is not None:
            self.n_unknown += 1
            return Reason.UNKNOWN_VERSION
        if not flags & HAS_VERSION or unknown and self.strict:
            self.kept.append(group)
            self.kept_oldest.append(None)
            return Reason.UNMEASURED
        s = cur - lo
        if mx is not None and s > mx:
            self.stale_oldest.append(lo)  # type: ignore[arg-type]  # lo is an int when HAS_VERSION is set
            self.n_stale += 1
            return Reason.STALE
        self.kept.append(group)
        self.kept_oldest.append(lo)  # type: ignore[arg-type]
        return Reason.FRESH

    def _raise_current(self, newest: int) -> None:
        self.current = newest
        mx = self.max_staleness
        if mx is None:
            return
        kept: list[Group] = []
        oldest: list[int | None] = []
        for group, lo in zip(self.kept, self.kept_oldest, strict=True):
            if lo is not None and newest - lo > mx:
                self.evicted.append(group)
                self.stale_oldest.append(lo)
                self.n_stale += 1
            else:
                kept.append(group)
                oldest.append(lo)
        # In place: add_many holds bound appends of these lists.
        self.kept[:] = kept
        self.kept_oldest[:] = oldest

    def add_many(self, groups: Iterable[Group]) -> list[Group]:
        """``add`` over a batch; returns the groups not kept, in order.

        The common case (numeric labels only, nothing newer than the snapshot, flat, not aborted)
        is inlined; every other group goes through ``add``, which holds the full rule.
        """
        unused: list[Group] = []
        add = self.add
        judge = self._judge
        snap = self.snapshot
        if snap is None:
            for group in groups:
                reason = add(group)
                if reason is not Reason.FRESH and reason is not Reason.UNMEASURED:
                    unused.append(group)
            return unused
        kept_append = self.kept.append
        oldest_append = self.kept_oldest.append
        unused_append = unused.append
        stale_append = self.stale_oldest.append
        mx = math.inf if self.max_staleness is None else self.max_staleness
        n_stale = 0
        for group in groups:
            lo = NO_OLDEST
            hi = NO_NEWEST
            flags = 0
            try:
                for s in group.samples:
                    f, o, n = s._v
                    if o < lo:
                        lo = o
                    if n > hi:
                        hi = n
                    flags |= f
            except AttributeError:
                flags = -1
            if flags != HAS_VERSION or hi > snap or group.trajectories or group.status == _ABORTED:
                # Reuse this scan unless the group needs the full one (unscanned, nested or aborted).
                if flags == -1 or group.trajectories or group.status == _ABORTED:
                    reason = add(group)
                else:
                    reason = judge(group, lo, hi, flags)
                if reason is not Reason.FRESH and reason is not Reason.UNMEASURED:
                    unused_append(group)
                continue
            st = self.current - lo
            if st > mx:
                stale_append(lo)
                n_stale += 1
                unused_append(group)
            else:
                kept_append(group)
                oldest_append(lo)
        self.n_stale += n_stale
        return unused

    def staleness_values(self) -> list[int]:
        """Every known staleness so far (stale and kept groups) against the current ``current``."""
        cur = self.current
        if cur is None:
            return []
        return [cur - lo for lo in self.stale_oldest] + [cur - lo for lo in self.kept_oldest if lo is not None]

    def kept_counts(self) -> tuple[int, int]:
        """``(fresh, unmeasured)`` among the groups kept so far."""
        unmeasured = self.kept_oldest.count(None)
        return len(self.kept_oldest) - unmeasured, unmeasured

    def finish(
        self,
        *,
        recycled: int,
        dropped: int,
        filtered: dict[str, int] | None = None,
        queue_size: int = 0,
        buffer_avg_staleness: float | None = None,
        buffer_max_staleness: int | None = None,
    ) -> DrainStats:
        """The statistics, with the kept groups measured against the final ``current``.

        Also leaves every known staleness value in ``final_values`` for the histogram.
        """
        cur = self.current
        values = self.staleness_values()
        self.final_values = values
        reasons: dict[str, int] = {}
        for reason, n in (
            (Reason.STALE, self.n_stale),
            (Reason.UNKNOWN_VERSION, self.n_unknown),
            (Reason.ABORTED, self.n_aborted),
        ):
            if n:
                reasons[reason.value] = n
        n_filtered = sum((filtered or {}).values())
        if n_filtered:
            reasons[Reason.FILTERED.value] = n_filtered
        return DrainStats(
            current=cur,
            tracker_current=self.snapshot,
            kept=len(self.kept),
            recycled=recycled,
            dropped=dropped,
            reasons=reasons,
            staleness_avg=sum(values) / len(values) if values else None,
            staleness_max=max(values) if values else None,
            staleness_count=len(values),
            tracker_behind=self.behind,
            unknown_label_groups=self.unknown_labels,
            queue_size=queue_size,
            buffer_avg_staleness=buffer_avg_staleness,
            buffer_max_staleness=buffer_max_staleness,
            dynamic_filter=dict(filtered or {}),
        )


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

    def tally(self, current: int | None) -> _Tally:
        """A fresh running judgement against ``current`` (used by the buffer, one per drain)."""
        return _Tally(current, self.max_staleness, self.unknown == "stale")

    def judge(self, groups: Iterable[Group], current: int | None) -> Judgement:
        """Judge a batch of groups against one snapshot of ``current``.

        Kept groups keep their input order. Groups not kept are reset for a retry under
        ``on_stale="recycle"``; metrics are updated once.
        """
        t = self.tally(current)
        unused = t.add_many(groups)
        unused.extend(t.evicted)
        recycled: list[Group] = []
        dropped: list[Group] = []
        if self.unused_action is Action.RECYCLED:
            recycled = [g.reset_for_retry() for g in unused]
        else:
            dropped = unused
        stats = t.finish(recycled=len(recycled), dropped=len(dropped))
        self.record(t, stats)
        return Judgement(kept=t.kept, recycled=recycled, dropped=dropped, stats=stats)

    def record(self, t: _Tally, stats: DrainStats, *, filtered: int = 0) -> None:
        """Push one finished judgement's tallies to Prometheus (no-op without metrics)."""
        m = self.metrics
        if m is None:
            return
        fresh, unmeasured = t.kept_counts()
        m.count_groups(Action.KEPT, Reason.FRESH, fresh)
        m.count_groups(Action.KEPT, Reason.UNMEASURED, unmeasured)
        unused = self.unused_action.value
        m.count_groups(unused, Reason.STALE, t.n_stale)
        m.count_groups(unused, Reason.UNKNOWN_VERSION, t.n_unknown)
        m.count_groups(unused, Reason.ABORTED, t.n_aborted)
        m.count_groups(Action.DROPPED, Reason.FILTERED, filtered)
        m.observe_staleness(t.final_values)
        m.tracker_behind(t.behind)
        m.set_current(stats.current)


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
