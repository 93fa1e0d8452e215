"""``DrainTally``: the running bookkeeping of one judgement (one drain, or one ``judge_groups`` call).

Every group goes through ``staleness.judge`` but in the inlined fast paths (pinned to it by a property test); a newer
label raises ``current`` and re-judges the kept groups (``evicted``); staleness is taken at the final ``current``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Final

from weightbus.rules.staleness import GroupVersions, Reason, UnknownPolicy, judge, raw_scan
from weightbus.schemas.rollouts import ABORTED, HAS_UNKNOWN, HAS_VERSION, NO_NEWEST, NO_OLDEST, Group, SampleStatus

__all__ = ["DrainTally"]

_ABORTED: Final = SampleStatus.ABORTED


class DrainTally:
    """One judgement's running state: what was kept, the staleness values and counts by reason.

    Args:
        current: the version snapshot the judgement starts from (None: filter off).
        max_staleness: the largest staleness kept, or None.
        unknown: ``stale`` or ``ignore``, as in ``staleness.judge``.
    """

    __slots__ = (
        "snapshot",
        "regressed",
        "current",
        "max_staleness",
        "strict",
        "unknown",
        "kept",
        "kept_oldest",
        "evicted",
        "stale_oldest",
        "n_stale",
        "n_unknown",
        "n_aborted",
        "behind",
        "unknown_labels",
        "sums",
    )

    def __init__(
        self, current: int | None, max_staleness: int | None, unknown: UnknownPolicy = "stale", regressed: bool = False
    ) -> None:
        self.snapshot = current
        self.regressed = regressed  # labels above current are the old numbering's (rules.staleness)
        self.current = current
        self.max_staleness = max_staleness
        self.unknown: UnknownPolicy = unknown
        self.strict = unknown == "stale"
        self.kept: list[Group] = []
        self.kept_oldest: list[int | None] = []
        self.evicted: list[Group] = []  # kept groups that a later raise of ``current`` made stale
        # oldest versions of stale groups; every staleness is taken against the final current (``staleness_values``)
        self.stale_oldest: list[int] = []
        self.n_stale = 0
        self.n_unknown = 0
        self.n_aborted = 0
        self.behind = 0
        self.unknown_labels = 0
        # id(group) -> (response tokens, samples, reward sum, rewarded samples, oldest), by the inlined paths
        self.sums: dict[int, tuple[int, int, float, int, float]] = {}

    def add(self, group: Group) -> Reason:
        """Judge one group; a kept group is recorded here, any other is the caller's to route.

        The buffer calls this once per drained group: the common case is inlined as in ``add_many``
        (and pinned to the rule by the same property test); everything else goes through ``_judge``.
        """
        snap = self.snapshot
        if snap is not None and not group.trajectories and group.status != _ABORTED:
            lo = NO_OLDEST
            hi = NO_NEWEST
            flags = tokens = rewarded = 0
            reward_sum = 0.0
            try:
                for s in group.samples:
                    f, o, n = s._v
                    if o < lo:
                        lo = o
                    if n > hi:
                        hi = n
                    flags |= f
                    tokens += s.response_length
                    r = s.reward
                    if r is not None:
                        reward_sum += r
                        rewarded += 1
            except AttributeError:
                flags = -1
            if flags == HAS_VERSION and hi <= snap:
                self.sums[id(group)] = (tokens, len(group.samples), reward_sum, rewarded, lo)
                mx = self.max_staleness
                if mx is not None and self.current - lo > mx:  # type: ignore[operator]  # current >= snapshot
                    self.stale_oldest.append(lo)  # type: ignore[arg-type]  # lo is an int with HAS_VERSION
                    self.n_stale += 1
                    return Reason.STALE
                self.kept.append(group)
                self.kept_oldest.append(lo)  # type: ignore[arg-type]
                return Reason.FRESH
            if flags != -1:
                return self._judge(group, lo, hi, flags)
        lo, hi, flags = raw_scan(group)
        return self._judge(group, lo, hi, flags)

    def evidence(self, newest: int) -> None:
        """A version seen outside the judged groups (``DrainWindow.evidence``): raise ``current`` to it.

        Not counted in ``behind``, which counts the judged groups newer than the snapshot.
        """
        if self.current is not None and newest > self.current:
            self._raise_current(newest)

    def _judge(self, group: Group, lo: float, hi: int, flags: int) -> Reason:
        """The rule (``staleness.judge``) on a group whose labels were already scanned into ``(lo, hi, flags)``."""
        if flags & HAS_UNKNOWN or not flags & HAS_VERSION:
            self.unknown_labels += 1
        if self.current is not None and hi > self.snapshot and not self.regressed:  # type: ignore[operator]
            self.behind += 1
            if hi > self.current:
                # Any group's label is evidence of the current version, an aborted group's too.
                self._raise_current(hi)
        if flags & ABORTED:
            self.n_aborted += 1
            return Reason.ABORTED
        versions = GroupVersions(
            oldest=int(lo) if flags & HAS_VERSION else None,
            newest=hi if flags & HAS_VERSION else None,
            unknown=bool(flags & HAS_UNKNOWN),
            labelled=bool(flags & (HAS_VERSION | HAS_UNKNOWN)),
        )
        verdict = judge(
            versions, self.current, max_staleness=self.max_staleness, unknown=self.unknown, regressed=self.regressed
        )
        reason = verdict.reason
        if reason is Reason.STALE and verdict.staleness is None:
            self.n_stale += 1  # the old numbering's label above current: no staleness to measure
        elif reason is Reason.STALE:
            self.stale_oldest.append(versions.oldest)  # type: ignore[arg-type]  # a stale group has an oldest
            self.n_stale += 1
        elif reason is Reason.UNKNOWN_VERSION:
            self.n_unknown += 1
        else:
            self.kept.append(group)
            self.kept_oldest.append(versions.oldest if reason is Reason.FRESH else None)
        return reason

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
        is inlined for speed; every other group goes through ``_judge``, which applies the one rule
        (``staleness.judge``). A property test pins the inlined path to the rule.
        """
        unused: list[Group] = []
        add = self.add
        judge_one = self._judge
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
        sums = self.sums
        for group in groups:
            lo = NO_OLDEST
            hi = NO_NEWEST
            flags = tokens = rewarded = 0
            reward_sum = 0.0
            try:
                for s in group.samples:
                    f, o, n = s._v
                    if o < lo:
                        lo = o
                    if n > hi:
                        hi = n
                    flags |= f
                    tokens += s.response_length
                    r = s.reward
                    if r is not None:
                        reward_sum += r
                        rewarded += 1
            except AttributeError:
                flags = -1
            if flags != HAS_VERSION or hi > snap or group.trajectories or group.status == _ABORTED:
                # Reuse this scan unless the group needs the full one (unscanned, nested or aborted).
                if flags == -1 or group.trajectories or group.status == _ABORTED:
                    reason = add(group)
                else:
                    reason = judge_one(group, lo, hi, flags)
                if reason is not Reason.FRESH and reason is not Reason.UNMEASURED:
                    unused_append(group)
                continue
            sums[id(group)] = (tokens, len(group.samples), reward_sum, rewarded, lo)
            st = self.current - lo  # type: ignore[operator]  # current >= snapshot, not None
            if st > mx:
                stale_append(lo)  # type: ignore[arg-type]  # lo is an int with HAS_VERSION
                n_stale += 1
                unused_append(group)
            else:
                kept_append(group)
                oldest_append(lo)  # type: ignore[arg-type]
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
