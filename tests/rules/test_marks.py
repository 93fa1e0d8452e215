"""The mark rule (``rules.marks``), pure: how far a stored mark may raise the counter."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from tests._builders import updated
from weightbus.rules import TrackerState
from weightbus.rules.history import fold_history
from weightbus.rules.marks import MarkJudge, chain_seen, mark_explained
from weightbus.schemas import CounterHighWater, PublisherClaimed

P = "p"


@dataclass(frozen=True)
class Stored:
    seq: int
    event: object


def mark(version: int, announced: int | None = None, who: str = "t") -> CounterHighWater:
    return CounterHighWater(policy=P, version=version, epoch=0, trainer_id=who, published_at=1.0, announced=announced)


update = partial(updated, policy=P, epoch=0, at=1.0, incarnation="i", reserves_next=True)


def test_a_mark_may_say_at_most_one_above_what_the_chain_has_seen() -> None:
    assert chain_seen(TrackerState()) is None
    state = TrackerState(version=11, epoch=0, publisher="t", incarnation="i", reserved=12)
    assert chain_seen(state) == 12
    assert mark_explained(13, 12) and not mark_explained(14, 12)
    assert mark_explained(10**15, None)  # nothing retained before it: the only record, taken as it is
    assert not mark_explained(5, 12, announced=6)  # announced above its own version: never written by a counter


def test_marks_are_judged_where_they_were_stored() -> None:
    claim = PublisherClaimed(policy=P, epoch=0, trainer_id="t", published_at=1.0, incarnation="i")
    weights = [Stored(1, claim), *(Stored(1 + 2 * v, update(v)) for v in range(1, 12))]
    marks = [Stored(2 * v, mark(v, v - 1)) for v in range(1, 13)] + [Stored(30, mark(1010, 1010, "forger"))]
    folded = fold_history(P, weights, marks=marks)
    assert folded.state.version == 11 and folded.issued == 12
    assert [(u.seq, u.mark.version, u.seen) for u in folded.unexplained_marks] == [(30, 1010, 12)]


def test_a_mark_older_than_every_retained_event_keeps_its_guarantee() -> None:
    rogue = [Stored(100 + i, update(1, trainer="rogue")) for i in range(3)]
    folded = fold_history(P, rogue, marks=[Stored(v, mark(v, v - 1)) for v in range(1, 7)])
    assert folded.state.version == 1 and folded.issued == 6 and folded.mark is not None
    assert folded.mark.announced == 5 and folded.unexplained_marks == []


def test_a_mark_superseded_by_a_lower_one_is_void() -> None:
    judge = MarkJudge(P, [Stored(1, mark(3)), Stored(2, mark(1010, who="forger")), Stored(3, mark(4))])
    judge.settle(TrackerState())
    assert judge.issued == 4
    assert [(u.seq, u.seen) for u in judge.unexplained] == [(2, None)]
    judge.load(P, [Stored(2, mark(1010, who="forger")), Stored(3, mark(4)), Stored(4, mark(5))])
    judge.settle(TrackerState())
    assert judge.issued == 5 and len(judge.unexplained) == 1  # judged once, across reloads
