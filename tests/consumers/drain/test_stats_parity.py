"""Parity of ``DrainStats`` with the shapes that copy it by hand: the wire ``DrainReport`` (``to_drain_report``),
the monitor's view (``DrainView``, the ``PolicyView`` totals) and the rollout's ``RolloutProgress`` and
``BatchReply``.

The copies stay flat (the report's JSON is recorded in traces and shown by ``weightbus watch --json``), so a
field added to ``DrainStats`` fails here until each copy carries it or says why not, below.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from weightbus.consumers.drain.decisions import DrainStats
from weightbus.consumers.drain.reports import to_drain_report
from weightbus.consumers.monitor import DrainView, PolicyView, _apply_drain
from weightbus.rl.batches import BatchReply
from weightbus.rl.rollout import RolloutProgress
from weightbus.schemas.drains import DrainReport

#: ``DrainStats`` fields the wire report leaves out, and why.
NOT_REPORTED = {
    "tracker_current": "the report's current is the version judged against",
    "staleness_count": "a weight of the average, local to the drain's metrics",
    "unknown_label_groups": "a local metric (reasons count the unknown_version groups)",
    "buffer_avg_staleness": "miles' buffer metric, of what is left, not of what was judged",
    "buffer_max_staleness": "miles' buffer metric, of what is left, not of what was judged",
    "dynamic_filter": "the host's own filter, in its metrics",
}
#: ``DrainReport`` fields the monitor neither shows per drain nor totals, and why.
NOT_SHOWN = {
    "reasons": "shown through the kept/recycled/dropped counts",
    "tracker_behind": "not shown by watch",
    "queue_size": "not shown by watch",
    "version_state": "not shown by watch",
}
#: ``DrainStats`` fields the rollout's progress line carries under another name.
PROGRESS_RENAMED = {"current": "judged_at"}
#: ``DrainStats`` fields the rollout's progress line and batch reply leave out: the trainer reads the rest from
#: the drain reports; tokens and aborts they carry are the rollout's totals, not one drain's.
NOT_IN_PROGRESS = {
    "tracker_current",
    "reasons",
    "staleness_count",
    "tracker_behind",
    "unknown_label_groups",
    "queue_size",
    "buffer_avg_staleness",
    "buffer_max_staleness",
    "dynamic_filter",
    "version_state",
    "tokens_generated",
    "tokens_trained",
    "tokens_not_trained",
    "early_aborts",
    "tokens_saved",
    "in_flight_versions_avg",
    "in_queue_versions_avg",
    "in_flight_s_avg",
    "in_queue_s_avg",
    "by_length",
    "by_reward",
}


def _stats_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(DrainStats)}


def _distinct_stats() -> DrainStats:
    """A ``DrainStats`` whose every field holds a value of its own, so a field not copied shows."""
    n = itertools.count(3)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(DrainStats):
        kind = str(f.type).replace(" ", "")
        if kind in ("int", "int|None"):
            values[f.name] = next(n)
        elif kind == "float|None":
            values[f.name] = next(n) + 0.5
        elif kind == "str":
            values[f.name] = "current"
        elif kind == "dict[str,int]":
            values[f.name] = {"stale": next(n)}
        elif kind == "dict[str,dict[str,int]]":
            values[f.name] = {"kept": {"short": next(n)}}
        else:
            raise AssertionError(f"DrainStats.{f.name}: teach this test a value for {f.type}")
    return DrainStats(**values)


def test_the_report_carries_every_stats_field_but_the_local_ones() -> None:
    report_fields = set(DrainReport.__struct_fields__)
    stats = _stats_fields()
    assert set(NOT_REPORTED) <= stats - report_fields, "a listed field is reported now or no longer exists"
    missing = stats - report_fields - set(NOT_REPORTED)
    assert not missing, f"DrainStats fields missing from DrainReport: {sorted(missing)}"
    stats_value = _distinct_stats()
    report = to_drain_report(stats_value, policy="p", consumer="c", seq=1, published_at=1.0)
    for name in stats - set(NOT_REPORTED):
        assert getattr(report, name) == getattr(stats_value, name), f"to_drain_report does not copy {name}"


def test_the_monitor_shows_or_totals_every_report_field() -> None:
    report_fields = set(DrainReport.__struct_fields__)
    view_fields = {f.name for f in dataclasses.fields(DrainView)}
    totals = {f.name for f in dataclasses.fields(PolicyView)}
    assert set(NOT_SHOWN) <= report_fields - view_fields - totals, "a listed field is shown now or gone"
    missing = report_fields - view_fields - totals - set(NOT_SHOWN)
    assert not missing, f"DrainReport fields the monitor drops silently: {sorted(missing)}"
    report = to_drain_report(_distinct_stats(), policy="p", consumer="c", seq=1, published_at=1.0)
    view = _apply_drain(PolicyView("p"), report, limit=4)
    drain = view.last_drain
    assert drain is not None
    for name in view_fields:
        expected = getattr(report, name)
        if name == "tokens_not_trained":  # shown as a total per drain
            expected = sum(expected.values())
        assert getattr(drain, name) == expected, f"DrainView.{name} is not the report's"
    for name in (report_fields & totals) - {"policy"}:
        assert getattr(view, name) == getattr(report, name), f"PolicyView.{name} does not total the report's"


def test_the_rollout_progress_and_batch_reply_carry_the_drain_fields_they_name() -> None:
    stats = _stats_fields()
    assert NOT_IN_PROGRESS <= stats
    for shape in (RolloutProgress, BatchReply):
        names = set(shape.__struct_fields__)
        carried = {PROGRESS_RENAMED.get(name, name) for name in stats - NOT_IN_PROGRESS}
        if shape is RolloutProgress:
            carried.discard("staleness_avg")  # the progress line shows the maximum only
        missing = carried - names
        assert not missing, f"{shape.__name__} lacks {sorted(missing)}"
