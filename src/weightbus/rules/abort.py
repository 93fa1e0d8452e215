"""The early-abort rule: is a group still generating already certain to be judged stale?

A drain judges a group against a version that only goes forward (the tracker's latest, raised to
any newer label seen), and the group's staleness is ``current - oldest`` where ``oldest`` is the
minimum over every label the group will carry. So once some label of the group is known (a finished
request's ``weight_version``, or an older token span), that label bounds ``oldest`` from above, the
version the tracker holds now bounds the drain's ``current`` from below, and the group is certain
to be stale when the gap already exceeds the bound. Invariants:

* only certainty aborts: no known label (nothing finished yet), no current version (never
  published: the filter is off) or no bound (``max_staleness is None``) never abort;
* the rule is monotonic: a newer ``current``, an older label or a tighter bound can only turn a
  "keep generating" into an abort, never the reverse;
* ``certain_stale`` agrees with ``staleness.judge``: whenever it says True, ``judge`` calls a
  group holding that label stale at any current at least as new (a property test pins this).
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
