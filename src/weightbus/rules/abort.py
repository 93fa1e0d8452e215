"""The early-abort rule: is a group still generating already certain to be judged stale?

Only certainty aborts (no known label, no current version or no bound never does); the rule is monotonic, and
whenever it says True, ``staleness.judge`` calls the group stale (property-tested).
"""

from __future__ import annotations

__all__ = ["certain_stale", "oldest_bound"]


def oldest_bound(labels: list[int | None]) -> int | None:
    """The smallest known version among ``labels`` (None entries are requests not finished or not
    numeric): an upper bound on the oldest version the group will hold, or None when nothing is known."""
    known = [v for v in labels if v is not None]
    return min(known) if known else None


def certain_stale(oldest: int | None, current: int | None, max_staleness: int | None) -> bool:
    """Whether a group whose oldest version is at most ``oldest`` must be stale at ``current`` or later.

    Args:
        oldest: an upper bound on the group's oldest version (``oldest_bound``), or None if unknown.
        current: the version the tracker holds now (a drain's current is at least this), or None.
        max_staleness: the largest staleness the drain keeps, or None (no filtering).

    Raises:
        ValueError: ``max_staleness`` is negative.
    """
    if max_staleness is not None and max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
    if oldest is None or current is None or max_staleness is None:
        return False
    return current - oldest > max_staleness
