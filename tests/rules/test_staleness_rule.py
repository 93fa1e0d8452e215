"""The staleness rule as pure functions: every edge case of miles §4 plus weightbus' stricter ones."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._builders import make_group
from weightbus.rules.staleness import Reason, group_versions, judge, staleness
from weightbus.schemas.rollouts import Group, Sample, TokenSpan


def verdict(group, current, max_staleness=2, unknown="stale"):
    return judge(group_versions(group), current, max_staleness=max_staleness, unknown=unknown)


def test_fresh_and_stale_at_the_bound():
    assert verdict(make_group(1, ["8"]), 10).reason is Reason.FRESH  # staleness 2 == bound
    v = verdict(make_group(1, ["7"]), 10)
    assert (v.reason, v.staleness) == (Reason.STALE, 3)


def test_equal_versions_are_staleness_zero():
    v = verdict(make_group(1, ["10"]), 10, max_staleness=0)
    assert (v.reason, v.staleness) == (Reason.FRESH, 0)


def test_none_current_turns_the_filter_off_and_is_not_zero():
    v = verdict(make_group(1, ["5"]), None, max_staleness=0)
    assert v.keep and v.reason is Reason.UNMEASURED
    assert v.staleness is None and v.current is None


def test_max_staleness_none_measures_without_filtering():
    v = verdict(make_group(1, ["1"]), 10, max_staleness=None)
    assert (v.reason, v.staleness) == (Reason.FRESH, 9)


def test_default_label_is_unknown_version_under_stale():
    assert verdict(make_group(1, ["default"]), 10).reason is Reason.UNKNOWN_VERSION


@pytest.mark.parametrize("label", ["default", "", "-1", "v1", "mock-v0"])
def test_mixed_label_group_is_never_silently_fresh(label):
    g = make_group(1, [[label], ["9"]])
    assert verdict(g, 10, unknown="stale").reason is Reason.UNKNOWN_VERSION
    v = verdict(g, 10, unknown="ignore")  # miles: the non-numeric label is ignored
    assert (v.reason, v.staleness) == (Reason.FRESH, 1)


def test_only_default_labels_under_ignore_pass_unmeasured():
    v = verdict(make_group(1, ["default"]), 10, unknown="ignore")
    assert (v.reason, v.staleness) == (Reason.UNMEASURED, None)


def test_group_without_any_label():
    assert verdict(make_group(1, []), 10, unknown="stale").reason is Reason.UNKNOWN_VERSION
    assert verdict(make_group(1, []), 10, unknown="ignore").reason is Reason.UNMEASURED


def test_empty_sample_lets_its_siblings_decide():
    g = make_group(1, [[], ["4"]])
    v = verdict(g, 10, max_staleness=None, unknown="stale")
    assert (v.reason, v.staleness) == (Reason.FRESH, 6)


def test_oldest_turn_counts():
    g = make_group(1, [["6", "10"], ["9"]])
    assert group_versions(g).oldest == 6
    assert verdict(g, 10).reason is Reason.STALE


def test_nested_trajectories_count():
    g = Group(
        prompt_index=1,
        samples=[Sample(index=10)],
        trajectories=[[Sample(index=11, weight_versions=["10"])], [Sample(index=12, weight_versions=["3"])]],
    )
    gv = group_versions(g)
    assert (gv.oldest, gv.newest) == (3, 10)
    assert verdict(g, 10).staleness == 7


def test_span_straddling_a_push_counts_its_oldest_tokens():
    spans = [TokenSpan(version="6", start=0, end=100), TokenSpan(version="10", start=100, end=120)]
    g = make_group(1, ["10"], spans=spans)  # emission-time label says 10; the spans say 6
    v = verdict(g, 10)
    assert (v.reason, v.staleness) == (Reason.STALE, 4)


def test_unknown_span_label_is_unknown():
    g = make_group(1, ["10"], spans=[TokenSpan(version="default", start=0, end=4)])
    assert verdict(g, 10).reason is Reason.UNKNOWN_VERSION


def test_negative_staleness_uses_the_newest_seen_as_current():
    v = verdict(make_group(1, ["12"]), 10)
    assert v.tracker_behind and v.current == 12 and v.staleness == 0
    # a sample newer than the tracker never admits its stale sibling
    v = verdict(make_group(1, [["12"], ["5"]]), 10)
    assert (v.reason, v.staleness, v.current) == (Reason.STALE, 7, 12)


def test_judge_validates_its_arguments():
    with pytest.raises(ValueError, match="unknown"):
        verdict(make_group(1, ["1"]), 1, unknown="lenient")
    with pytest.raises(ValueError, match="max_staleness"):
        verdict(make_group(1, ["1"]), 1, max_staleness=-1)


def test_staleness_helpers():
    assert staleness(None, 3) is None and staleness(3, None) is None
    assert staleness(3, 5) == -2  # not clamped: the stage handles it


labels = st.one_of(st.integers(0, 50).map(str), st.sampled_from(["default", "", "-1", "v1"]))


@given(
    versions=st.lists(st.lists(labels, max_size=3), min_size=1, max_size=6),
    current=st.one_of(st.none(), st.integers(0, 60)),
    max_staleness=st.integers(0, 10),
    unknown=st.sampled_from(["stale", "ignore"]),
)
def test_property_never_admits_a_group_older_than_the_bound(versions, current, max_staleness, unknown):
    g = make_group(1, versions, n=len(versions))
    v = verdict(g, current, max_staleness=max_staleness, unknown=unknown)
    numeric = [int(x) for vs in versions for x in vs if x.isdigit()]
    if not v.keep or current is None:
        return
    if numeric:
        # judged against max(current, newest): never admitted because the tracker lagged
        assert min(numeric) >= max(current, max(numeric)) - max_staleness
        assert v.staleness is not None and 0 <= v.staleness <= max_staleness
    if unknown == "stale":
        assert numeric and all(x.isdigit() for vs in versions for x in vs)


@given(st.integers(0, 100), st.integers(1, 100), st.integers(0, 5))
def test_a_regressed_judgement_never_admits_a_label_above_current_and_never_raises_it(
    current: int, above: int, max_staleness: int
) -> None:
    """weightbus #24 item 7: after the host's version went backwards, a higher label is the old numbering's."""
    from weightbus.rules.staleness import GroupVersions

    versions = GroupVersions(oldest=current + above, newest=current + above, unknown=False, labelled=True)
    verdict = judge(versions, current, max_staleness=max_staleness, regressed=True)
    assert verdict.reason is Reason.STALE and verdict.staleness is None
    assert verdict.current == current  # not raised to the old numbering's label
    normal = judge(versions, current, max_staleness=max_staleness)
    assert normal.current == current + above  # outside a regression the label is evidence, as before
