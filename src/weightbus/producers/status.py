"""Read-only status of a policy's counter: the current version, epoch and publisher, and engine read-backs.

It never publishes or claims (never fences a trainer) and folds the history with the trackers' rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from weightbus.bus import subjects
from weightbus.bus.history import read_subject_history
from weightbus.bus.protocol import Bus
from weightbus.errors import EngineError, InvalidEventError
from weightbus.producers.fleet import EngineFleet
from weightbus.rules.history import WeightsHistory, fold_history
from weightbus.schemas import LoraAdapter, PublisherClaimed, VersionReserved, WeightUpdated, now

__all__ = ["EngineReadBack", "PolicyStatus", "read_status", "read_weights_history"]


@dataclass(frozen=True, slots=True)
class EngineReadBack:
    """One engine's live ``weight_version`` (None with ``error`` when it did not answer)."""

    engine: str
    weight_version: str | None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class PolicyStatus:
    """What the weights subject of a policy says now.

    Attributes:
        policy: the policy id.
        version: the current version (None: never published).
        epoch: the current owner's epoch (None: never claimed).
        publisher: the current owner's trainer id.
        last_event: ``updated`` (a ``WeightUpdated``), ``claimed`` (a ``PublisherClaimed``),
            ``reserved`` (a ``VersionReserved``: an update in flight, or one that failed), or None.
        published_at: Unix time of the last event.
        age_s: seconds since the last event.
        lora: the adapter of the last update, if it was a LoRA push.
        seq: the stream sequence of the last event.
        engines: the engines' read-backs, when engines were given.
        rejected: the newest stored event trackers do not accept (``"<reason>: <summary>"``), else None.
        invalid: stored payloads that failed the decode (skipped).
    """

    policy: str
    version: int | None = None
    epoch: int | None = None
    publisher: str | None = None
    last_event: str | None = None
    published_at: float | None = None
    age_s: float | None = None
    lora: LoraAdapter | None = None
    seq: int | None = None
    engines: list[EngineReadBack] = field(default_factory=list)
    rejected: str | None = None
    invalid: int = 0

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict (``lora`` as ``{"name", "path"}``, engines as a list of dicts)."""
        return {
            "policy": self.policy,
            "version": self.version,
            "epoch": self.epoch,
            "publisher": self.publisher,
            "last_event": self.last_event,
            "published_at": self.published_at,
            "age_s": self.age_s,
            "lora": None if self.lora is None else {"name": self.lora.name, "path": self.lora.path},
            "seq": self.seq,
            "engines": [
                {"engine": e.engine, "weight_version": e.weight_version, "error": e.error} for e in self.engines
            ],
            "rejected": self.rejected,
            "invalid": self.invalid,
        }


async def read_status(bus: Bus, policy: str, *, fleet: EngineFleet | None = None) -> PolicyStatus:
    """Fold the retained history of ``weights(policy)`` as trackers do and, given a fleet, read each engine.

    Raises:
        InvalidPolicyError: ``policy`` is not a valid policy id.
        BusError: the bus did not answer.
    """
    history = await read_weights_history(bus, policy)
    engines: list[EngineReadBack] = []
    if fleet is not None:
        for url, result in (await fleet.read_versions()).items():
            if isinstance(result, EngineError):
                engines.append(EngineReadBack(url, None, str(result)))
            else:
                engines.append(EngineReadBack(url, result))
    rejected: str | None = None
    if history.rejected:
        r = history.rejected[-1]
        rejected = f"{r.reason or 'regression'}: {r.event_type} v{r.version} by {r.trainer_id}"
    event = history.last_accepted
    if event is None:
        return PolicyStatus(policy, engines=engines, rejected=rejected, invalid=history.invalid_count)
    kind = {WeightUpdated: "updated", PublisherClaimed: "claimed", VersionReserved: "reserved"}[type(event)]
    state = history.state
    return PolicyStatus(
        policy,
        version=state.version,
        epoch=state.epoch,
        publisher=state.publisher,
        last_event=kind,
        published_at=event.published_at,
        age_s=max(0.0, now() - event.published_at),
        lora=history.last_update.lora if history.last_update is not None else None,
        seq=history.last_accepted_seq,
        engines=engines,
        rejected=rejected,
        invalid=history.invalid_count,
    )


async def read_weights_history(bus: Bus, policy: str, *, timeout: float = 10.0) -> WeightsHistory:
    """Read the retained history of ``weights(policy)`` and fold it with the trackers' rule.

    Raises:
        InvalidPolicyError: ``policy`` is not a valid policy id.
        BusError: the bus did not answer, or the history did not arrive within ``timeout`` seconds.
    """
    # The marks first: every event that explains one was stored before the history read after it.
    marks = await read_subject_history(bus, subjects.counter(policy), timeout=timeout)
    history = await read_subject_history(bus, subjects.weights(policy), timeout=timeout)
    invalid: InvalidEventError | None = None
    if history.invalid_seqs and history.invalid_seqs[-1] == history.last_seq:
        invalid = history.last_error
    return fold_history(policy, history.events, invalid=invalid, invalid_count=history.invalid, marks=marks.events)
