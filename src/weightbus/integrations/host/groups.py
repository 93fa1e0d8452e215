"""A host's groups as weightbus sees them: the conversion the staleness rule and the waste accounts read.

miles and slime share one ``Sample`` shape; only the attributes weightbus reads are copied, by name, so either
host's ``Sample`` (or a stand-in) converts; no host is imported.
"""

from __future__ import annotations

from typing import Any, Final

from weightbus.rules.staleness import group_versions
from weightbus.schemas.rollouts import Group, Sample, SampleStatus

__all__ = ["group_key", "group_versions_of", "to_weightbus_group"]

_STATUSES: Final = {s.value for s in SampleStatus}


def _status(sample: Any) -> SampleStatus:
    status = getattr(sample, "status", None)
    value = getattr(status, "value", status)
    return SampleStatus(value) if isinstance(value, str) and value in _STATUSES else SampleStatus.PENDING


def _convert(sample: Any, fallback_index: int) -> Sample:
    index = getattr(sample, "index", None)
    labels = [v if isinstance(v, str) else str(v) for v in (getattr(sample, "weight_versions", None) or [])]
    length = getattr(sample, "response_length", 0)
    reward = getattr(sample, "reward", None)
    return Sample(
        index=index if isinstance(index, int) else fallback_index,
        weight_versions=labels,
        status=_status(sample),
        # For the waste and bias accounts only; a reward that is not one number (a dict of rewards) is left out.
        response_length=length if isinstance(length, int) and not isinstance(length, bool) and length >= 0 else 0,
        reward=float(reward) if isinstance(reward, int | float) and not isinstance(reward, bool) else None,
    )


def to_weightbus_group(group: list[Any], metadata: dict[str, Any] | None = None) -> Group:
    """A host's group (``list[Sample | list[Sample]]``; a nested list is one trajectory) as a weightbus ``Group``.

    Only what the staleness rule and the waste accounts read is carried over: each sample's ``index``,
    ``weight_versions`` (one label per generate call or turn), ``status``, ``response_length`` and a numeric
    ``reward``; ``metadata`` goes on the group as is.
    """
    flat: list[Sample] = []
    trajectories: list[list[Sample]] = []
    n = 0
    for item in group:
        if isinstance(item, list):
            trajectory = []
            for sample in item:
                trajectory.append(_convert(sample, n))
                n += 1
            trajectories.append(trajectory)
        else:
            flat.append(_convert(item, n))
            n += 1
    first = flat[0].index if flat else trajectories[0][0].index if trajectories and trajectories[0] else 0
    return Group(prompt_index=first, samples=flat, trajectories=trajectories, metadata=metadata or {})


def group_versions_of(group: list[Any]) -> Any:
    """``group_versions`` of a host's group: the oldest and newest version over every sample and turn."""
    return group_versions(to_weightbus_group(group))


def group_key(group: list[Any]) -> int | None:
    """The ``group_index`` of a host group's first sample (the hosts' data sources give a group's samples one)."""
    first = group[0] if group else None
    if isinstance(first, list):
        first = first[0] if first else None
    key = getattr(first, "group_index", None)
    return key if isinstance(key, int) and not isinstance(key, bool) else None
