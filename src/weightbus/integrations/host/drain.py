"""The staleness stage a host's rollout half judges with: one reading of the drain settings for every host.

``WEIGHTBUS_UNKNOWN`` (``stale``, the default, or ``ignore``) means the same in every host; the bound and what
happens to groups not kept are the host's to say (its own flags, or weightbus' where it has none). The stage is
``consumers.drain.StalenessStage``; nothing here judges a group.
"""

from __future__ import annotations

from typing import Any

from weightbus.consumers.drain.metrics import DrainMetrics
from weightbus.consumers.drain.stage import OnStale, StalenessStage
from weightbus.integrations.host.settings import setting
from weightbus.rules.staleness import UNKNOWN_POLICIES

__all__ = ["staleness_stage"]


def staleness_stage(
    args: Any, *, max_staleness: int | None, on_stale: OnStale, metrics: DrainMetrics | None = None
) -> StalenessStage:
    """The drain's configuration: ``max_staleness`` and ``on_stale`` from the host, the unknown-label policy from
    ``args.weightbus_unknown`` / ``WEIGHTBUS_UNKNOWN``.

    Raises:
        ValueError: an unknown-label policy other than ``stale`` or ``ignore``, or a bad bound.
    """
    unknown = setting(args, "weightbus_unknown", "WEIGHTBUS_UNKNOWN", "stale")
    if unknown not in UNKNOWN_POLICIES:
        raise ValueError(f"WEIGHTBUS_UNKNOWN must be 'stale' or 'ignore', not {unknown!r}")
    return StalenessStage(
        max_staleness=max_staleness,
        on_stale=on_stale,
        unknown=unknown,  # type: ignore[arg-type]  # checked above
        metrics=metrics,
    )
