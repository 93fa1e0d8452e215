"""The version follower's rule, as a pure function: state + incoming weight event → new state + action.

Invariants ``decide`` keeps (no I/O, no clock; ``VersionTracker`` and the monitor both use it):

* A version never moves down silently: a ``WeightUpdated`` below the held version is a regression,
  handled by the mode: ``hold`` keeps the held state, ``follow`` takes the incoming one, ``raise``
  keeps the held state and tells the caller to raise.
* A higher version is accepted whatever its epoch: a new epoch with a higher version is an ordinary
  takeover. The same version again is accepted without change (re-delivery after a resubscribe, or a
  new owner repeating the current version); only its epoch and publisher are noted.
* A ``PublisherClaimed`` repeats the current version: it notes the new epoch and publisher, and sets
  the version only when none is held or the held one is behind (the claim is the counter's truth).
  It is never an update (no lag, no ``updated_at``) and never a regression on its own.
* ``updated_at`` is the ``published_at`` of the last accepted ``WeightUpdated`` that set the version.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from weightbus.schemas.weights import PublisherClaimed, WeightUpdated

__all__ = ["RegressionMode", "TrackerAction", "TrackerDecision", "TrackerState", "decide"]


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
    """A higher version."""
    REPEATED = "repeated"
    """The held version again; nothing but epoch and publisher may change."""
    CLAIMED = "claimed"
    """A takeover claim: epoch and publisher noted; the version set only if none was held or it was behind."""
    HELD = "held"
    """A lower version, ignored (``hold``)."""
    FOLLOWED = "followed"
    """A lower version, taken (``follow``)."""
    RAISED = "raised"
    """A lower version in ``raise`` mode: state unchanged, the caller raises."""


_REGRESSIONS = frozenset({TrackerAction.HELD, TrackerAction.FOLLOWED, TrackerAction.RAISED})
_UPDATES = frozenset({TrackerAction.ADOPTED, TrackerAction.ADVANCED, TrackerAction.FOLLOWED})
_MODE_ACTION = {
    RegressionMode.HOLD: TrackerAction.HELD,
    RegressionMode.FOLLOW: TrackerAction.FOLLOWED,
    RegressionMode.RAISE: TrackerAction.RAISED,
}


@dataclass(frozen=True, slots=True)
class TrackerState:
    """What a follower knows about a policy's current weights.

    Attributes:
        version: the current version, or None while the policy has never published one.
        epoch: the publisher epoch of the latest accepted event (update or claim).
        publisher: the trainer id of the latest accepted event.
        updated_at: ``published_at`` of the last ``WeightUpdated`` that set the version.
    """

    version: int | None = None
    epoch: int | None = None
    publisher: str | None = None
    updated_at: float | None = None


@dataclass(frozen=True, slots=True)
class TrackerDecision:
    """The outcome of one event: the action, the state before and after, and the incoming version."""

    action: TrackerAction
    state: TrackerState
    previous: TrackerState
    incoming: int | None

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
    def claim_behind(self) -> bool:
        """Whether a claim named a lower version than the held one (a hint that a regression may follow)."""
        return (
            self.action is TrackerAction.CLAIMED
            and self.incoming is not None
            and self.previous.version is not None
            and self.incoming < self.previous.version
        )


def decide(
    state: TrackerState, event: WeightUpdated | PublisherClaimed, mode: RegressionMode = RegressionMode.HOLD
) -> TrackerDecision:
    """Apply one weights-family event to ``state``.

    Args:
        state: what is known before the event.
        event: a ``WeightUpdated`` or ``PublisherClaimed`` of the same policy.
        mode: how a lower version is handled.

    Raises:
        TypeError: ``event`` is not a weights-family event.
    """
    match event:
        case WeightUpdated(version=incoming):
            current = state.version
            taken = TrackerState(incoming, event.epoch, event.trainer_id, event.published_at)
            if current is None:
                return TrackerDecision(TrackerAction.ADOPTED, taken, state, incoming)
            if incoming > current:
                return TrackerDecision(TrackerAction.ADVANCED, taken, state, incoming)
            if incoming == current:
                noted = TrackerState(current, event.epoch, event.trainer_id, state.updated_at)
                return TrackerDecision(TrackerAction.REPEATED, noted, state, incoming)
            action = _MODE_ACTION[mode]
            return TrackerDecision(action, taken if action is TrackerAction.FOLLOWED else state, state, incoming)
        case PublisherClaimed(version=claimed):
            version = state.version
            if claimed is not None and (version is None or claimed > version):
                version = claimed
            noted = TrackerState(version, event.epoch, event.trainer_id, state.updated_at)
            return TrackerDecision(TrackerAction.CLAIMED, noted, state, claimed)
    raise TypeError(f"not a weights-family event: {type(event).__name__}")
