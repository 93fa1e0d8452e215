"""The pure version rule: every branch of ``decide``, without a bus."""

from __future__ import annotations

from functools import partial

import pytest

from tests._builders import updated
from weightbus.rules.chain import RegressionMode, TrackerAction, TrackerState, decide
from weightbus.schemas import PublisherClaimed, VersionReserved

upd = partial(updated, trainer="a", at=100.0)


def claim(
    version: int | None,
    *,
    epoch: int = 2,
    trainer: str = "b",
    inc: str = "",
    previous: str | None = "a",
    reserved: int | None = None,
) -> PublisherClaimed:
    return PublisherClaimed(
        policy="p",
        epoch=epoch,
        trainer_id=trainer,
        published_at=200.0,
        version=version,
        incarnation=inc,
        previous_trainer_id=previous,
        reserved=reserved,
    )


def reserve(version: int, *, epoch: int = 1, trainer: str = "a", inc: str = "") -> VersionReserved:
    return VersionReserved(
        policy="p", version=version, epoch=epoch, trainer_id=trainer, published_at=1.0, incarnation=inc
    )


HELD57 = TrackerState(version=57, epoch=1, publisher="a", updated_at=50.0, incarnation="", reserved=57)


def test_first_update_is_adopted_even_at_version_zero() -> None:
    d = decide(TrackerState(), upd(0, at=10.0))
    assert d.action is TrackerAction.ADOPTED
    assert d.state == TrackerState(
        version=0, epoch=1, publisher="a", updated_at=10.0, incarnation="", reserved=0, announced_since=0
    )
    assert d.changed and d.is_update and not d.is_regression


def test_higher_version_advances_in_the_same_epoch() -> None:
    d = decide(HELD57, upd(58, at=60.0))
    assert d.action is TrackerAction.ADVANCED
    assert (d.state.version, d.state.updated_at) == (58, 60.0)
    assert d.previous is HELD57


def test_takeover_with_higher_version_after_its_claim_is_not_a_regression() -> None:
    claimed = decide(HELD57, claim(57, epoch=3, trainer="b", inc="x")).state
    d = decide(claimed, upd(58, epoch=3, trainer="b", incarnation="x"))
    assert d.action is TrackerAction.ADVANCED
    assert (d.state.version, d.state.epoch, d.state.publisher) == (58, 3, "b")
    assert not d.is_regression and d.reason is None


def test_an_update_from_anyone_but_the_owner_is_rejected() -> None:
    # A new epoch that never claimed, a zombie of an older epoch, and a twin with the same trainer id.
    for event in (upd(58, epoch=3, trainer="b"), upd(58, epoch=0), upd(58, incarnation="twin")):
        d = decide(HELD57, event)
        assert (d.action, d.reason, d.state) == (TrackerAction.REJECTED, "not_owner", HELD57)
        assert d.alert and not d.changed


def test_equal_version_from_the_owner_changes_nothing() -> None:
    d = decide(HELD57, upd(57, at=99.0))
    assert d.action is TrackerAction.REPEATED
    assert d.state == HELD57
    assert not d.changed and not d.is_update and not d.is_regression


def test_a_jump_that_nothing_explains_is_held() -> None:
    d = decide(HELD57, upd(2**52))
    assert (d.action, d.reason, d.state.version) == (TrackerAction.REJECTED, "unexplained_jump", 57)
    # A reservation far ahead is refused too; one reserved number explains the update that follows it.
    assert decide(HELD57, reserve(10**6)).reason == "unexplained_jump"
    r1 = decide(HELD57, reserve(58)).state
    r2 = decide(r1, reserve(59)).state
    d = decide(r2, upd(59))
    assert (d.action, d.state.version) == (TrackerAction.ADVANCED, 59)


def test_reservations_never_move_the_version_and_must_come_from_the_owner() -> None:
    d = decide(HELD57, reserve(58))
    assert (d.action, d.state.version, d.state.reserved) == (TrackerAction.RESERVED, 57, 58)
    assert decide(HELD57, reserve(58, epoch=0, trainer="zombie")).reason == "not_owner"


def test_an_announcement_that_reserves_the_next_number_explains_the_reservation_after_it() -> None:
    ahead = upd(58, at=60.0, reserves_next=True)
    state = decide(HELD57, ahead).state
    assert (state.version, state.reserved) == (58, 59)
    # Update 59 failed (its number was reserved by the announcement): the next one reserves 60.
    assert decide(state, reserve(60)).action is TrackerAction.RESERVED
    # Without reserves_next, 60 would be two above everything seen.
    plain = decide(HELD57, upd(58, at=60.0)).state
    assert decide(plain, reserve(60)).reason == "unexplained_jump"
    # Only the owner's accepted announcement reserves: a rejected one changes nothing.
    rogue = upd(58, trainer="z", at=60.0, reserves_next=True)
    assert decide(HELD57, rogue).state == HELD57


def test_reserving_ahead_stops_at_the_largest_exact_version() -> None:
    top = 2**53 - 1
    held = TrackerState(version=top - 1, epoch=1, publisher="a", updated_at=1.0, incarnation="", reserved=top - 1)
    last = upd(top, at=2.0, reserves_next=True)
    assert decide(held, last).state.reserved == top


def test_claims_must_supersede_the_owner() -> None:
    stale = decide(HELD57, claim(57, epoch=1, trainer="z", inc="z"))
    assert (stale.action, stale.reason) == (TrackerAction.REJECTED, "stale_claim")
    # A claimant that found no history at all (lost stream) is accepted, and its lower counter is a reset.
    lost = decide(HELD57, claim(3, epoch=0, trainer="n", previous=None))
    assert (lost.action, lost.reason, lost.state.version, lost.state.publisher) == (
        TrackerAction.CLAIMED,
        "counter_reset",
        57,
        "n",
    )


@pytest.mark.parametrize(
    ("mode", "action", "version", "epoch"),
    [
        (RegressionMode.HOLD, TrackerAction.HELD, 57, 1),
        (RegressionMode.FOLLOW, TrackerAction.FOLLOWED, 1, 2),
        (RegressionMode.RAISE, TrackerAction.RAISED, 57, 1),
    ],
)
def test_lower_version_is_a_regression_in_every_mode(
    mode: RegressionMode, action: TrackerAction, version: int, epoch: int
) -> None:
    d = decide(HELD57, upd(1, epoch=2, trainer="b"), mode)
    assert d.action is action
    assert d.is_regression
    assert d.incoming == 1
    assert (d.state.version, d.state.epoch) == (version, epoch)
    assert d.changed is (mode is RegressionMode.FOLLOW)
    assert d.is_update is (mode is RegressionMode.FOLLOW)


def test_default_mode_is_hold() -> None:
    assert decide(HELD57, upd(3)).action is TrackerAction.HELD


def test_claim_adopts_its_version_when_none_is_held_but_is_no_update() -> None:
    d = decide(TrackerState(), claim(7))
    assert d.action is TrackerAction.CLAIMED
    assert d.state == TrackerState(
        version=7, epoch=2, publisher="b", updated_at=None, incarnation="", reserved=7, announced_since=7
    )
    assert d.changed and not d.is_update and not d.is_regression


def test_claim_of_a_never_published_policy_keeps_version_unknown() -> None:
    d = decide(TrackerState(), claim(None))
    assert d.state.version is None and d.state.epoch == 2
    assert not d.changed


def test_claim_repeating_the_current_version_only_notes_epoch_and_publisher() -> None:
    d = decide(HELD57, claim(57, epoch=5, trainer="c"))
    assert d.state == TrackerState(version=57, epoch=5, publisher="c", updated_at=50.0, incarnation="", reserved=57)
    assert not d.changed and not d.claim_behind


def test_claim_with_a_lower_version_is_never_a_regression_on_its_own() -> None:
    d = decide(HELD57, claim(3))
    assert d.action is TrackerAction.CLAIMED
    assert d.state.version == 57
    assert not d.is_regression and d.claim_behind


def test_claim_ahead_of_a_lagging_state_catches_up_only_when_events_were_missed() -> None:
    d = decide(HELD57, claim(60), rebase=True)
    assert d.state.version == 60 and d.changed and not d.is_update


@pytest.mark.parametrize(
    ("version", "reserved"),
    [(2**53 - 1, None), (2**53 - 1, 2**53 - 1), (60, None), (None, 2**53 - 1), (57, 59), (58, 60)],
)
@pytest.mark.parametrize("previous", [None, "a"])
def test_a_claim_above_what_the_chain_explains_is_rejected_and_the_owner_keeps_the_counter(
    version: int | None, reserved: int | None, previous: str | None
) -> None:
    d = decide(HELD57, claim(version, reserved=reserved, previous=previous))
    assert (d.action, d.reason, d.state) == (TrackerAction.REJECTED, "unexplained_claim", HELD57)
    assert d.alert and not d.changed and d.incoming == version
    # The owner's next update is still its own and still explained.
    assert decide(d.state, upd(58)).action is TrackerAction.ADVANCED


@pytest.mark.parametrize(("version", "reserved"), [(58, 58), (57, 58), (None, 58), (58, None), (3, 57)])
def test_a_claim_may_name_one_number_above_the_chain_its_own_reservation(
    version: int | None, reserved: int | None
) -> None:
    d = decide(HELD57, claim(version, reserved=reserved, previous=None))
    assert d.action is TrackerAction.CLAIMED and d.reason in (None, "counter_reset")
    assert d.state.version == max(57, version or 0) and d.state.publisher == "b"


def test_the_ceiling_of_a_claim_counts_what_was_reserved_not_only_what_was_published() -> None:
    reserved_60 = TrackerState(version=57, epoch=1, publisher="a", updated_at=50.0, incarnation="", reserved=60)
    assert decide(reserved_60, claim(61, reserved=61)).action is TrackerAction.CLAIMED
    assert decide(reserved_60, claim(62, reserved=62)).reason == "unexplained_claim"


def test_a_first_claim_is_taken_as_it_is_nothing_contradicts_it() -> None:
    assert decide(TrackerState(), claim(2**53 - 1, previous=None)).state.version == 2**53 - 1
    # An owner that never published: its claim's numbers are what the chain saw (none), plus one.
    owned = decide(TrackerState(), claim(None, epoch=0)).state
    assert decide(owned, claim(1, epoch=1)).action is TrackerAction.CLAIMED
    assert decide(owned, claim(5, epoch=1)).reason == "unexplained_claim"


def test_non_weight_event_is_refused() -> None:
    with pytest.raises(TypeError):
        decide(TrackerState(), "weight.updated")  # type: ignore[arg-type]


def test_tracker_names_are_exported_from_the_consumers_package() -> None:
    import weightbus.consumers as consumers
    from weightbus.consumers.tracker.metrics import TrackerMetrics
    from weightbus.consumers.tracker.tracker import VersionChange, VersionTracker

    assert consumers.VersionTracker is VersionTracker
    assert consumers.VersionChange is VersionChange
    assert consumers.TrackerMetrics is TrackerMetrics
    assert consumers.RegressionMode is RegressionMode
    assert {"VersionTracker", "RegressionMode", "TrackerState"} <= set(consumers.__all__)
