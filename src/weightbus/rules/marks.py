"""How far the counter's high-water mark may raise the counter: the one rule the trainer, trackers and status share.

A mark counts only as far as the weights chain explains it where it was stored (at most one above the highest number
seen then); one stored before every retained event is taken as it is. Why: docs/operations.md#counter-mark-validation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from weightbus.rules.chain import TrackerState
from weightbus.schemas.alerts import VersionRejected
from weightbus.schemas.weights import CounterHighWater

__all__ = [
    "MarkJudge",
    "UnexplainedMark",
    "chain_seen",
    "mark_explained",
    "unexplained_mark_alert",
    "unexplained_mark_alert_id",
]


@dataclass(frozen=True, slots=True)
class UnexplainedMark:
    """A stored mark the rule refused: where it is, what it said, and what the chain explained then.

    Attributes:
        seq: its stream sequence on the counter subject.
        mark: the mark.
        seen: the highest number the chain had seen when it was judged (None: superseded by a lower mark).
        held: the version the chain held then.
    """

    seq: int | None
    mark: CounterHighWater
    seen: int | None
    held: int | None


def chain_seen(state: TrackerState) -> int | None:
    """The highest number ``state`` has seen (held or reserved); None while it has no owner (nothing retained)."""
    if not state.has_owner:
        return None
    return max(state.reserved or 0, state.version or 0)


def mark_explained(version: int, seen: int | None, announced: int | None = None) -> bool:
    """Whether a mark of ``version`` (and ``announced``) is explained by a chain that has seen ``seen``.

    ``seen`` None: no event of the chain precedes the mark, which is then credited as it is.
    """
    if announced is not None and announced > version:
        return False
    return seen is None or version <= seen + 1


def unexplained_mark_alert_id(policy: str, seq: int | None) -> str:
    """The message id of the alert for the unexplained mark at ``seq``: one alert, whoever reports it first."""
    return f"{policy}:alert:unexplained_mark:{seq}"


def unexplained_mark_alert(
    policy: str, refused: UnexplainedMark, *, observer: str, published_at: float
) -> VersionRejected:
    """The ``VersionRejected`` alert for ``refused``: the same event whoever reports it (trainer or tracker)."""
    mark = refused.mark
    return VersionRejected(
        policy=policy,
        reason="unexplained_mark",
        event_type="CounterHighWater",
        current=refused.held,
        incoming=mark.version,
        incoming_epoch=mark.epoch,
        publisher=mark.trainer_id,
        observer=observer,
        published_at=published_at,
        event_seq=refused.seq,
    )


class MarkJudge:
    """Judges one policy's retained marks in stream order against the chain folded up to each.

    Feed it the marks once (oldest first, any stored events: those that are not a mark of
    ``policy`` are ignored), then, while folding the weights events in stream order, call
    ``before(seq, state)`` before each event and ``settle(state)`` at the end.

    Args:
        policy: the policy id.
        stored: the counter subject's retained events (``seq`` and ``event``), oldest first.
        after: only marks stored after this sequence are judged (the ones judged before are kept).
    """

    __slots__ = ("_credited", "_pending", "last_judged", "mark_seq", "unexplained")

    def __init__(self, policy: str, stored: Iterable[object] = (), *, after: int | None = None) -> None:
        self._credited: CounterHighWater | None = None
        self.mark_seq: int | None = None
        """The stream sequence of the credited mark."""
        self.unexplained: list[UnexplainedMark] = []
        """Every mark refused so far, in the order judged."""
        self.last_judged: int | None = after
        """The sequence of the newest mark judged."""
        self._pending: deque[tuple[int | None, CounterHighWater]] = deque()
        self.load(policy, stored)

    def load(self, policy: str, stored: Iterable[object]) -> None:
        """Add the marks of ``stored`` (oldest first) not judged yet; void the ones a lower mark superseded."""
        self._pending = deque()  # a reload re-reads what was not judged yet
        marks: list[tuple[int | None, CounterHighWater]] = []
        for env in stored:
            seq = getattr(env, "seq", None)
            event = getattr(env, "event", None)
            if not isinstance(event, CounterHighWater) or event.policy != policy:
                continue
            marks.append((seq, event))
        lowest: int | None = None
        voided: set[int] = set()
        for i in range(len(marks) - 1, -1, -1):  # newest first: a mark above a later one is superseded
            version = marks[i][1].version
            if lowest is not None and version > lowest:
                voided.add(i)
            lowest = version if lowest is None else min(lowest, version)
        for i, (seq, mark) in enumerate(marks):
            if self.last_judged is not None and seq is not None and seq <= self.last_judged:
                continue
            if i in voided:
                self._refuse(seq, mark, None, None)
            else:
                self._pending.append((seq, mark))

    @property
    def mark(self) -> CounterHighWater | None:
        """The credited mark: the highest explained one (None: none)."""
        return self._credited

    @property
    def issued(self) -> int | None:
        """The credited mark's version: every number up to it was issued (None: no credited mark)."""
        credited = self._credited
        return None if credited is None else credited.version

    @property
    def announced(self) -> int | None:
        """The credited mark's ``announced`` (None: none)."""
        credited = self._credited
        return None if credited is None else credited.announced

    @property
    def pending(self) -> bool:
        """Whether marks wait to be judged."""
        return bool(self._pending)

    def before(self, seq: int | None, state: TrackerState) -> int:
        """Judge every pending mark stored before ``seq`` against ``state`` (the chain before that event).

        Returns:
            How many marks were refused by this call (they are appended to ``unexplained``).
        """
        pending = self._pending
        if not pending or seq is None or (pending[0][0] is not None and pending[0][0] > seq):
            return 0
        refused = len(self.unexplained)
        while pending and (pending[0][0] is None or pending[0][0] < seq):
            self._judge(*pending.popleft(), state)
        return len(self.unexplained) - refused

    def settle(self, state: TrackerState) -> int:
        """Judge every mark still pending against ``state`` (the end of the history); how many were refused."""
        refused = len(self.unexplained)
        while self._pending:
            self._judge(*self._pending.popleft(), state)
        return len(self.unexplained) - refused

    def _judge(self, seq: int | None, mark: CounterHighWater, state: TrackerState) -> None:
        seen = chain_seen(state)
        if seq is not None:
            self.last_judged = seq if self.last_judged is None else max(self.last_judged, seq)
        if not mark_explained(mark.version, seen, mark.announced):
            self._refuse(seq, mark, seen, state.version)
            return
        credited = self._credited
        if credited is None or mark.version >= credited.version:
            self._credited, self.mark_seq = mark, seq

    def _refuse(self, seq: int | None, mark: CounterHighWater, seen: int | None, held: int | None) -> None:
        if seq is not None:
            self.last_judged = seq if self.last_judged is None else max(self.last_judged, seq)
        self.unexplained.append(UnexplainedMark(seq, mark, seen, held))
