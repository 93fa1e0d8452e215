"""The staleness rule, as pure functions over a group's pre-parsed version labels.

Staleness is ``current - oldest`` over every sample, turn, trajectory and token span; a label that is not a version
is never silently fresh; ``current is None`` turns the filter off. The rest: docs/design.md#the-staleness-rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final, Literal

from weightbus.schemas.rollouts import (
    ABORTED,
    HAS_UNKNOWN,
    HAS_VERSION,
    NO_NEWEST,
    NO_OLDEST,
    Group,
    Sample,
    SampleStatus,
)

__all__ = [
    "UNKNOWN_POLICIES",
    "GroupVersions",
    "Reason",
    "UnknownPolicy",
    "Verdict",
    "group_versions",
    "judge",
    "raw_scan",
    "scan_group",
    "staleness",
]

UnknownPolicy = Literal["stale", "ignore"]
UNKNOWN_POLICIES: Final = ("stale", "ignore")


class Reason(StrEnum):
    """Why a group was kept or not. Keep reasons: ``fresh``, ``unmeasured``; the rest are filters."""

    FRESH = "fresh"
    """Staleness is known and within the bound (or the bound is off)."""
    UNMEASURED = "unmeasured"
    """Kept without a known staleness: no current version yet, or no numeric label under ``ignore``."""
    STALE = "stale"
    """Staleness exceeded ``max_staleness``."""
    UNKNOWN_VERSION = "unknown_version"
    """A label is not a version, or the group has no label at all (``unknown="stale"``)."""
    ABORTED = "aborted"
    """The group or one of its samples was aborted."""
    FILTERED = "filtered"
    """A host's dynamic filter rejected the group (always dropped)."""


@dataclass(frozen=True, slots=True)
class GroupVersions:
    """The version summary of a group.

    Attributes:
        oldest: the minimum numeric version over every label and span, or None if there is none.
        newest: the maximum numeric version, or None.
        unknown: some label or span is not a version.
        labelled: the group has at least one label or span.
    """

    oldest: int | None
    newest: int | None
    unknown: bool
    labelled: bool


@dataclass(frozen=True, slots=True)
class Verdict:
    """The rule's answer for one group.

    Attributes:
        reason: ``fresh`` or ``unmeasured`` (keep), ``stale`` or ``unknown_version`` (filter).
        staleness: ``current - oldest`` against the current used, or None when unknown.
        current: the version judged against: ``max(current, newest)`` (``current`` itself in a regressed
            judgement), or None when the filter is off.
        tracker_behind: the group held a version newer than the ``current`` passed in.
    """

    reason: Reason
    staleness: int | None
    current: int | None
    tracker_behind: bool = False

    @property
    def keep(self) -> bool:
        """Whether the group passes the filter."""
        return self.reason is Reason.FRESH or self.reason is Reason.UNMEASURED


def _scan(samples: list[Sample], lo: float, hi: int, flags: int) -> tuple[float, int, int]:
    for s in samples:
        f, o, n = s._v
        if o < lo:
            lo = o
        if n > hi:
            hi = n
        flags |= f
    return lo, hi, flags


def raw_scan(group: Group) -> tuple[float, int, int]:
    """``scan_group`` with the sentinels kept: ``oldest`` is ``NO_OLDEST``, ``newest`` ``NO_NEWEST``
    when the group has no numeric label."""
    try:
        lo, hi, flags = _scan(group.samples, NO_OLDEST, NO_NEWEST, 0)
        for trajectory in group.trajectories:
            lo, hi, flags = _scan(trajectory, lo, hi, flags)
    except AttributeError:
        # A copied sample lost its cached summary (copy.copy drops the instance dict): rebuild, rescan.
        for sample in group.iter_samples():
            sample.refresh_versions()
        return raw_scan(group)
    if group.status == SampleStatus.ABORTED:
        flags |= ABORTED
    return lo, hi, flags


def scan_group(group: Group) -> tuple[int | None, int | None, int]:
    """The raw summary of a group in one pass over its samples' cached summaries.

    Returns:
        ``(oldest, newest, flags)``: the numeric bounds (None without a numeric label) and the OR of
        the samples' ``HAS_VERSION``, ``HAS_UNKNOWN`` and ``ABORTED`` bits (``ABORTED`` also when the
        group's own status is aborted). ``group_versions`` is the readable form.
    """
    lo, hi, flags = raw_scan(group)
    if not flags & HAS_VERSION:
        return None, None, flags
    return int(lo), hi, flags


def group_versions(group: Group) -> GroupVersions:
    """The version summary of ``group``: every sample, turn, nested trajectory and token span."""
    lo, hi, flags = scan_group(group)
    return GroupVersions(
        oldest=lo,
        newest=hi,
        unknown=bool(flags & HAS_UNKNOWN),
        labelled=bool(flags & (HAS_VERSION | HAS_UNKNOWN)),
    )


def staleness(current: int | None, oldest: int | None) -> int | None:
    """``current - oldest``, or None when either is unknown. Not clamped: callers handle a negative."""
    if current is None or oldest is None:
        return None
    return current - oldest


def judge(
    versions: GroupVersions,
    current: int | None,
    *,
    max_staleness: int | None,
    unknown: UnknownPolicy = "stale",
    regressed: bool = False,
) -> Verdict:
    """Apply the staleness rule to one group.

    Args:
        versions: the group's summary (``group_versions``).
        current: the policy's current version, or None before the first publish (filter off).
        max_staleness: the largest staleness kept, or None to measure without filtering.
        unknown: ``stale`` judges a group with a non-version label, or no label, ``unknown_version``;
            ``ignore`` skips non-numeric labels as miles does.
        regressed: ``current`` is the host's own version after it went backwards (see the module): a
            label above it is judged stale and does not raise it.

    Raises:
        ValueError: ``unknown`` is not ``stale`` or ``ignore``, or ``max_staleness`` is negative.
    """
    if unknown not in UNKNOWN_POLICIES:
        raise ValueError(f"unknown must be 'stale' or 'ignore', got {unknown!r}")
    if max_staleness is not None and max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
    if current is None:
        return Verdict(Reason.UNMEASURED, None, None)
    behind = versions.newest is not None and versions.newest > current
    if behind and regressed:
        return Verdict(Reason.STALE, None, current)
    if behind:
        current = versions.newest
    if unknown == "stale" and (versions.unknown or not versions.labelled):
        reason = Reason.UNMEASURED if max_staleness is None else Reason.UNKNOWN_VERSION
        return Verdict(reason, None, current, behind)
    s = staleness(current, versions.oldest)
    if s is None:
        return Verdict(Reason.UNMEASURED, None, current, behind)
    if max_staleness is not None and s > max_staleness:
        return Verdict(Reason.STALE, s, current, behind)
    return Verdict(Reason.FRESH, s, current, behind)
