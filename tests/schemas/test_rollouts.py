"""Rollout data: label parsing, the cached summary, meta_info recording, retry resets, evolution."""

import copy

import msgspec
import pytest

from weightbus.schemas import rollouts
from weightbus.schemas.rollouts import Group, Sample, SampleStatus, TokenSpan, parse_version


@pytest.mark.parametrize(
    ("label", "expected"),
    [
        ("12", 12),
        ("0", 0),
        ("007", 7),
        ("default", None),
        ("", None),
        ("-1", None),
        ("v1", None),
        ("1.0", None),
        (" 1", None),
        ("²", None),
        (5, None),
        (None, None),
    ],
)
def test_parse_version_accepts_only_non_negative_ascii_decimals(label, expected):
    assert parse_version(label) == expected


def test_summary_is_parsed_at_build_time():
    s = Sample(index=0, weight_versions=["7", "default", "5"])
    assert s.oldest_version == 5
    assert s.newest_version == 7
    assert s.has_unknown_version


def test_record_meta_info_appends_label_and_spans():
    s = Sample(index=0)
    s.record_meta_info({"weight_version": "4"})
    s.record_meta_info(
        {
            "weight_version": "6",
            "weight_versions": [{"version": "3", "start": 0, "end": 10}, {"version": "6", "start": 10, "end": 12}],
        }
    )
    assert s.weight_versions == ["4", "6"]
    assert s.weight_version_spans == [TokenSpan(version="3", start=0, end=10), TokenSpan(version="6", start=10, end=12)]
    assert (s.oldest_version, s.newest_version, s.has_unknown_version) == (3, 6, False)


def test_record_meta_info_default_label_is_unknown():
    s = Sample(index=0)
    s.record_meta_info({"weight_version": "default"})
    assert s.weight_versions == ["default"]
    assert s.oldest_version is None
    assert s.has_unknown_version


def test_record_meta_info_rejects_malformed_spans():
    s = Sample(index=0)
    with pytest.raises(ValueError, match=r"weight_versions\[0\]"):
        s.record_meta_info({"weight_versions": [{"version": "1"}]})
    with pytest.raises(ValueError, match="must be a list"):
        s.record_meta_info({"weight_versions": "1"})


def test_assigning_labels_or_status_refreshes_the_summary():
    s = Sample(index=0, weight_versions=["3"])
    s.weight_versions = ["9"]
    assert s.oldest_version == 9
    s.status = SampleStatus.ABORTED
    assert s.version_summary[0] & rollouts.ABORTED
    s.weight_versions.append("1")  # in place: needs an explicit refresh
    assert s.oldest_version == 9
    s.refresh_versions()
    assert s.oldest_version == 1


def test_copy_rebuilds_a_lost_summary():
    s = Sample(index=0, weight_versions=["3"])
    c = copy.copy(s)
    assert c.oldest_version == 3


def test_reset_for_retry_clears_response_and_versions():
    s = Sample(
        index=1,
        prompt="p",
        tokens=[1, 2, 3, 4],
        response="ab",
        response_length=2,
        reward=1.0,
        weight_versions=["5"],
        weight_version_spans=[TokenSpan(version="4", start=0, end=1)],
        status=SampleStatus.COMPLETED,
    )
    s.reset_for_retry()
    assert s.tokens == [1, 2]
    assert (s.response, s.response_length, s.reward, s.status) == ("", 0, None, SampleStatus.PENDING)
    assert s.weight_versions == [] and s.weight_version_spans == []
    assert s.oldest_version is None and not s.has_unknown_version


def test_group_reset_recycles_the_flat_prompt_group():
    prompt = [Sample(index=10, weight_versions=["1"]), Sample(index=11)]
    nested = [[Sample(index=12, weight_versions=["2"], status=SampleStatus.ABORTED)]]
    g = Group(prompt_index=1, samples=prompt, trajectories=nested, status=SampleStatus.ABORTED)
    assert g.is_aborted
    assert g.reset_for_retry() is g
    assert g.trajectories == [] and g.status == SampleStatus.PENDING
    assert [s.weight_versions for s in g.samples] == [[], []]
    assert not g.is_aborted


def test_group_sort_key_and_aborted_detection_cover_nested_samples():
    g = Group(prompt_index=3, trajectories=[[], [Sample(index=42, status=SampleStatus.ABORTED)]])
    assert g.sort_key == 42
    assert g.is_aborted
    assert Group(prompt_index=3).sort_key == 3


def test_roundtrip_does_not_encode_the_cache_and_rebuilds_it():
    s = Sample(index=1, weight_versions=["8"], weight_version_spans=[TokenSpan(version="2", start=0, end=3)])
    data = msgspec.json.encode(Group(prompt_index=0, samples=[s]))
    assert b'"_v"' not in data
    back = msgspec.json.decode(data, type=Group)
    assert back.samples[0].oldest_version == 2


def test_older_payload_decodes_with_defaults_and_unknown_fields_ignored():
    old = (
        b'{"prompt_index": 4, "samples": [{"index": 7, "weight_versions": ["3"], "status": "completed",'
        b' "loss_mask": [1, 1]}], "future_field": 1}'
    )
    g = msgspec.json.decode(old, type=Group)
    assert g.trajectories == [] and g.samples[0].weight_version_spans == []
    assert g.samples[0].oldest_version == 3
    assert g.samples[0].status is SampleStatus.COMPLETED


def test_mutable_defaults_are_not_shared():
    a, b = Sample(index=0), Sample(index=1)
    a.record_weight_version("1")
    assert b.weight_versions == []
