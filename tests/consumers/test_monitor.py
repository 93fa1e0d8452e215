"""The monitor reducer: events in, view state out, no bus and no clock."""

from __future__ import annotations

from functools import partial

from tests._builders import updated
from weightbus.consumers.monitor import MonitorState, reduce
from weightbus.rules.chain import TrackerAction
from weightbus.schemas import (
    DrainReport,
    EngineOutOfSync,
    PublisherClaimed,
    VersionRegressed,
    WeightApplied,
)
from weightbus.schemas.codec import Event

W = "weightbus.p.weights"


upd = partial(updated, trainer="a", at=100.0)


def drain(seq: int, kept: int, recycled: int, dropped: int, avg: float | None, mx: int | None) -> DrainReport:
    return DrainReport(
        policy="p",
        consumer="rm-0",
        seq=seq,
        current=5,
        kept=kept,
        recycled=recycled,
        dropped=dropped,
        published_at=100.0 + seq,
        staleness_avg=avg,
        staleness_max=mx,
    )


def run(*items: tuple[str, Event, float, bool], max_recent: int = 8) -> MonitorState:
    state = MonitorState(max_recent=max_recent)
    for subject, event, received_at, live in items:
        state = reduce(state, subject, event, received_at=received_at, live=live)
    return state


def test_weights_events_set_version_epoch_publisher_and_live_lag() -> None:
    claim = PublisherClaimed(policy="p", epoch=2, trainer_id="b", published_at=599.0, version=3)
    state = run(
        (W, upd(3, at=100.0), 500.0, False),
        (W, claim, 599.5, True),
        (W, upd(4, epoch=2, trainer="b", at=600.0), 600.25, True),
    )
    view = state.policies["p"]
    assert (view.weights.version, view.weights.epoch, view.weights.publisher) == (4, 2, "b")
    assert view.weights.updated_at == 600.0
    assert view.lag == 0.25
    assert view.last_action is TrackerAction.ADVANCED
    assert (view.events, state.events) == (3, 3)


def test_replayed_update_has_no_lag() -> None:
    view = run((W, upd(3, at=100.0), 5000.0, False)).policies["p"]
    assert view.weights.version == 3 and view.lag is None


def test_reduce_does_not_mutate_its_input() -> None:
    before = run((W, upd(1), 101.0, True))
    after = reduce(before, W, upd(2), received_at=102.0, live=True)
    assert before.policies["p"].weights.version == 1
    assert after.policies["p"].weights.version == 2


def test_claim_notes_the_takeover_without_changing_the_version() -> None:
    claim = PublisherClaimed(policy="p", epoch=7, trainer_id="b", published_at=200.0, version=3)
    view = run((W, upd(3), 101.0, True), (W, claim, 201.0, True)).policies["p"]
    assert (view.weights.version, view.weights.epoch, view.weights.publisher) == (3, 7, "b")
    assert view.weights.updated_at == 100.0 and view.last_action is TrackerAction.CLAIMED


def test_lower_version_is_held_flagged_as_rejected_and_recorded_as_an_alert() -> None:
    view = run((W, upd(57), 101.0, True), (W, upd(1, epoch=2, trainer="cell-1"), 102.0, True)).policies["p"]
    assert view.weights.version == 57 and view.last_action is TrackerAction.HELD
    assert view.rejected is not None and (view.rejected.version, view.rejected.held) == (1, 57)
    assert view.rejected.publisher == "cell-1"
    assert view.regressions == 1 and view.alert_count == 1
    assert view.alerts[0].kind == "regression_seen"
    assert "v57 → v1" in view.alerts[0].summary and "cell-1" in view.alerts[0].summary


def test_a_forged_claim_far_above_the_chain_is_flagged_and_moves_neither_version_nor_owner() -> None:
    forged = PublisherClaimed(
        policy="p", epoch=2, trainer_id="typo", published_at=200.0, version=2**53 - 1, previous_trainer_id=None
    )
    view = run((W, upd(3), 101.0, True), (W, forged, 201.0, True), (W, upd(4), 202.0, True)).policies["p"]
    assert (view.weights.version, view.weights.epoch, view.weights.publisher) == (4, 1, "a")
    assert view.rejected is not None and (view.rejected.version, view.rejected.held) == (2**53 - 1, 3)
    assert view.rejected.publisher == "typo"
    assert [a.kind for a in view.alerts] == ["rejected_seen"]
    assert "unexplained_claim" in view.alerts[0].summary and "typo" in view.alerts[0].summary


def test_drains_keep_recent_reports_and_totals() -> None:
    s = "weightbus.p.drains"
    state = run(*[(s, drain(i, 10, i, 1, 0.5 * i, i), 200.0, True) for i in range(1, 6)], max_recent=3)
    view = state.policies["p"]
    assert [d.seq for d in view.drains] == [3, 4, 5]
    assert (view.kept, view.recycled, view.dropped) == (50, 15, 5)
    last = view.last_drain
    assert last is not None and (last.staleness_avg, last.staleness_max) == (2.5, 5)


def test_alerts_from_trackers_and_engines() -> None:
    a = "weightbus.p.alerts"
    regressed = VersionRegressed(
        policy="p",
        current=57,
        incoming=1,
        incoming_epoch=2,
        publisher="cell-1",
        action="hold",
        observer="rm-0",
        published_at=300.0,
    )
    oos = EngineOutOfSync(policy="p", engine="http://e0", expected="5", actual="4", trainer_id="a", published_at=301.0)
    view = run((a, regressed, 300.1, True), (a, oos, 301.1, True)).policies["p"]
    assert [al.kind for al in view.alerts] == ["version_regressed", "engine_out_of_sync"]
    assert "hold at rm-0" in view.alerts[0].summary
    assert "stamped 5, reports 4" in view.alerts[1].summary
    assert view.weights.version is None  # an alert is not a version


def applied(version: int, engine: str, ok: bool) -> WeightApplied:
    return WeightApplied(policy="p", version=version, engine=engine, read_back=str(version), ok=ok, published_at=1.0)


def test_engine_read_backs_count_for_the_newest_version() -> None:
    s = "weightbus.p.applied"

    view = run(
        (s, applied(1, "e0", True), 1.0, True),
        (s, applied(2, "e0", True), 2.0, True),
        (s, applied(2, "e1", False), 2.0, True),
        (s, applied(1, "e1", True), 2.0, True),  # late read-back of an older stamp
    ).policies["p"]
    assert (view.applied_version, view.applied_ok, view.applied_failed) == (2, 1, 1)


def test_an_engine_reported_twice_counts_once_by_its_latest_read_back() -> None:
    s = "weightbus.p.applied"

    # The trainer's read-back and a catch-up's (or a redelivery after a resubscribe) name the same engine.
    view = run(
        (s, applied(3, "e0", True), 1.0, True),
        (s, applied(3, "e0", True), 1.1, True),
        (s, applied(3, "e1", True), 1.2, True),
    ).policies["p"]
    assert (view.applied_version, view.applied_ok, view.applied_failed) == (3, 2, 0)
    later = run(
        (s, applied(3, "e0", True), 1.0, True),
        (s, applied(3, "e0", False), 1.1, True),  # read back again, now wrong: the latest counts
    ).policies["p"]
    assert (later.applied_ok, later.applied_failed) == (0, 1)


def test_policies_are_kept_apart() -> None:
    other = updated(9, policy="q", trainer="x", at=1.0)
    state = run((W, upd(1), 1.0, True), ("weightbus.q.weights", other, 1.0, True))
    assert list(state.policies) == ["p", "q"]
    assert state.policies["q"].weights.version == 9 and state.policies["p"].weights.version == 1


def waste_report(seq: int, **fields: object) -> DrainReport:
    base = dict(policy="p", consumer="rm-0", seq=seq, current=5, kept=1, recycled=1, dropped=0, published_at=100.0)
    return DrainReport(**{**base, **fields})  # type: ignore[arg-type]


def test_waste_and_bias_totals_add_up_over_reports() -> None:
    from weightbus.consumers.monitor import kept_share, waste_summary

    s = "weightbus.p.drains"
    first = waste_report(
        1,
        tokens_generated=100,
        tokens_trained=60,
        tokens_not_trained={"stale": 40},
        by_length={"kept": {"0-16": 3}, "recycled": {"257-1024": 3}},
        by_reward={"kept": {"0.75-1": 3}, "recycled": {"<=0": 3}},
    )
    second = waste_report(
        2,
        tokens_generated=100,
        tokens_trained=90,
        tokens_not_trained={"stale": 5, "aborted": 5},
        early_aborts=1,
        tokens_saved=30,
        in_flight_versions_avg=0.5,
        in_queue_versions_avg=1.0,
        in_flight_s_avg=2.0,
        in_queue_s_avg=4.0,
        by_length={"kept": {"257-1024": 1}},
    )
    view = run((s, first, 101.0, True), (s, second, 102.0, True)).policies["p"]
    assert (view.tokens_generated, view.tokens_trained) == (200, 150)
    assert dict(view.tokens_not_trained) == {"stale": 45, "aborted": 5}
    assert (view.early_aborts, view.tokens_saved) == (1, 30)
    assert {k: dict(v) for k, v in view.by_length.items()} == {
        "kept": {"0-16": 3, "257-1024": 1},
        "recycled": {"257-1024": 3},
    }
    assert kept_share(view.by_length) == {"0-16": 1.0, "257-1024": 0.25}
    lines = waste_summary(view)
    assert lines[0] == "tokens: 200 generated, 25.0% not trained (aborted 2.5%, stale 22.5%)"
    assert lines[1] == "early aborts: 1 groups, at most 30 tokens saved"
    assert lines[2] == "staleness: 0.50 versions in flight, 1.00 in queue (2.00s / 4.00s)"
    assert lines[3] == "kept by length: 0-16 100%, 257-1024 25%"
    assert lines[4] == "kept by reward: 0.75-1 100%, <=0 0%"
    # The first report alone is unchanged by the second (the reducer never mutates).
    assert waste_summary(run((s, first, 101.0, True)).policies["p"])[0].startswith("tokens: 100 generated, 40.0%")


def test_no_tokens_no_waste_lines() -> None:
    from weightbus.consumers.monitor import waste_summary

    view = run(("weightbus.p.drains", drain(1, 1, 0, 0, None, None), 101.0, True)).policies["p"]
    assert waste_summary(view) == []
