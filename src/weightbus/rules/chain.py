"""The version follower's rule, as a pure function: state + incoming weights event → new state + action.

``decide`` is the one rule trackers, ``status``, ``watch`` and the publisher's resume apply; the owner is the latest
accepted claimant; rejected events change nothing. The rule and why: docs/design.md#chain-validation.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec
from msgspec.structs import replace

from weightbus.schemas.alerts import RejectReason
from weightbus.schemas.common import MAX_VERSION
from weightbus.schemas.weights import PublisherClaimed, VersionReserved, WeightUpdated

__all__ = [
    "UNANNOUNCED_LIMIT",
    "RegressionMode",
    "TrackerAction",
    "TrackerDecision",
    "TrackerState",
    "WeightsEvent",
    "decide",
]

WeightsEvent = WeightUpdated | PublisherClaimed | VersionReserved

#: How many skipped numbers a state keeps for the lineage check; past it, its span starts after the oldest kept.
UNANNOUNCED_LIMIT = 64


class RegressionMode(StrEnum):
    """What a tracker does with a version lower than the one it holds (always logged, counted, alerted)."""

    HOLD = "hold"
    """Keep the higher version (the default): staleness stays measured against the newest weights seen."""
    FOLLOW = "follow"
    """Move to the lower version: trust the publisher (e.g. a deliberate reset)."""
    RAISE = "raise"
    """Keep the higher version and fail: waiters and iterators get ``VersionRegressionError``."""


class TrackerAction(StrEnum):
    """What ``decide`` did with one event."""

    ADOPTED = "adopted"
    """The first version this state learned, from a ``WeightUpdated``."""
    ADVANCED = "advanced"
    """A higher version from the owner."""
    REPEATED = "repeated"
    """The held version again; nothing changes."""
    CLAIMED = "claimed"
    """A takeover claim: the owner changes; the version rises (by one at most) if the claim names a higher one."""
    RESERVED = "reserved"
    """The owner reserved a number; the version does not change."""
    HELD = "held"
    """A lower version, ignored (``hold``)."""
    FOLLOWED = "followed"
    """A lower version, taken (``follow``)."""
    RAISED = "raised"
    """A lower version in ``raise`` mode: state unchanged, the caller raises."""
    REJECTED = "rejected"
    """An event the chain does not explain (see ``TrackerDecision.reason``): state unchanged."""


_REGRESSIONS = frozenset({TrackerAction.HELD, TrackerAction.FOLLOWED, TrackerAction.RAISED})
_UPDATES = frozenset({TrackerAction.ADOPTED, TrackerAction.ADVANCED, TrackerAction.FOLLOWED})
_MODE_ACTION = {
    RegressionMode.HOLD: TrackerAction.HELD,
    RegressionMode.FOLLOW: TrackerAction.FOLLOWED,
    RegressionMode.RAISE: TrackerAction.RAISED,
}


class TrackerState(msgspec.Struct, frozen=True):
    """What a follower knows about a policy's current weights.

    Attributes:
        version: the current version, or None while the policy has never announced one.
        epoch: the owner's epoch.
        publisher: the owner's trainer id.
        updated_at: ``published_at`` of the last ``WeightUpdated`` that set the version.
        incarnation: the owner's incarnation ("" for publishers that predate incarnations).
        reserved: the highest number the owner reserved or a claim said was issued.
        announced_since: every number from it up to ``version`` was announced, but ``unannounced``; None: the
            state vouches for none. It restarts where the state cannot vouch for what came before (its first
            version, a rebase, a followed regression). A delta's base is checked against this span.
        unannounced: the numbers of that span the chain skipped (reserved, never announced), oldest first; at
            most ``UNANNOUNCED_LIMIT``.
        digest: the manifest digest the announcement of ``version`` carried (``WeightArtifact.manifest_digest``),
            or None; a repeated announcement of ``version`` with another digest names other weights.
    """

    version: int | None = None
    epoch: int | None = None
    publisher: str | None = None
    updated_at: float | None = None
    incarnation: str | None = None
    reserved: int | None = None
    announced_since: int | None = None
    unannounced: tuple[int, ...] = ()
    digest: str | None = None

    @property
    def has_owner(self) -> bool:
        """Whether an owner is known (any valid weights event was accepted)."""
        return self.epoch is not None

    def owns(self, event: WeightsEvent) -> bool:
        """Whether ``event`` comes from the owner (epoch, incarnation and trainer id all match)."""
        return (
            event.epoch == self.epoch and event.incarnation == self.incarnation and event.trainer_id == self.publisher
        )


class TrackerDecision(msgspec.Struct, frozen=True):
    """The outcome of one event: the action, the state before and after, the incoming version, and why.

    ``reason`` names a rejection (``not_owner``, ``stale_claim``, ``unexplained_jump``,
    ``unexplained_claim``, ``unexplained_base``) or a ``counter_reset`` claim; it is None otherwise.
    ``unverified_base`` is set when an update taken is a delta whose base the state cannot vouch for (older
    than what it saw, or after a gap): taken, since refusing it would hold older weights as current, and
    reported loudly by the caller.
    """

    action: TrackerAction
    state: TrackerState
    previous: TrackerState
    incoming: int | None
    reason: RejectReason | None = None
    unverified_base: bool = False

    @property
    def changed(self) -> bool:
        """Whether the held version changed."""
        return self.state.version != self.previous.version

    @property
    def is_regression(self) -> bool:
        """Whether the event carried a lower version than the held one (whatever the mode did)."""
        return self.action in _REGRESSIONS

    @property
    def is_update(self) -> bool:
        """Whether a ``WeightUpdated`` set the version (its lag and timestamp are meaningful)."""
        return self.action in _UPDATES

    @property
    def alert(self) -> bool:
        """Whether the event deserves an alert (a regression, a rejection or a counter reset)."""
        return self.is_regression or self.reason is not None

    @property
    def claim_behind(self) -> bool:
        """Whether a claim named a lower version than the held one (a counter reset)."""
        return self.reason == "counter_reset"


def _owner_of(state: TrackerState, event: WeightsEvent) -> TrackerState:
    return replace(state, epoch=event.epoch, publisher=event.trainer_id, incarnation=event.incarnation)


def _max(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


def decide(
    state: TrackerState,
    event: WeightsEvent,
    mode: RegressionMode = RegressionMode.HOLD,
    *,
    rebase: bool = False,
    issued: int | None = None,
) -> TrackerDecision:
    """Apply one weights-family event to ``state``.

    Args:
        state: what is known before the event.
        event: a ``WeightUpdated``, ``PublisherClaimed`` or ``VersionReserved`` of the same policy.
        mode: how a lower version is handled.
        rebase: the follower missed events (its history was evicted while it was away): a claim, and
            the owner's next reservation or update, may jump, as the first event of a fresh follower may.
        issued: the highest number known to be issued from outside the chain (the counter's high-water
            mark, as far as ``rules.marks`` credits it): a claim may resume one above it, as above the
            highest number the chain has seen.

    Raises:
        TypeError: ``event`` is not a weights-family event.
    """
    match event:
        case WeightUpdated(version=incoming):
            return _updated(state, event, incoming, mode, rebase)
        case VersionReserved(version=incoming):
            if not state.has_owner:
                first = replace(_owner_of(state, event), reserved=incoming)
                return TrackerDecision(TrackerAction.RESERVED, first, state, incoming)
            if not state.owns(event):
                return TrackerDecision(TrackerAction.REJECTED, state, state, incoming, "not_owner")
            ceiling = max(state.reserved or 0, state.version or 0) + 1
            if incoming > ceiling and not rebase:
                return TrackerDecision(TrackerAction.REJECTED, state, state, incoming, "unexplained_jump")
            noted = TrackerState(
                state.version,
                state.epoch,
                state.publisher,
                state.updated_at,
                state.incarnation,
                _max(state.reserved, incoming),
                state.announced_since,
                state.unannounced,
                state.digest,
            )
            return TrackerDecision(TrackerAction.RESERVED, noted, state, incoming)
        case PublisherClaimed(version=claimed):
            supersedes = (
                not state.has_owner
                or event.epoch > state.epoch  # type: ignore[operator]  # has_owner: epoch is an int
                or event.previous_trainer_id is None
            )
            if not supersedes:
                return TrackerDecision(TrackerAction.REJECTED, state, state, claimed, "stale_claim")
            if state.has_owner and not rebase:
                ceiling = max(state.reserved or 0, state.version or 0, issued or 0) + 1
                if max(claimed or 0, event.reserved or 0) > ceiling:
                    return TrackerDecision(TrackerAction.REJECTED, state, state, claimed, "unexplained_claim")
            held = state.version
            version = held if claimed is None or (held is not None and claimed <= held) else claimed
            since, unannounced = state.announced_since, state.unannounced
            if version != held and version is not None:  # the claimant vouches that it was announced
                since, unannounced = _span(state, version) if state.has_owner and not rebase else (version, ())
            noted = replace(
                _owner_of(state, event),
                version=version,
                reserved=_max(_max(state.reserved, event.reserved), claimed),
                announced_since=since,
                unannounced=unannounced,
            )
            behind = held is not None and (claimed is None or claimed < held)
            return TrackerDecision(TrackerAction.CLAIMED, noted, state, claimed, "counter_reset" if behind else None)
    raise TypeError(f"not a weights-family event: {type(event).__name__}")


def _span(state: TrackerState, new: int) -> tuple[int | None, tuple[int, ...]]:
    """``announced_since`` and ``unannounced`` once ``new`` (above the held version) is announced next."""
    since, held = state.announced_since, state.version
    if since is None or held is None:
        return new, ()
    if new == held + 1:  # the common case: nothing skipped, nothing to copy
        return since, state.unannounced
    if new - held - 1 > UNANNOUNCED_LIMIT:
        return new, ()
    skipped = (*state.unannounced, *range(held + 1, new))
    if len(skipped) > UNANNOUNCED_LIMIT:
        return skipped[-UNANNOUNCED_LIMIT - 1] + 1, skipped[-UNANNOUNCED_LIMIT:]
    return since, skipped


def _restart(event: WeightUpdated, reserved: int | None, digest: str | None) -> TrackerState:
    """The state after ``event`` when nothing before it can be vouched for: its span starts at its version."""
    v = event.version
    e = event
    return TrackerState(v, e.epoch, e.trainer_id, e.published_at, e.incarnation, reserved, v, (), digest)


def _updated(
    state: TrackerState, event: WeightUpdated, incoming: int, mode: RegressionMode, rebase: bool
) -> TrackerDecision:
    current = state.version
    artifact = event.artifact
    base, digest = (None, None) if artifact is None else (artifact.base, artifact.manifest_digest)
    reserved = _max(state.reserved, incoming + 1 if event.reserves_next and incoming < MAX_VERSION else incoming)
    if current is not None and incoming < current:
        action = _MODE_ACTION[mode]
        if action is not TrackerAction.FOLLOWED:
            return TrackerDecision(action, state, state, incoming)
        # A counter reset: the numbers above may name other weights now; the span restarts here.
        return TrackerDecision(action, _restart(event, reserved, digest), state, incoming, None, base is not None)
    if not state.has_owner:
        first = _restart(event, reserved, digest)
        return TrackerDecision(TrackerAction.ADOPTED, first, state, incoming, None, base is not None)
    if not state.owns(event):
        return TrackerDecision(TrackerAction.REJECTED, state, state, incoming, "not_owner")
    if incoming == current:
        if digest is not None and state.digest is not None and digest != state.digest:
            # The same number announced for other bytes: one of the two names weights the other does not.
            return TrackerDecision(TrackerAction.REJECTED, state, state, incoming, "conflicting_artifact")
        if digest is not None and state.digest is None:
            return TrackerDecision(TrackerAction.REPEATED, replace(state, digest=digest), state, incoming)
        return TrackerDecision(TrackerAction.REPEATED, state, state, incoming)
    explained = rebase or incoming == (current or 0) + 1 or (state.reserved is not None and incoming <= state.reserved)
    if not explained:
        return TrackerDecision(TrackerAction.REJECTED, state, state, incoming, "unexplained_jump")
    unverified = False
    if base is not None:
        since = state.announced_since
        seen = since is not None and current is not None and base >= since  # inside the span this state saw
        if not seen or base > current or base in state.unannounced:  # type: ignore[operator]  # seen: current is set
            # In the span, every announcement was seen: a base there that is not one was never announced (a
            # skipped reservation, a refused update). Before it, or after a gap (a rebase), nothing is known.
            if seen and not rebase:
                return TrackerDecision(TrackerAction.REJECTED, state, state, incoming, "unexplained_base")
            unverified = True
    since, unannounced = (incoming, ()) if rebase else _span(state, incoming)
    # The constructor, not replace(): this runs once per received update.
    taken = TrackerState(
        incoming,
        event.epoch,
        event.trainer_id,
        event.published_at,
        event.incarnation,
        reserved,
        since,
        unannounced,
        digest,
    )
    action = TrackerAction.ADOPTED if current is None else TrackerAction.ADVANCED
    return TrackerDecision(action, taken, state, incoming, None, unverified)
