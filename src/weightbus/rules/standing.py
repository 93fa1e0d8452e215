"""The re-claim rule: may a publisher that was fenced claim the counter again? Pure: no I/O, no clock.

Only the host's failover order decides (``ClaimStanding``): the owner's standing in the same scope and a strictly
higher ``(term, rank)``; no standing, another scope, or no retained claim or mark keeps the fence.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightbus.rules.history import StoredEvent, WeightsHistory, fold_history
from weightbus.schemas.weights import ClaimStanding, PublisherClaimed

__all__ = ["outranks", "owner_claim", "owner_standing"]


def outranks(claimant: ClaimStanding | None, owner: ClaimStanding | None) -> bool:
    """Whether a fenced publisher at ``claimant`` may claim again over an owner that claimed at ``owner``.

    True only when both are known, of the same scope, and the claimant's ``(term, rank)`` is above
    the owner's.
    """
    if claimant is None or owner is None or claimant.scope != owner.scope:
        return False
    return (claimant.term, claimant.rank) > (owner.term, owner.rank)


def owner_claim(
    policy: str, events: Sequence[StoredEvent], *, marks: Sequence[StoredEvent] = ()
) -> PublisherClaimed | None:
    """The claim of the counter's owner by the trackers' rule (``fold_history``), if the history still holds it.

    ``marks`` are the counter subject's retained events: the trackers fold with them (a claim may
    resume one above a credited mark), so the owner is the one they hold.
    """
    stored = list(events)
    return _owner_claim(fold_history(policy, stored, marks=marks), stored)


def owner_standing(
    policy: str, events: Sequence[StoredEvent], *, marks: Sequence[StoredEvent] = ()
) -> ClaimStanding | None:
    """The standing the counter's owner claimed with: from its claim, or from its mark once the claim was evicted.

    Only a mark the mark rule credits counts (``rules.marks``: explained by the chain, not
    superseded), and only when it is the owner's (its epoch, incarnation and trainer id): a mark
    that rule refuses says nothing here either, whatever standing it carries. None when neither is
    retained, or the owner claimed without one.

    Args:
        policy: the policy id.
        events: the weights subject's retained events, oldest first.
        marks: the counter subject's retained events (same stream), oldest first.
    """
    stored = list(events)
    folded = fold_history(policy, stored, marks=marks)
    claim = _owner_claim(folded, stored)
    if claim is not None:
        return claim.standing
    state, mark = folded.state, folded.mark
    if mark is not None and (mark.epoch, mark.incarnation, mark.trainer_id) == (
        state.epoch,
        state.incarnation,
        state.publisher,
    ):
        return mark.standing
    return None


def _owner_claim(folded: WeightsHistory, stored: Sequence[StoredEvent]) -> PublisherClaimed | None:
    state = folded.state
    if not state.has_owner:
        return None
    for env in reversed(stored):
        event = env.event
        if isinstance(event, PublisherClaimed) and state.owns(event):
            return event
    return None
