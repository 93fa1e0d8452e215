"""The replica view's fold (``rules.replicas``): acknowledgements, alerts, out of order, duplicates, no bus."""

from __future__ import annotations

import itertools

import pytest

from tests._builders import updated
from weightbus.rules.replicas import (
    ReplicaView,
    fold_replicas,
    newly_activated,
    newly_converged,
    observe,
)
from weightbus.schemas import EngineOutOfSync, FleetQuarantined, WeightApplied

A, B, C, D = "http://a", "http://b", "http://c", "http://d"


def ack(version: int, engine: str, at: float, *, ok: bool = True, read_back: str | None = None) -> WeightApplied:
    return WeightApplied(
        policy="p",
        version=version,
        engine=engine,
        read_back=str(version) if read_back is None else read_back,
        ok=ok,
        published_at=at,
    )


def out_of_sync(engine: str, at: float, *, expected: str, actual: str, reason: str) -> EngineOutOfSync:
    return EngineOutOfSync(
        policy="p", engine=engine, expected=expected, actual=actual, trainer_id="t", published_at=at, reason=reason
    )


def announce(version: int, at: float, *engines: str):  # noqa: ANN201
    return updated(version, at=at, engines=engines)


def test_an_engine_serves_only_what_it_acknowledged() -> None:
    view = fold_replicas([announce(1, 10.0, A, B), ack(1, A, 10.5)])
    assert view.engines[A].serving == 1
    assert B not in view.engines  # announced, never acknowledged: serves nothing known
    assert view.serving(min_version=1) == (A,)
    conv = view.convergence()
    assert conv is not None and (conv.version, conv.serving, conv.fleet, conv.converged) == (1, 1, 2, False)
    assert conv.converged_in is None


def test_times_come_from_the_events_and_shares_pick_the_kth_acknowledgement() -> None:
    events = [announce(4, 100.0, A, B, C, D), ack(4, A, 100.2), ack(4, B, 100.4), ack(4, C, 100.9), ack(4, D, 103.0)]
    view = fold_replicas(events)
    rollout = view.versions[4]
    assert rollout.activation(C) == pytest.approx(0.9)
    assert rollout.time_to_converge(0.5) == pytest.approx(0.4)
    assert rollout.time_to_converge(0.75) == pytest.approx(0.9)
    assert rollout.time_to_converge(0.9) == pytest.approx(3.0)  # ceil(0.9 * 4) = 4 engines
    assert rollout.time_to_converge(1.0) == pytest.approx(3.0)
    conv = view.convergence()
    assert conv is not None and conv.converged and conv.converged_in == pytest.approx(3.0)
    assert view.last_converged() is rollout
    with pytest.raises(ValueError):
        rollout.converged_at(0.0)


def test_any_arrival_order_folds_to_the_same_view() -> None:
    events = [
        announce(1, 10.0, A, B),
        ack(1, A, 10.1),
        ack(1, B, 10.2),
        announce(2, 20.0, A, B),
        ack(2, A, 20.3),
        out_of_sync(B, 20.4, expected="2", actual="1", reason="read_back"),
        ack(2, B, 25.0),
    ]
    views = {_key(fold_replicas(order)) for order in itertools.permutations(events)}
    assert len(views) == 1
    view = fold_replicas(events)
    assert (view.engines[A].serving, view.engines[B].serving) == (2, 2)
    assert view.versions[2].time_to_converge(1.0) == pytest.approx(5.0)


def _key(view: ReplicaView) -> object:
    return (
        tuple(sorted((e.engine, e.serving, e.since, e.reason) for e in view.engines.values())),
        tuple(sorted((v, r.announced_at, tuple(sorted(r.acks.items())), r.fleet) for v, r in view.versions.items())),
        view.newest,
    )


def test_duplicates_change_nothing() -> None:
    events = [announce(3, 30.0, A), ack(3, A, 30.5)]
    once = fold_replicas(events)
    twice = fold_replicas([*events, *events])
    assert _key(once) == _key(twice)
    assert observe(once, events[0]) is once  # the same announcement again: the view itself


def test_an_older_acknowledgement_arriving_late_records_its_time_but_not_what_is_served() -> None:
    view = fold_replicas([announce(1, 10.0, A), announce(2, 20.0, A), ack(2, A, 20.5), ack(1, A, 10.5)])
    assert view.engines[A].serving == 2
    assert view.versions[1].activation(A) == pytest.approx(0.5)


def test_a_regressed_engine_serves_the_lower_version_it_acknowledged_last() -> None:
    view = fold_replicas([announce(5, 50.0, A), ack(5, A, 50.5), ack(3, A, 60.0)])
    assert view.engines[A].serving == 3
    assert view.serving(min_version=5) == ()
    conv = view.convergence()
    assert conv is not None and (conv.version, conv.serving) == (5, 0)
    # The acknowledgement of v5 still happened: its convergence time stands.
    assert view.versions[5].time_to_converge() == pytest.approx(0.5)


def test_a_restarted_engine_serves_nothing_known_until_it_acknowledges_again() -> None:
    served = [announce(1, 10.0, A, B), ack(1, A, 10.1), ack(1, B, 10.1)]
    restart = out_of_sync(B, 19.0, expected="1", actual="default", reason="unexpected_label")
    view = fold_replicas([*served, restart])
    assert view.engines[B].serving is None and view.engines[B].label == "default"
    assert view.engines[B].reason == "unexpected_label"
    assert view.serving(min_version=1) == (A,)
    assert view.versions[1].expected == frozenset()  # it did reach v1 once: v1's rollout is untouched
    back = fold_replicas([*served, restart, announce(2, 20.0, A, B), ack(2, A, 20.1), ack(2, B, 20.2)])
    assert back.engines[B].serving == 2 and back.engines[B].reason is None


def test_a_quarantine_leaves_every_engine_it_names_unknown() -> None:
    view = fold_replicas([announce(1, 10.0, A, B), ack(1, A, 10.1), ack(1, B, 10.1)])
    q = FleetQuarantined(
        policy="p",
        label="quarantine:2",
        reason="update_failed",
        version=2,
        trainer_id="t",
        published_at=21.0,
        engines=(A,),
        failed=(B,),
    )
    view = observe(view, ack(2, A, 20.5))
    view = observe(view, q)
    assert (view.engines[A].serving, view.engines[B].serving) == (None, None)
    assert view.engines[A].reason == "quarantined" and view.engines[A].label == "quarantine:2"
    assert view.serving(min_version=1) == ()
    # An acknowledgement from before the quarantine, arriving after it, does not bring the engine back.
    assert observe(view, ack(2, B, 20.9)).engines[B].serving is None
    assert observe(view, ack(3, B, 30.0)).engines[B].serving == 3


def test_at_one_instant_the_unknown_wins() -> None:
    at = 40.0
    bad = out_of_sync(A, at, expected="4", actual="3", reason="read_back")
    for events in ([ack(4, A, at), bad], [bad, ack(4, A, at)]):
        assert fold_replicas(events).engines[A].serving is None


def test_an_engine_the_push_did_not_cover_is_in_the_fleet_and_unconverged() -> None:
    view = fold_replicas(
        [
            announce(6, 60.0, A),
            ack(6, A, 60.2),
            out_of_sync(B, 60.1, expected="6", actual="5", reason="not_covered"),
        ]
    )
    assert view.versions[6].fleet == (A, B)
    conv = view.convergence()
    assert conv is not None and (conv.serving, conv.fleet, conv.converged) == (1, 2, False)
    assert view.versions[6].time_to_converge(0.5) == pytest.approx(0.2)


def test_exact_and_min_constraints() -> None:
    view = fold_replicas([ack(3, A, 1.0), ack(4, B, 1.0), ack(5, C, 1.0)])
    assert view.serving(exact_version=4) == (B,)
    assert view.serving(min_version=4) == (B, C)
    assert view.serving(min_version=4, exact_version=3) == ()
    assert view.serving() == (A, B, C)


def test_only_the_newest_versions_keep_their_rollout() -> None:
    view = ReplicaView(max_versions=3)
    for v in range(1, 7):
        view = observe(view, announce(v, float(v), A))
    assert sorted(view.versions) == [4, 5, 6] and view.newest == 6
    assert observe(view, ack(1, A, 1.5)).versions.keys() == view.versions.keys()


def test_new_times_are_reported_once() -> None:
    start = fold_replicas([ack(7, A, 70.4)])  # acknowledged before its announcement arrived
    announced = observe(start, announce(7, 70.0, A, B))
    assert [(a.version, a.engine, round(a.seconds, 3)) for a in newly_activated(start, announced)] == [(7, A, 0.4)]
    assert newly_converged(start, announced) == []
    done = observe(announced, ack(7, B, 71.0))
    got = sorted((a.share, round(a.seconds, 3)) for a in newly_converged(announced, done))
    assert got == [(0.9, 1.0), (1.0, 1.0)]
    assert newly_converged(done, observe(done, ack(7, B, 71.0))) == []
    assert [a.engine for a in newly_activated(announced, done)] == [B]


def test_unconverged_since_is_the_oldest_announcement_after_the_newest_converged_version() -> None:
    view = fold_replicas([announce(1, 10.0, A, B), ack(1, A, 10.1), ack(1, B, 10.2)])
    assert view.unconverged_since() is None
    view = fold_replicas([*_acked(1, 10.0), announce(2, 20.0, A, B), ack(2, A, 20.1), announce(3, 30.0, A, B)])
    assert view.unconverged_since() == 20.0  # B never acknowledged v2: the oldest not settled, however many follow
    view = observe(observe(view, ack(3, A, 30.1)), ack(3, B, 30.2))
    assert view.unconverged_since() is None  # v3 reached everyone: v2 is settled with it
    # An engine left the fleet: v4 names it, v5 does not and converges without it.
    view = fold_replicas([announce(4, 40.0, A, B), ack(4, A, 40.1), announce(5, 50.0, A), ack(5, A, 50.1)])
    assert view.unconverged_since() is None
    assert fold_replicas([announce(6, 60.0, A)]).unconverged_since() == 60.0
    # Announced without engines (``publish --no-engines``): no fleet, nothing to wait for.
    assert fold_replicas([*_acked(1, 10.0), announce(2, 20.0)]).unconverged_since() is None


def _acked(version: int, at: float) -> list[object]:
    return [announce(version, at, A, B), ack(version, A, at + 0.1), ack(version, B, at + 0.2)]
