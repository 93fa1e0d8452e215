"""The re-claim rule: a fenced publisher claims again only where the host's failover order put it above the owner."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import pytest

from tests._builders import updated
from weightbus.rules.standing import outranks, owner_claim, owner_standing
from weightbus.schemas import MAX_VERSION, ClaimStanding, CounterHighWater, PublisherClaimed, WeightUpdated

JOB = "ray-job:01000000"


def at(term: int, rank: int, scope: str = JOB) -> ClaimStanding:
    return ClaimStanding(scope=scope, term=term, rank=rank)


@dataclass(frozen=True)
class Stored:
    seq: int | None
    event: object


def claim(epoch: int, trainer: str, standing: ClaimStanding | None, *, version: int | None = None) -> PublisherClaimed:
    return PublisherClaimed(
        policy="p",
        epoch=epoch,
        trainer_id=trainer,
        published_at=float(epoch),
        version=version,
        incarnation=f"{trainer}-{epoch}",
        standing=standing,
    )


def update(version: int, epoch: int, trainer: str) -> WeightUpdated:
    return updated(version, epoch=epoch, trainer=trainer, at=float(version), incarnation=f"{trainer}-{epoch}")


@pytest.mark.parametrize(
    ("claimant", "owner", "expected"),
    [
        (at(0, 1), at(0, 0), True),  # miles' retry moved to the next alive cell of the same quorum
        (at(1, 0), at(0, 1), True),  # a later quorum, whatever the rank
        (at(0, 0), at(0, 1), False),  # the zombie: frozen where miles left it, below the one picked after it
        (at(0, 1), at(0, 1), False),  # equal: not after the owner
        (at(3, 0), at(0, 0, scope="ray-job:02000000"), False),  # another driver's job: no order between them
        (None, at(0, 0), False),  # the host does not say: doubt keeps the fence
        (at(5, 5), None, False),  # the owner claimed without a standing
    ],
)
def test_outranks_only_a_strictly_later_pick_of_the_same_job(
    claimant: ClaimStanding | None, owner: ClaimStanding | None, expected: bool
) -> None:
    assert outranks(claimant, owner) is expected


def test_the_owner_standing_is_read_from_the_owners_claim_not_the_last_one() -> None:
    events = [
        Stored(1, claim(1, "cell0", at(0, 0))),
        Stored(2, update(1, 1, "cell0")),
        Stored(3, claim(2, "cell1", at(0, 1), version=1)),
        Stored(4, update(2, 2, "cell1")),
    ]
    assert owner_claim("p", events) == events[2].event
    assert owner_standing("p", events) == at(0, 1)


def test_once_the_claim_is_evicted_the_owners_mark_says_its_standing_and_another_writers_mark_does_not() -> None:
    events = [Stored(10, update(7, 2, "cell1")), Stored(11, update(8, 2, "cell1"))]
    mark = CounterHighWater(
        policy="p", version=9, epoch=2, trainer_id="cell1", published_at=8.0, incarnation="cell1-2", standing=at(0, 1)
    )
    assert owner_claim("p", events) is None
    assert owner_standing("p", events, marks=[Stored(12, mark)]) == at(0, 1)
    stale = CounterHighWater(
        policy="p", version=9, epoch=1, trainer_id="cell0", published_at=8.0, incarnation="cell0-1", standing=at(4, 0)
    )
    assert owner_standing("p", events, marks=[Stored(12, stale)]) is None  # not the owner's: doubt keeps the fence
    assert owner_standing("p", events) is None


def test_a_forged_mark_in_the_owners_name_says_nothing_of_its_standing() -> None:
    """A mark the mark rule refuses (``rules.marks``: more than the chain explains) is not the owner's standing.

    The forger copies the owner's identity onto a mark with a low standing, so that a zombie above it
    but below the owner would claim again if that mark counted.
    """
    events = [Stored(10, update(7, 2, "cell1")), Stored(11, update(8, 2, "cell1"))]
    real = CounterHighWater(
        policy="p", version=9, epoch=2, trainer_id="cell1", published_at=8.0, incarnation="cell1-2", standing=at(3, 0)
    )
    forged = msgspec.structs.replace(real, version=MAX_VERSION, standing=at(0, 0))
    marks = [Stored(12, real), Stored(13, forged)]
    owner = owner_standing("p", events, marks=marks)
    assert owner == at(3, 0)
    assert not outranks(at(1, 0), owner)  # the zombie stays fenced
    assert owner_standing("p", events, marks=[Stored(13, forged)]) is None  # only the forged one: unknown
