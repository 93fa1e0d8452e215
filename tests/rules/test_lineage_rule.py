"""The chain's lineage check: a delta names a base the chain announced, or one it cannot vouch for (then flagged)."""

from __future__ import annotations

from functools import partial

from tests._builders import updated
from weightbus.rules.chain import UNANNOUNCED_LIMIT, RegressionMode, TrackerAction, TrackerState, decide
from weightbus.schemas import PublisherClaimed, VersionReserved, WeightArtifact, WeightUpdated

upd = partial(updated, trainer="a", at=100.0)


def delta(version: int, base: int, **kw: object) -> WeightUpdated:
    return upd(version, artifact=WeightArtifact(uri=f"/w/v{version}", lineage="delta", base=base), **kw)  # type: ignore[arg-type]


def full(version: int) -> WeightUpdated:
    return upd(version, artifact=WeightArtifact(uri=f"/w/v{version}"))


def reserve(version: int) -> VersionReserved:
    return VersionReserved(policy="p", version=version, epoch=1, trainer_id="a", published_at=1.0)


def fold(*events: WeightUpdated | VersionReserved, state: TrackerState | None = None) -> TrackerState:
    state = TrackerState() if state is None else state
    for event in events:
        d = decide(state, event)
        assert d.reason is None, d
        state = d.state
    return state


def test_a_full_artifact_needs_no_base_and_starts_nothing_special() -> None:
    state = fold(upd(1), full(2))
    d = decide(state, full(3))
    assert d.action is TrackerAction.ADVANCED and not d.unverified_base
    assert (d.state.announced_since, d.state.unannounced) == (1, ())


def test_a_delta_on_an_announced_base_is_taken_verified() -> None:
    state = fold(full(1), upd(2), upd(3))
    for base in (1, 2, 3):
        d = decide(state, delta(4, base))
        assert d.action is TrackerAction.ADVANCED and d.reason is None and not d.unverified_base


def test_a_delta_on_an_aborted_reservation_is_rejected() -> None:
    # 3 was reserved, its update failed (nothing announced), 4 was reserved next: a delta "of 3" is of nothing.
    state = fold(full(1), upd(2), reserve(3), reserve(4))
    d = decide(state, delta(4, 3))
    assert d.action is TrackerAction.REJECTED and d.reason == "unexplained_base"
    assert d.state is state and d.alert


def test_a_delta_on_a_refused_update_is_rejected() -> None:
    state = fold(full(1), upd(2), reserve(3))
    refused = decide(state, updated(3, trainer="rogue", epoch=9, at=100.0))
    assert refused.reason == "not_owner" and refused.state is state
    # The owner's own update 3 failed; it reserves 4 and names the forged 3 as its base.
    d = decide(fold(reserve(4), state=state), delta(4, 3))
    assert d.reason == "unexplained_base"


def test_a_delta_on_a_base_between_announcements_is_rejected() -> None:
    state = fold(full(5), reserve(6), reserve(7), upd(7), reserve(8))
    assert (state.announced_since, state.unannounced) == (5, (6,))
    assert decide(state, delta(8, 6)).reason == "unexplained_base"
    assert decide(state, delta(8, 7)).reason is None


def test_a_delta_whose_base_is_before_a_fresh_tracker_is_taken_unverified() -> None:
    first = decide(TrackerState(), delta(10, 9))
    assert first.action is TrackerAction.ADOPTED and first.unverified_base and first.state.announced_since == 10
    # Older than anything this state saw: it cannot know, it does not guess; taken, flagged.
    d = decide(first.state, delta(11, 3))
    assert d.action is TrackerAction.ADVANCED and d.unverified_base
    assert not decide(first.state, delta(11, 10)).unverified_base


def test_a_rebase_takes_a_delta_on_a_base_it_missed_and_restarts_the_window() -> None:
    state = fold(full(1), upd(2))
    d = decide(state, delta(9, 6), rebase=True)
    assert d.action is TrackerAction.ADVANCED and d.reason is None and d.unverified_base
    assert (d.state.announced_since, d.state.unannounced) == (9, ())
    # A base it did see is still verified under a rebase.
    assert not decide(state, delta(9, 2), rebase=True).unverified_base


def test_a_long_chain_stays_verified_from_its_start() -> None:
    state = fold(full(0), *(upd(v) for v in range(1, 1000)))
    assert (state.announced_since, state.unannounced) == (0, ())
    d = decide(state, delta(1000, 0))
    assert d.action is TrackerAction.ADVANCED and not d.unverified_base


def test_the_skipped_numbers_are_bounded_and_a_base_before_the_span_is_unverified() -> None:
    # Every other number is reserved and skipped: past the limit, the span starts after the oldest kept.
    events: list[WeightUpdated | VersionReserved] = [full(0)]
    for v in range(2, 2 * UNANNOUNCED_LIMIT + 20, 2):
        events += [reserve(v - 1), reserve(v), upd(v)]
    state = fold(*events)
    assert len(state.unannounced) == UNANNOUNCED_LIMIT and state.announced_since == state.unannounced[0] - 1
    top = state.version + 1  # type: ignore[operator]
    old = decide(state, delta(top, 0))
    assert old.action is TrackerAction.ADVANCED and old.unverified_base
    assert decide(state, delta(top, state.unannounced[0])).reason == "unexplained_base"
    assert not decide(state, delta(top, state.unannounced[0] + 1)).unverified_base


def test_a_delta_on_a_number_its_own_jump_skips_is_rejected() -> None:
    state = fold(full(1), reserve(2), reserve(3))
    assert decide(state, delta(3, 2)).reason == "unexplained_base"
    assert decide(state, delta(3, 1)).reason is None


def test_a_claim_that_raises_the_version_counts_it_as_announced() -> None:
    state = fold(full(1), reserve(2))
    claimed = decide(
        state,
        PublisherClaimed(
            policy="p", epoch=2, trainer_id="b", published_at=2.0, version=2, previous_trainer_id="a", reserved=2
        ),
    )
    assert (claimed.state.announced_since, claimed.state.unannounced) == (1, ())
    d = decide(
        claimed.state,
        updated(3, trainer="b", epoch=2, at=3.0, artifact=WeightArtifact(uri="/x", lineage="delta", base=2)),
    )
    assert d.action is TrackerAction.ADVANCED and not d.unverified_base


def test_regression_modes_are_unaffected_by_lineage() -> None:
    state = fold(full(1), upd(2), upd(3))
    assert decide(state, delta(2, 1), RegressionMode.HOLD).action is TrackerAction.HELD
    assert decide(state, delta(2, 1), RegressionMode.RAISE).action is TrackerAction.RAISED
    followed = decide(state, delta(2, 1), RegressionMode.FOLLOW)
    # A counter reset: the numbers may name other weights now, so the base is not vouched for.
    assert followed.action is TrackerAction.FOLLOWED and followed.unverified_base
    assert followed.state.announced_since == 2


def test_updates_without_an_artifact_behave_as_before() -> None:
    state = fold(upd(1), upd(2))
    d = decide(state, upd(3))
    assert d.action is TrackerAction.ADVANCED and not d.unverified_base and d.reason is None
    assert decide(state, upd(5)).reason == "unexplained_jump"


def digested(version: int, digest: str | None) -> WeightUpdated:
    return upd(version, artifact=WeightArtifact(uri=f"/w/v{version}", manifest_digest=digest))


def test_the_held_version_announced_again_for_other_bytes_is_rejected() -> None:
    state = fold(digested(1, "sha256:aa"), digested(2, "sha256:bb"))
    assert state.digest == "sha256:bb"
    d = decide(state, digested(2, "sha256:cc"))
    assert (d.action, d.reason, d.state) == (TrackerAction.REJECTED, "conflicting_artifact", state)
    assert d.alert


def test_a_repeat_for_the_same_bytes_or_without_a_digest_is_only_a_repeat() -> None:
    state = fold(digested(1, "sha256:aa"))
    for repeat in (digested(1, "sha256:aa"), digested(1, None), upd(1)):
        d = decide(state, repeat)
        assert (d.action, d.reason, d.state.digest) == (TrackerAction.REPEATED, None, "sha256:aa")


def test_a_digest_first_named_by_a_repeat_is_then_held_against_the_next() -> None:
    state = fold(upd(1))
    assert state.digest is None
    named = decide(state, digested(1, "sha256:aa"))
    assert named.action is TrackerAction.REPEATED and named.state.digest == "sha256:aa"
    assert decide(named.state, digested(1, "sha256:bb")).reason == "conflicting_artifact"


def test_each_new_version_holds_its_own_digest() -> None:
    state = fold(digested(1, "sha256:aa"), upd(2))
    assert state.digest is None  # 2 named no bytes: nothing to hold a repeat of 2 against
    assert decide(state, digested(2, "sha256:aa")).reason is None
