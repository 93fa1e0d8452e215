"""The window's waste and bias accounts: tokens generated, trained and not trained, where the staleness
came from, and which groups the filter keeps, by response length and by reward.

``DrainWindow`` feeds a ``WasteLedger`` the groups it sees: each admitted group's response tokens as
generated, and each group's fate once (kept, or not kept with its reason), before a recycled group
is reset. Invariants:

* a group's tokens are counted as generated once, at admit, and as trained or not trained once, when
  its fate is known: over a run, ``generated == trained + sum(not_trained) + what is still buffered``;
* a group's known staleness (``current - oldest``) is split into versions in flight (the host's
  ``generated_version`` minus the oldest label, clamped to ``[0, staleness]``) and versions in queue
  (the rest), so the two always add up to the staleness; without ``generated_version`` there is no
  split. Seconds in flight are ``generated_at - started_at``, seconds in queue run from
  ``generated_at`` to the judgement: both only when the host stamped the group;
* the bias buckets are fixed, few and named (``LENGTH_BUCKETS``, ``REWARD_BUCKETS``): labels stay
  low-cardinality. A group's bucket is that of its mean response length and its mean reward
  (``none`` without any reward); an aborted group counts the tokens it had generated when aborted;
* early aborts (the host stopped a group the rule said must be stale) are counted with the tokens
  the abort saved, at most what its unfinished requests could still have generated.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Final

from weightbus.schemas.rollouts import Group

__all__ = ["LENGTH_BUCKETS", "OUTCOMES", "REWARD_BUCKETS", "WasteLedger", "length_bucket", "reward_bucket"]

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


class WasteLedger:
    """One window's token, staleness-split and bias accounts (reset with the window)."""

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
        "by_length",
        "by_reward",
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
        self.by_length: dict[tuple[str, str], int] = {}
        """Groups by ``(outcome, length bucket)``."""
        self.by_reward: dict[tuple[str, str], int] = {}
        """Groups by ``(outcome, reward bucket)``."""

    def admitted(self, group: Group) -> None:
        """A generated group arrives: its response tokens are generated."""
        self.generated += _tokens(group)[0]

    def early_abort(self, tokens_saved: int) -> None:
        """The host aborted a group the rule said must be stale, saving at most ``tokens_saved``."""
        self.early_aborts += 1
        self.saved += max(0, tokens_saved)

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
            now: the judgement's Unix time (seconds in queue run until it); None: no split in seconds.
        """
        tokens, n, length_sum, reward_sum, rewarded = _tokens(group)
        if action == "kept":
            self.trained += tokens
            outcome = "kept"
        else:
            key = (action, reason)
            self.not_trained[key] = self.not_trained.get(key, 0) + tokens
            outcome = "aborted" if reason == "aborted" else action
        lkey = (outcome, length_bucket(length_sum / n) if n else LENGTH_BUCKETS[0])
        self.by_length[lkey] = self.by_length.get(lkey, 0) + 1
        rkey = (outcome, reward_bucket(reward_sum / rewarded if rewarded else None))
        self.by_reward[rkey] = self.by_reward.get(rkey, 0) + 1
        if now is None:
            return
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


def _tokens(group: Group) -> tuple[int, int, int, float, int]:
    """``(tokens, samples, response length sum, reward sum, rewarded samples)`` over every sample."""
    tokens = n = 0
    reward_sum = 0.0
    rewarded = 0
    for s in group.samples:
        tokens += s.response_length
        n += 1
        r = s.reward
        if r is not None:
            reward_sum += r
            rewarded += 1
    for trajectory in group.trajectories:
        for s in trajectory:
            tokens += s.response_length
            n += 1
            r = s.reward
            if r is not None:
                reward_sum += r
                rewarded += 1
    return tokens, n, tokens, reward_sum, rewarded
