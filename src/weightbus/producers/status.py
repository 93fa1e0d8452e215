"""Read-only status of a policy's counter: the current version, epoch and publisher, and engine read-backs.

Nothing here publishes or claims: reading the status never fences a running trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from weightbus.bus import subjects
from weightbus.bus.protocol import Bus
from weightbus.errors import EngineError
from weightbus.producers.stamping import EngineFleet
from weightbus.schemas import LoraAdapter, PublisherClaimed, WeightUpdated, now

__all__ = ["EngineReadBack", "PolicyStatus", "read_status"]


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
        last_event: ``updated`` (a ``WeightUpdated``), ``claimed`` (a ``PublisherClaimed``), or None.
        published_at: Unix time of the last event.
        age_s: seconds since the last event.
        lora: the adapter of the last update, if it was a LoRA push.
        seq: the stream sequence of the last event.
        engines: the engines' read-backs, when engines were given.
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
        }


async def read_status(bus: Bus, policy: str, *, fleet: EngineFleet | None = None) -> PolicyStatus:
    """Read the last event on ``weights(policy)`` and, given a fleet, each engine's live version.

    Raises:
        InvalidPolicyError: ``policy`` is not a valid policy id.
        BusError: the bus did not answer.
        InvalidEventError: the stored event is not valid.
    """
    last = await bus.last(subjects.weights(policy))
    engines: list[EngineReadBack] = []
    if fleet is not None:
        for url, result in (await fleet.read_versions()).items():
            if isinstance(result, EngineError):
                engines.append(EngineReadBack(url, None, str(result)))
            else:
                engines.append(EngineReadBack(url, result))
    if last is None:
        return PolicyStatus(policy, engines=engines)
    event = last.event
    if not isinstance(event, WeightUpdated | PublisherClaimed):
        raise TypeError(f"unexpected {type(event).__name__} on the weights subject of {policy!r}")
    return PolicyStatus(
        policy,
        version=event.version,
        epoch=event.epoch,
        publisher=event.trainer_id,
        last_event="updated" if isinstance(event, WeightUpdated) else "claimed",
        published_at=event.published_at,
        age_s=max(0.0, now() - event.published_at),
        lora=event.lora if isinstance(event, WeightUpdated) else None,
        seq=last.seq,
        engines=engines,
    )
