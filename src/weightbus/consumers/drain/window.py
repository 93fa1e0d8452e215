"""The drain engine: one window of judgements, the same for every host (our buffer, ``judge_groups``, miles).

A window is miles' metrics window, closed by ``finish`` (one ``DrainStats``, Prometheus update and ``DrainReport``).
Evidence only goes forward; a group not kept is routed once and frees its slot as it is routed; ``close``'s groups are
the host's for good; ``abandon`` hands back the kept ones in order; each group goes to the ``TokenAccounts`` once.
See docs/design.md#the-drain.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Final, Protocol, TypedDict

from weightbus.consumers.drain.accounts import TokenAccounts
from weightbus.consumers.drain.decisions import Action, DrainStats
from weightbus.consumers.drain.tally import DrainTally
from weightbus.rules.staleness import Reason, raw_scan
from weightbus.schemas.rollouts import HAS_VERSION, Group, SampleStatus

if TYPE_CHECKING:
    from weightbus.consumers.drain.metrics import DrainMetrics
    from weightbus.consumers.drain.reports import DrainReporter
    from weightbus.rules.staleness import UnknownPolicy

__all__ = ["VERSION_STATES", "DrainWindow", "HeldSlots", "JudgementConfig"]

#: ``DrainStats.version_state`` values from the most trusted to the least: a window that judged
#: against several says the least trusted one.
VERSION_STATES: Final = ("current", "never_published", "given", "regressed")
_RANK: Final = {state: i for i, state in enumerate(VERSION_STATES)}


class HeldSlots(Protocol):
    """The host's admission accounting, as the window settles it (``consumers.admission.AcceptedGroups``)."""

    def unused(self, group: Group) -> None: ...

    def kept(self, groups: Iterable[Group], at: int | None) -> None: ...


class JudgementConfig(Protocol):
    """What a window reads of its configuration (``StalenessStage`` is one): the bound, the unknown-label
    policy, the action for groups not kept, and the metrics."""

    @property
    def max_staleness(self) -> int | None: ...

    @property
    def unknown(self) -> UnknownPolicy: ...

    @property
    def unused_action(self) -> Action: ...

    @property
    def metrics(self) -> DrainMetrics | None: ...


class DrainWindow:
    """The drain engine of one host: evidence, the window's counts, routing, metrics and reports.

    Args:
        stage: the staleness configuration (bound, ``on_stale``, unknown-label policy, metrics).
        on_unused: called with each group not kept (aborted at ``admit``, stale, unknown version,
            evicted), after it was counted; the host recycles or drops it. None: only counted.
        reporter: gets each finished window's ``DrainStats`` (``DrainReporter.submit``); None for none.
    """

    __slots__ = (
        "stage",
        "reporter",
        "last_current",
        "_on_unused",
        "_recycles",
        "_held",
        "_newest",
        "_current",
        "_tracker_current",
        "_state",
        "_fresh",
        "_unmeasured",
        "_reasons",
        "_filtered",
        "_values",
        "_recycled",
        "_dropped",
        "_behind",
        "_unknown_labels",
        "_accounts",
        "_slots",
    )

    def __init__(
        self,
        stage: JudgementConfig,
        *,
        on_unused: Callable[[Group], None] | None = None,
        reporter: DrainReporter | None = None,
        slots: HeldSlots | None = None,
    ) -> None:
        self.stage = stage
        self._slots = slots
        self.reporter = reporter
        self.last_current: int | None = None
        """The last version a window judged against (the buffer's staleness is measured against it)."""
        self._on_unused = on_unused
        self._recycles = stage.unused_action is Action.RECYCLED
        self._held: int | None = None  # newest label of a group refused at admit: kept for good
        self._reset(None)

    def _reset(self, newest: int | None) -> None:
        self._newest = newest
        self._current: int | None = None
        self._tracker_current: int | None = None
        self._state: str | None = None
        self._fresh = 0
        self._unmeasured = 0
        self._reasons: dict[str, int] = {}
        self._filtered: dict[str, int] = {}
        self._values: list[int] = []
        self._recycled = 0
        self._dropped = 0
        self._behind = 0
        self._unknown_labels = 0
        self._accounts = TokenAccounts()

    @property
    def evidence(self) -> int | None:
        """The newest version seen (see the module); a judgement's current is raised to it."""
        held, newest = self._held, self._newest
        if held is None:
            return newest
        return held if newest is None or held > newest else newest

    # -- the put side ----------------------------------------------------------------------------

    def admit(self, group: Group) -> bool:
        """A generated group arrives: note its labels; an aborted group is refused and routed.

        Returns:
            True if the host may buffer the group (it is not aborted).
        """
        _, hi, flags = raw_scan(group)
        if flags & HAS_VERSION:
            self._see(hi)
        self._accounts.admitted(group)
        if not group.is_aborted:
            return True
        if flags & HAS_VERSION and (self._held is None or hi > self._held):
            self._held = hi
        self._count(Reason.ABORTED, 1)
        self._route(group, Reason.ABORTED, judged=False)
        return False

    def filtered(self, reason: str, group: Group | None = None) -> None:
        """The host's dynamic filter rejected an admitted group: dropped, counted by ``reason``.

        An empty ``reason`` is counted as ``filtered`` but gets no ``rollout/dynamic_filter/drop_*``
        key (miles skips reason-less drops). ``group``, when given, has its tokens counted as not trained.
        """
        self._filtered[reason] = self._filtered.get(reason, 0) + 1
        self._dropped += 1
        if group is not None:
            self._accounts.settle(group, Action.DROPPED.value, Reason.FILTERED.value)
            if self._slots is not None:
                self._slots.unused(group)

    def early_abort(self, group: Group, tokens_saved: int) -> None:
        """The host aborted ``group`` while it was generating because it had to be stale (``rules.abort``).

        The group is marked aborted and goes through ``admit`` (its tokens generated, not trained, reason
        ``aborted``; routed to ``on_unused``); ``tokens_saved`` is at most what its unfinished requests
        could still have generated.
        """
        self._accounts.early_abort(tokens_saved)
        group.status = SampleStatus.ABORTED
        self.admit(group)

    # -- judging ---------------------------------------------------------------------------------

    def begin(self, current: int | None, version_state: str = "given") -> DrainTally:
        """Open one judgement against ``current``, raised to the evidence (unless ``current`` is None).

        Args:
            current: the version read once for this judgement; None turns the filter off.
            version_state: where ``current`` came from (``VERSION_STATES``).
        """
        stage = self.stage
        # "regressed": the host's version went backwards with no bus version; the evidence is the old
        # numbering's and must not raise current (rules.staleness judges its labels stale instead).
        regressed = version_state == "regressed"
        t = DrainTally(current, stage.max_staleness, stage.unknown, regressed=regressed)
        if current is not None and not regressed:
            evidence = self.evidence
            if evidence is not None and evidence > current:
                t.evidence(evidence)
        self._tracker_current = current
        if self._state is None or _RANK.get(version_state, len(_RANK)) > _RANK.get(self._state, len(_RANK)):
            self._state = version_state
        return t

    def take(self, t: DrainTally, group: Group) -> bool:
        """Judge one taken group; route it unless kept (and any kept group it made stale).

        Returns:
            True if the group was kept (it is in ``t.kept``).
        """
        newest = self._newest
        if newest is not None and t.current is not None and newest > t.current and not t.regressed:
            t.evidence(newest)  # admitted while this judgement waited (an aborted group's label, say)
        reason = t.add(group)
        kept = reason is Reason.FRESH or reason is Reason.UNMEASURED
        if not kept:
            self._route(group, reason, current=t.current, sums=t.sums)
        if t.evicted:
            for evicted in t.evicted:
                self._route(evicted, Reason.STALE, current=t.current, sums=t.sums)
            t.evicted.clear()
        return kept

    def take_many(self, t: DrainTally, groups: Iterable[Group]) -> list[Group]:
        """``take`` over a batch (``DrainTally.add_many``, its inlined fast path); returns the unused, routed."""
        unused = t.add_many(groups)
        unused.extend(t.evicted)
        t.evicted.clear()
        if unused:
            now = time.time()
            strict = t.strict
            for group in unused:
                self._route(group, None, current=t.current, now=now, strict=strict, sums=t.sums)
        return unused

    def close(self, t: DrainTally) -> list[Group]:
        """A judgement is done: its counts join the window; returns its kept groups, now the host's."""
        self._values.extend(t.staleness_values())
        fresh, unmeasured = t.kept_counts()
        self._fresh += fresh
        self._unmeasured += unmeasured
        self._merge(t)
        self._behind += t.behind
        self._unknown_labels += t.unknown_labels
        self._accounts.settle_kept(t.kept, t.kept_oldest, t.current, time.time(), t.sums)
        if self._slots is not None:
            self._slots.kept(t.kept, t.current)
        if t.current is not None:
            self._see(t.current)
            if self._current is None or t.current > self._current:
                self._current = t.current
        return t.kept

    def abandon(self, t: DrainTally) -> list[Group]:
        """A judgement failed or was cancelled: returns every group it kept, in take order, for the host
        to put back at its head; the groups it filtered stay counted in the window."""
        self._merge(t)
        if t.current is not None:
            self._values.extend(t.current - lo for lo in t.stale_oldest)
            self._see(t.current)
        kept = list(t.kept)
        t.kept.clear()
        t.kept_oldest.clear()
        t.stale_oldest.clear()
        t.n_stale = t.n_unknown = t.n_aborted = 0
        return kept

    def finish(self, held: Iterable[Group] | None = None, *, version_state: str = "given") -> DrainStats:
        """Close the window: its statistics, one metrics update, one report.

        Args:
            held: the groups the host still buffers (their staleness against ``last_current``, and
                their labels as the next window's evidence); None for a host without a buffer (the
                buffer gauges are left alone).
            version_state: the state reported by a window without any judgement.
        """
        current = self._current
        if current is not None:
            self.last_current = current
        last = self.last_current
        newest: int | None = None
        staleness: list[int] = []
        queue_size = 0
        for group in held or ():
            queue_size += 1
            lo, hi, flags = raw_scan(group)
            if flags & HAS_VERSION:
                if last is not None:
                    staleness.append(last - int(lo))
                if newest is None or hi > newest:
                    newest = hi
        buf_avg = sum(staleness) / len(staleness) if staleness else None
        buf_max = max(staleness) if staleness else None
        reasons = dict(self._reasons)
        n_filtered = sum(self._filtered.values())
        if n_filtered:
            reasons[Reason.FILTERED.value] = n_filtered
        values = self._values
        stats = DrainStats(
            current=current,
            tracker_current=self._tracker_current,
            kept=self._fresh + self._unmeasured,
            recycled=self._recycled,
            dropped=self._dropped,
            reasons=reasons,
            staleness_avg=sum(values) / len(values) if values else None,
            staleness_max=max(values) if values else None,
            staleness_count=len(values),
            tracker_behind=self._behind,
            unknown_label_groups=self._unknown_labels,
            queue_size=queue_size,
            buffer_avg_staleness=buf_avg,
            buffer_max_staleness=buf_max,
            dynamic_filter=dict(self._filtered),
            version_state=self._state or version_state,
            **_accounts_fields(self._accounts),
        )
        self._record(stats, n_filtered, buffered=held is not None)
        if self.stage.metrics is not None:
            self.stage.metrics.record_accounts(self._accounts)
        if self.reporter is not None:
            self.reporter.submit(stats)
        self._reset(newest)
        return stats

    # -- internals -------------------------------------------------------------------------------

    def _see(self, version: int) -> None:
        if self._newest is None or version > self._newest:
            self._newest = version

    def _count(self, reason: Reason, n: int) -> None:
        if n:
            self._reasons[reason.value] = self._reasons.get(reason.value, 0) + n

    def _merge(self, t: DrainTally) -> None:
        self._count(Reason.STALE, t.n_stale)
        self._count(Reason.UNKNOWN_VERSION, t.n_unknown)
        self._count(Reason.ABORTED, t.n_aborted)

    def _route(
        self,
        group: Group,
        reason: Reason | None,
        *,
        current: int | None = None,
        judged: bool = True,
        now: float | None = None,
        strict: bool = True,
        sums: dict[int, tuple[int, int, float, int, float]] | None = None,
    ) -> None:
        """Count and hand on a group not kept; ``reason`` None: derived from its labels, in the rule's order."""
        if self._recycles:
            self._recycled += 1
        else:
            self._dropped += 1
        # Settled before on_unused: a recycled group is reset there, and its tokens with it.
        action = self.stage.unused_action.value
        if judged:
            when = time.time() if now is None else now
            self._accounts.settle_judged(
                group, action, None if reason is None else reason.value, strict, current, when, sums
            )
        else:
            self._accounts.settle(group, action, reason.value if reason is not None else Reason.ABORTED.value)
        if self._slots is not None:
            self._slots.unused(group)
        if self._on_unused is not None:
            self._on_unused(group)

    def _record(self, stats: DrainStats, n_filtered: int, *, buffered: bool) -> None:
        m = self.stage.metrics
        if m is None:
            return
        m.count_groups(Action.KEPT, Reason.FRESH, self._fresh)
        m.count_groups(Action.KEPT, Reason.UNMEASURED, self._unmeasured)
        unused = self.stage.unused_action.value
        for reason in (Reason.STALE, Reason.UNKNOWN_VERSION, Reason.ABORTED):
            m.count_groups(unused, reason, self._reasons.get(reason.value, 0))
        m.count_groups(Action.DROPPED, Reason.FILTERED, n_filtered)
        m.observe_staleness(self._values)
        m.tracker_behind(self._behind)
        m.set_current(stats.current)
        if buffered:
            m.set_buffer(stats.queue_size, stats.buffer_avg_staleness, stats.buffer_max_staleness)


def _mean(values: list[int] | list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _nest(counts: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for (outcome, bucket), n in counts.items():
        out.setdefault(outcome, {})[bucket] = n
    return out


class _LedgerFields(TypedDict):
    """The ``DrainStats`` fields the waste accounts fills (their types are ``DrainStats``'s)."""

    tokens_generated: int
    tokens_trained: int
    tokens_not_trained: dict[str, int]
    early_aborts: int
    tokens_saved: int
    in_flight_versions_avg: float | None
    in_queue_versions_avg: float | None
    in_flight_s_avg: float | None
    in_queue_s_avg: float | None
    by_length: dict[str, dict[str, int]]
    by_reward: dict[str, dict[str, int]]


def _accounts_fields(accounts: TokenAccounts) -> _LedgerFields:
    return {
        "tokens_generated": accounts.generated,
        "tokens_trained": accounts.trained,
        "tokens_not_trained": accounts.tokens_not_trained_by_reason(),
        "early_aborts": accounts.early_aborts,
        "tokens_saved": accounts.saved,
        "in_flight_versions_avg": _mean(accounts.flight_versions),
        "in_queue_versions_avg": _mean(accounts.queue_versions),
        "in_flight_s_avg": _mean(accounts.flight_seconds),
        "in_queue_s_avg": _mean(accounts.queue_seconds),
        "by_length": _nest(accounts.by_length),
        "by_reward": _nest(accounts.by_reward),
    }
