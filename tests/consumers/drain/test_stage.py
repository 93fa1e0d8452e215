"""The staleness stage and the host helper ``judge_groups``: actions, reasons, statistics, metrics."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from tests._builders import make_group
from weightbus.consumers import Action, Reason, StalenessMetrics, StalenessStage, judge_groups
from weightbus.consumers.drain.tally import DrainTally
from weightbus.rules.staleness import group_versions, judge
from weightbus.schemas.rollouts import Group, Sample, SampleStatus

M = "rollout/fully_async/"


def test_judge_groups_splits_by_action_with_miles_metrics():
    groups = [make_group(1, ["10"]), make_group(2, ["5"]), make_group(3, ["default"]), make_group(4, ["9"])]
    j = judge_groups(groups, 10, max_staleness=2, on_stale="recycle")
    assert [g.prompt_index for g in j.kept] == [1, 4]
    assert [g.prompt_index for g in j.recycled] == [2, 3]
    assert j.dropped == []
    assert all(s.weight_versions == [] and s.response == "" for g in j.recycled for s in g.samples)
    m = j.metrics
    assert m[f"{M}stale_groups_filtered"] == 1
    assert m[f"{M}max_staleness"] == 5  # the filtered group counts (miles semantics)
    assert m[f"{M}avg_staleness"] == pytest.approx((0 + 5 + 1) / 3)
    assert m["weightbus/unknown_version"] == 1
    assert (m["weightbus/kept"], m["weightbus/recycled"], m["weightbus/dropped"]) == (2, 2, 0)
    assert j.stats.reasons == {"stale": 1, "unknown_version": 1}


def test_default_on_stale_drops():
    j = judge_groups([make_group(1, ["5"])], 10, max_staleness=2)
    assert j.recycled == [] and len(j.dropped) == 1
    assert j.dropped[0].samples[0].weight_versions == ["5"]  # dropped groups are not reset


def test_none_current_keeps_everything_and_omits_staleness():
    j = judge_groups([make_group(1, ["5"]), make_group(2, ["default"])], None, max_staleness=0)
    assert len(j.kept) == 2
    assert f"{M}max_staleness" not in j.metrics and f"{M}avg_staleness" not in j.metrics
    assert j.stats.current is None


def test_max_staleness_none_versus_zero():
    groups = lambda: [make_group(1, ["9"]), make_group(2, ["10"])]  # noqa: E731
    off = judge_groups(groups(), 10, max_staleness=None)
    assert len(off.kept) == 2 and off.metrics[f"{M}max_staleness"] == 1
    zero = judge_groups(groups(), 10, max_staleness=0)
    assert [g.prompt_index for g in zero.kept] == [2]


def test_aborted_groups_are_not_kept():
    j = judge_groups([make_group(1, ["10"], status=SampleStatus.ABORTED)], 10, max_staleness=2)
    assert j.kept == [] and j.stats.reasons == {"aborted": 1}
    assert j.metrics[f"{M}aborted_groups_filtered"] == 1


def test_tracker_behind_rejudges_groups_already_kept():
    # current 10 admits group 1 (v8, staleness 2), then group 2 shows v13: the drain's current
    # becomes 13 and group 1 (staleness 5) is no longer fresh.
    j = judge_groups([make_group(1, ["8"]), make_group(2, ["13"]), make_group(3, ["11"])], 10, max_staleness=2)
    assert [g.prompt_index for g in j.kept] == [2, 3]
    assert [g.prompt_index for g in j.dropped] == [1]
    assert (j.stats.current, j.stats.tracker_current, j.stats.tracker_behind) == (13, 10, 2)
    assert j.metrics["weightbus/tracker_behind"] == 2
    assert j.stats.staleness_max == 5 and j.stats.staleness_count == 3


def test_stage_validates_configuration():
    with pytest.raises(ValueError):
        StalenessStage(max_staleness=-1)
    with pytest.raises(ValueError):
        StalenessStage(on_stale="retry")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        StalenessStage(unknown="lenient")  # type: ignore[arg-type]


def test_decide_one_group():
    stage = StalenessStage(max_staleness=1, on_stale="recycle")
    d = stage.decide(make_group(1, ["5"]), 10)
    assert (d.action, d.reason, d.verdict.staleness) == (Action.RECYCLED, Reason.STALE, 5)
    assert stage.decide(make_group(1, ["10"]), 10).action is Action.KEPT
    assert stage.decide(make_group(1, ["10"], status=SampleStatus.ABORTED), 10).reason is Reason.ABORTED


def test_metrics_are_recorded_per_judgement():
    registry = CollectorRegistry()
    metrics = StalenessMetrics(registry).for_policy("p1")
    groups = [make_group(1, ["10"]), make_group(2, ["5"]), make_group(3, ["default"]), make_group(4, ["11"])]
    judge_groups(groups, 10, max_staleness=2, on_stale="recycle", metrics=metrics)

    def value(name, **labels):
        return registry.get_sample_value(name, {"policy": "p1", **labels})

    assert value("weightbus_groups_total", action="kept", reason="fresh") == 2
    assert value("weightbus_groups_total", action="recycled", reason="stale") == 1
    assert value("weightbus_groups_total", action="recycled", reason="unknown_version") == 1
    assert value("weightbus_tracker_behind_total") == 1
    assert value("weightbus_drain_current_version") == 11
    # staleness against 11: group 1 -> 1, group 2 -> 6, group 4 -> 0
    assert value("weightbus_group_staleness_count") == 3
    assert value("weightbus_group_staleness_sum") == 7
    assert value("weightbus_group_staleness_bucket", le="0.0") == 1
    assert value("weightbus_group_staleness_bucket", le="4.0") == 2
    assert value("weightbus_group_staleness_bucket", le="6.0") == 3
    assert value("weightbus_group_staleness_bucket", le="+Inf") == 3


def test_two_policies_share_one_registry():
    registry = CollectorRegistry()
    families = StalenessMetrics(registry)
    judge_groups([make_group(1, ["1"])], 1, metrics=families.for_policy("a"))
    judge_groups([make_group(1, ["1"]), make_group(2, ["1"])], 1, metrics=families.for_policy("b"))
    assert families.for_policy("a") is families.for_policy("a")
    assert (
        registry.get_sample_value("weightbus_groups_total", {"policy": "b", "action": "kept", "reason": "fresh"}) == 2
    )


labels = st.one_of(st.integers(0, 30).map(str), st.sampled_from(["default", "-1"]))
samples = st.lists(labels, max_size=2)
group_specs = st.tuples(
    st.lists(samples, min_size=1, max_size=3),
    st.lists(st.lists(samples, max_size=2), max_size=2),
    st.booleans(),
)


def build(i: int, spec) -> Group:
    flat, nested, aborted = spec
    status = SampleStatus.ABORTED if aborted and i % 3 == 0 else SampleStatus.COMPLETED
    return Group(
        prompt_index=i,
        samples=[Sample(index=i * 10 + k, weight_versions=list(v), status=status) for k, v in enumerate(flat)],
        trajectories=[[Sample(index=i * 10 + 5, weight_versions=list(v)) for v in t] for t in nested],
    )


@settings(max_examples=200, deadline=None)
@given(
    specs=st.lists(group_specs, max_size=12),
    current=st.one_of(st.none(), st.integers(0, 30)),
    max_staleness=st.one_of(st.none(), st.integers(0, 6)),
    unknown=st.sampled_from(["stale", "ignore"]),
)
def test_property_batch_agrees_with_the_pure_rule(specs, current, max_staleness, unknown):
    groups = [build(i, spec) for i, spec in enumerate(specs)]
    j = judge_groups(groups, current, max_staleness=max_staleness, unknown=unknown)
    # The batch judges everything against the newest version seen in the batch, aborted groups included.
    newest = [gv.newest for g in groups if (gv := group_versions(g)).newest is not None]
    final = None if current is None else max([current, *newest])
    assert j.stats.current == final
    kept_ids = {g.prompt_index for g in j.kept}
    for g in groups:
        expected = (
            False
            if g.is_aborted
            else judge(group_versions(g), final, max_staleness=max_staleness, unknown=unknown).keep
        )
        assert (g.prompt_index in kept_ids) == expected
        if expected and final is not None and max_staleness is not None:
            oldest = group_versions(g).oldest
            assert oldest is None or oldest >= final - max_staleness
    assert len(j.kept) + len(j.dropped) == len(groups)
    # The buffer's per-group path (DrainTally.add, its own inlined fast path) agrees with the batch.
    one_by_one = DrainTally(current, max_staleness, unknown)
    for g in groups:
        one_by_one.add(g)
    assert {g.prompt_index for g in one_by_one.kept} == kept_ids
    assert one_by_one.current == final


def test_a_window_of_per_group_judgements_as_miles_gets_them():
    """miles' buffer: one judgement per get, the window finished by get_metrics; evidence carries across gets."""
    registry = CollectorRegistry()
    metrics = StalenessMetrics(registry).for_policy("p")
    routed: list[Group] = []
    w = StalenessStage(max_staleness=1, metrics=metrics).window(on_unused=routed.append)
    taken: list[Group] = []
    for group in (make_group(1, ["13"]), make_group(2, ["11"]), make_group(3, ["13"]), make_group(4, ["11"])):
        t = w.begin(10, "current")
        if w.take(t, group):
            taken.extend(w.close(t))
        else:
            w.close(t)
    # 13, seen in the first get, makes the 11s of later gets stale; what was handed out stays handed out
    assert [g.prompt_index for g in taken] == [1, 3] and [g.prompt_index for g in routed] == [2, 4]
    fresh = {"policy": "p", "action": "kept", "reason": "fresh"}
    assert registry.get_sample_value("weightbus_groups_total", fresh) is None  # nothing before the window ends
    stats = w.finish([make_group(5, ["14"])])
    assert (stats.kept, stats.dropped, stats.reasons, stats.current) == (2, 2, {"stale": 2}, 13)
    assert (stats.tracker_current, stats.tracker_behind, stats.version_state) == (10, 4, "current")
    assert (stats.staleness_max, stats.queue_size, stats.buffer_max_staleness) == (2, 1, -1)
    assert registry.get_sample_value("weightbus_groups_total", fresh) == 2
    # the next window starts from what is still held (14): its first get is judged against it
    t = w.begin(10, "given")
    assert not w.take(t, make_group(6, ["12"])) and w.close(t) == []
    assert w.finish([]).version_state == "given"
