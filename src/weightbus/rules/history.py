"""The pure fold of a policy's weights history with the chain rule: what every tracker holds now.

``status``, ``publish``'s liveness check and the publisher's resume fold the stored events with ``chain.decide`` in
``hold`` mode and judge marks in stream order (``rules.marks``), exactly as a tracker starting now would.
See docs/design.md#chain-validation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from weightbus.errors import InvalidEventError
from weightbus.rules.chain import RegressionMode, TrackerAction, TrackerDecision, TrackerState, decide
from weightbus.rules.marks import MarkJudge, UnexplainedMark
from weightbus.schemas import CounterHighWater, PublisherClaimed, VersionReserved, WeightUpdated

__all__ = ["RejectedEvent", "StoredEvent", "WeightsHistory", "fold_history"]


class StoredEvent(Protocol):
    """One stored event as the fold reads it (``weightbus.bus.Envelope`` is one)."""

    @property
    def seq(self) -> int | None: ...

    @property
    def event(self) -> object: ...


@dataclass(frozen=True, slots=True)
class RejectedEvent:
    """One stored event the tracker rule refused: its version, who published it, and what was held."""

    seq: int | None
    version: int | None
    held: int | None
    epoch: int
    trainer_id: str
    published_at: float
    action: str
    reason: str | None = None
    """``not_owner``, ``unexplained_jump``, ``stale_claim`` for a rejection; None for a lower version."""
    event_type: str = ""


@dataclass(frozen=True, slots=True)
class WeightsHistory:
    """The fold of a weights subject's retained history.

    Attributes:
        policy: the policy id.
        state: what a tracker holds after the history (version None: never published).
        last_accepted: the newest event the rule accepted (a ``WeightUpdated`` or ``PublisherClaimed``).
        last_accepted_seq: its stream sequence.
        rejected: every refused event, oldest first.
        latest_rejected: the newest stored event was refused.
        invalid: the decode error of the newest stored event, when it is not a valid event.
        events: how many valid events were folded.
        last_update: the newest accepted ``WeightUpdated`` (its ``lora`` names the adapter served).
        epoch_high: the highest epoch of any valid event, accepted or not (a claimant must go above it).
        invalid_count: stored payloads that failed the decode (skipped).
        issued: the credited high-water mark (``rules.marks``): every number up to it was issued or
            reserved (None: no mark credited).
        mark: the credited mark itself (its ``announced``: the last version announced and acknowledged).
        unexplained_marks: every stored mark the rule refused (never credited), oldest first.
        updates: every retained ``WeightUpdated`` the rule took as a new version, oldest first: the versions
            trackers hold were announced (what a catch-up reads the artifacts of).
    """

    policy: str
    state: TrackerState = TrackerState()
    last_accepted: WeightUpdated | PublisherClaimed | VersionReserved | None = None
    last_accepted_seq: int | None = None
    rejected: list[RejectedEvent] = field(default_factory=list)
    latest_rejected: bool = False
    invalid: InvalidEventError | None = None
    events: int = 0
    last_update: WeightUpdated | None = None
    epoch_high: int = -1
    invalid_count: int = 0
    issued: int | None = None
    mark: CounterHighWater | None = None
    unexplained_marks: list[UnexplainedMark] = field(default_factory=list)
    updates: list[WeightUpdated] = field(default_factory=list)


def fold_history(
    policy: str,
    envelopes: Sequence[StoredEvent],
    *,
    invalid: InvalidEventError | None = None,
    invalid_count: int = 0,
    marks: Sequence[StoredEvent] = (),
) -> WeightsHistory:
    """Fold ``envelopes`` (oldest first) of ``weights(policy)`` with ``decide`` in ``hold`` mode.

    Events of another policy or another family are ignored. ``marks`` are the counter subject's
    retained events (oldest first, same stream): each is judged where it was stored (``rules.marks``).
    """
    judge = MarkJudge(policy, marks)
    state = TrackerState()
    last: WeightUpdated | PublisherClaimed | VersionReserved | None = None
    last_seq: int | None = None
    rejected: list[RejectedEvent] = []
    latest_rejected = False
    events = 0
    last_update: WeightUpdated | None = None
    updates: list[WeightUpdated] = []
    epoch_high = -1
    for env in envelopes:
        event = env.event
        if not isinstance(event, WeightUpdated | PublisherClaimed | VersionReserved) or event.policy != policy:
            continue
        events += 1
        epoch_high = max(epoch_high, event.epoch)
        judge.before(env.seq, state)
        decision: TrackerDecision = decide(state, event, RegressionMode.HOLD, issued=judge.issued)
        if decision.is_regression or decision.action is TrackerAction.REJECTED:
            rejected.append(
                RejectedEvent(
                    seq=env.seq,
                    version=decision.incoming,
                    held=decision.previous.version,
                    epoch=event.epoch,
                    trainer_id=event.trainer_id,
                    published_at=event.published_at,
                    action=str(decision.action),
                    reason=decision.reason,
                    event_type=type(event).__name__,
                )
            )
            latest_rejected = True
            continue
        state, last, last_seq, latest_rejected = decision.state, event, env.seq, False
        if isinstance(event, WeightUpdated) and decision.changed:
            last_update = event
            updates.append(event)
    judge.settle(state)
    return WeightsHistory(
        policy,
        state,
        last,
        last_seq,
        rejected,
        latest_rejected,
        invalid,
        events,
        last_update,
        epoch_high,
        invalid_count,
        judge.issued,
        judge.mark,
        judge.unexplained,
        updates,
    )
