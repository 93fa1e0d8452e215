"""The window's token and bias accounts: tokens generated, trained and not trained, and which groups the filter keeps.

A group's tokens count as generated once and as trained or not trained once (``generated == trained + not_trained
+ buffered``); its staleness splits into in flight and in queue, which add up to it; bias buckets are few and fixed.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Final

from weightbus.rules.staleness import raw_scan
from weightbus.schemas.rollouts import ABORTED, HAS_UNKNOWN, HAS_VERSION, Group

__all__ = ["LENGTH_BUCKETS", "OUTCOMES", "REWARD_BUCKETS", "TokenAccounts", "length_bucket", "reward_bucket"]

#: What happened to a group, for the bias accounts: ``aborted`` whatever the stage did with it.
OUTCOMES: Final = ("kept", "recycled", "dropped", "aborted")

_LENGTH_EDGES: Final = (16, 64, 256, 1024, 4096)
#: Response-length buckets (a group's mean response length, in tokens).
LENGTH_BUCKETS: Final = ("0-16", "17-64", "65-256", "257-1024", "1025-4096", "4097+")
_REWARD_EDGES: Final = (0.0, 0.25, 0.5, 0.75, 1.0)
#: Reward buckets (a group's mean reward): upper bounds inclusive; ``none`` for a group without reward.
REWARD_BUCKETS: Final = ("<=0", "0-0.25", "0.25-0.5", "0.5-0.75", "0.75-1", ">1", "none")


def length_bucket(mean_length: float) -> str:
    """The ``LENGTH_BUCKETS`` name of a mean response length."""
    return LENGTH_BUCKETS[bisect_left(_LENGTH_EDGES, mean_length)]


def reward_bucket(mean_reward: float | None) -> str:
    """The ``REWARD_BUCKETS`` name of a mean reward (``none`` for None)."""
    if mean_reward is None:
        return "none"
    return REWARD_BUCKETS[bisect_left(_REWARD_EDGES, mean_reward)]


class TokenAccounts:
    """One window's token, staleness-split and bias accounts (reset with the window).

    Per-group work is a few attribute reads and list increments (the drain's hot path): the bias counts are
    kept as per-outcome lists indexed like ``LENGTH_BUCKETS``/``REWARD_BUCKETS`` and named in ``by_length``
    and ``by_reward``.
    """

    __slots__ = (
        "generated",
        "trained",
        "not_trained",
        "saved",
        "early_aborts",
        "flight_versions",
        "queue_versions",
        "flight_seconds",
        "queue_seconds",
        "_length",
        "_reward",
    )

    def __init__(self) -> None:
        self.generated = 0
        self.trained = 0
        self.not_trained: dict[tuple[str, str], int] = {}
        """Tokens not trained on, by ``(action, reason)``: action ``recycled`` or ``dropped``."""
        self.saved = 0
        self.early_aborts = 0
        self.flight_versions: list[int] = []
        self.queue_versions: list[int] = []
        self.flight_seconds: list[float] = []
        self.queue_seconds: list[float] = []
        self._length: dict[str, list[int]] = {}
        self._reward: dict[str, list[int]] = {}

    @property
    def by_length(self) -> dict[tuple[str, str], int]:
        """Groups by ``(outcome, length bucket)``, the non-zero counts only."""
        return _named(self._length, LENGTH_BUCKETS)

    @property
    def by_reward(self) -> dict[tuple[str, str], int]:
        """Groups by ``(outcome, reward bucket)``, the non-zero counts only."""
        return _named(self._reward, REWARD_BUCKETS)

    def admitted(self, group: Group) -> None:
        """A generated group arrives: its response tokens are generated."""
        tokens = 0
        for s in group.samples:
            tokens += s.response_length
        if group.trajectories:
            tokens += sum(s.response_length for t in group.trajectories for s in t)
        self.generated += tokens

    def early_abort(self, tokens_saved: int) -> None:
        """The host aborted a group the rule said must be stale, saving at most ``tokens_saved``."""
        self.early_aborts += 1
        self.saved += max(0, tokens_saved)

    def _counts(self, outcome: str) -> tuple[list[int], list[int]]:
        lengths = self._length.get(outcome)
        if lengths is None:
            lengths = self._length[outcome] = [0] * len(LENGTH_BUCKETS)
            self._reward[outcome] = [0] * len(REWARD_BUCKETS)
        return lengths, self._reward[outcome]

    def settle_kept(
        self,
        groups: list[Group],
        oldest: list[int | None],
        current: int | None,
        now: float,
        sums: dict[int, tuple[int, int, float, int, float]] | None = None,
    ) -> None:
        """The groups a judgement kept (``oldest`` parallel to ``groups``), judged against ``current`` at ``now``.

        ``sums`` holds what the tally already summed per group (``DrainTally.sums``); others are summed here.
        """
        if not groups:
            return
        lengths, rewards = self._counts("kept")
        trained = 0
        no_reward = _NO_REWARD
        length_edges, reward_edges = _LENGTH_EDGES, _REWARD_EDGES
        get = (sums or {}).get
        for group, lo in zip(groups, oldest):  # noqa: B905  # parallel lists of one tally: equal by construction
            w = get(id(group))
            if w is None:
                tokens, n, reward_sum, rewarded = _tokens(group)
            else:
                tokens, n, reward_sum, rewarded, _ = w
            trained += tokens
            lengths[bisect_left(length_edges, tokens / n) if n else 0] += 1
            rewards[bisect_left(reward_edges, reward_sum / rewarded) if rewarded else no_reward] += 1
            if group.generated_at is not None or group.generated_version is not None:
                self._split(group, lo, current, now)
        self.trained += trained

    def settle_judged(
        self,
        group: Group,
        action: str,
        reason: str | None,
        strict: bool,
        current: int | None,
        now: float,
        sums: dict[int, tuple[int, int, float, int, float]] | None = None,
    ) -> str:
        """A judged group not kept (``action``: recycled or dropped); call before a reset.

        Args:
            reason: the rule's reason, or None to derive it from the group's labels (aborted, then
                unknown_version, then stale: the rule's order); a group in ``sums`` went through the
                tally's inlined path (flat, numeric, not aborted), so not kept there means stale.

        Returns:
            The reason counted.
        """
        w = sums.get(id(group)) if sums else None
        if w is not None:
            tokens, n, reward_sum, rewarded, lo = w
            oldest: int | None = int(lo)
            if reason is None:
                reason = "stale"
        else:
            lo, _, flags = raw_scan(group)
            oldest = int(lo) if flags & HAS_VERSION else None
            if reason is None:
                reason = _reason(flags, strict)
            tokens, n, reward_sum, rewarded = _tokens(group)
        key = (action, reason)
        self.not_trained[key] = self.not_trained.get(key, 0) + tokens
        lengths, rewards = self._counts("aborted" if reason == "aborted" else action)
        lengths[bisect_left(_LENGTH_EDGES, tokens / n) if n else 0] += 1
        rewards[bisect_left(_REWARD_EDGES, reward_sum / rewarded) if rewarded else _NO_REWARD] += 1
        if group.generated_at is not None or group.generated_version is not None:
            self._split(group, oldest, current, now)
        return reason

    def settle(
        self,
        group: Group,
        action: str,
        reason: str,
        *,
        oldest: int | None = None,
        current: int | None = None,
        now: float | None = None,
    ) -> None:
        """A group's fate: ``action`` (kept, recycled, dropped) for ``reason``; call before a reset.

        Args:
            oldest, current: the group's oldest version and the version it was judged against, when the
                group was judged (its staleness is split); None for groups refused before any judgement.
            now: the judgement's Unix time (seconds in queue run until it); None: no split at all.
        """
        tokens, n, reward_sum, rewarded = _tokens(group)
        if action == "kept":
            self.trained += tokens
            outcome = "kept"
        else:
            key = (action, reason)
            self.not_trained[key] = self.not_trained.get(key, 0) + tokens
            outcome = "aborted" if reason == "aborted" else action
        lengths, rewards = self._counts(outcome)
        lengths[bisect_left(_LENGTH_EDGES, tokens / n) if n else 0] += 1
        rewards[bisect_left(_REWARD_EDGES, reward_sum / rewarded) if rewarded else _NO_REWARD] += 1
        if now is not None:
            self._split(group, oldest, current, now)

    def _split(self, group: Group, oldest: int | None, current: int | None, now: float) -> None:
        if oldest is not None and current is not None:
            gv = group.generated_version
            if gv is not None:
                s = current - oldest if current > oldest else 0
                flight = gv - oldest if gv > oldest else 0
                if flight > s:
                    flight = s
                self.flight_versions.append(flight)
                self.queue_versions.append(s - flight)
        done = group.generated_at
        if done is not None:
            started = group.started_at
            if started is not None:
                self.flight_seconds.append(done - started if done > started else 0.0)
            self.queue_seconds.append(now - done if now > done else 0.0)

    def tokens_not_trained_by_reason(self) -> dict[str, int]:
        """``not_trained`` summed over actions, by reason."""
        out: dict[str, int] = {}
        for (_, reason), n in self.not_trained.items():
            out[reason] = out.get(reason, 0) + n
        return out


_NO_REWARD: Final = REWARD_BUCKETS.index("none")


def _reason(flags: int, strict: bool) -> str:
    """The rule's reason for a group not kept, from its scan's flags: aborted, then unknown, then stale."""
    if flags & ABORTED:
        return "aborted"
    if strict and (flags & HAS_UNKNOWN or not flags & HAS_VERSION):
        return "unknown_version"
    return "stale"


def _named(counts: dict[str, list[int]], names: tuple[str, ...]) -> dict[tuple[str, str], int]:
    return {(outcome, names[i]): n for outcome, row in counts.items() for i, n in enumerate(row) if n}


def _tokens(group: Group) -> tuple[int, int, float, int]:
    """``(tokens, samples, reward sum, rewarded samples)`` over every sample, nested ones too."""
    tokens = n = rewarded = 0
    reward_sum = 0.0
    for s in group.iter_samples():
        tokens += s.response_length
        n += 1
        r = s.reward
        if r is not None:
            reward_sum += r
            rewarded += 1
    return tokens, n, reward_sum, rewarded
