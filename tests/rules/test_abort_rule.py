"""The early-abort rule: only certainty aborts, it is monotonic, and it never contradicts the staleness rule."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._builders import make_group
from weightbus.rules.abort import certain_stale, oldest_bound
from weightbus.rules.staleness import Reason, group_versions, judge

versions = st.integers(min_value=0, max_value=1000)
bounds = st.integers(min_value=0, max_value=8)


def test_beyond_the_bound_is_certain_and_at_the_bound_is_not():
    assert certain_stale(5, 7, 1)
    assert not certain_stale(6, 7, 1)
    assert certain_stale(6, 7, 0)
    assert not certain_stale(7, 7, 0)


@pytest.mark.parametrize(("oldest", "current", "bound"), [(None, 9, 0), (0, None, 0), (0, 9, None)])
def test_nothing_known_never_aborts(oldest, current, bound):
    assert not certain_stale(oldest, current, bound)


def test_a_negative_bound_is_refused():
    with pytest.raises(ValueError, match="max_staleness"):
        certain_stale(1, 2, -1)


def test_oldest_bound_is_the_smallest_known_label():
    assert oldest_bound([None, 4, 2, None]) == 2
    assert oldest_bound([None, None]) is None
    assert oldest_bound([]) is None


@given(versions, versions, bounds, st.integers(min_value=0, max_value=5), st.integers(min_value=0, max_value=5))
def test_monotonic_in_current_and_oldest(oldest, current, bound, newer, older):
    if certain_stale(oldest, current, bound):
        assert certain_stale(max(0, oldest - older), current + newer, bound)
        assert certain_stale(oldest, current, max(0, bound - 1))


@given(versions, versions, bounds, st.lists(versions, max_size=4), st.integers(min_value=0, max_value=5))
def test_an_abort_is_a_group_the_drain_would_call_stale(oldest, current, bound, others, ahead):
    """Whatever else the group ends up holding, and however far the drain's current moved on."""
    if not certain_stale(oldest, current, bound):
        return
    labels = [str(oldest)] + [str(v) for v in others]
    group = make_group(1, labels)
    drain_current = current + ahead
    verdict = judge(group_versions(group), drain_current, max_staleness=bound)
    assert verdict.reason is Reason.STALE
