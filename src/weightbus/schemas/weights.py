"""Weight events, trainer → rollout workers and monitors (``weightbus.<policy>.weights`` and ``.applied``).

``WeightUpdated`` announces that every engine of a policy now serves ``version``; it is published
after the engines were stamped and read back, and before they resume generating. ``PublisherClaimed``
shares the weights subject: a publisher that takes over the counter writes it first, so that the
previous owner's next conditional publish is fenced; it repeats the current version and never
changes it. ``WeightApplied`` is the per-engine read-back of one stamp.

Evolution: new fields get defaults and go at the end; unknown fields are ignored on decode.
"""

from __future__ import annotations

import msgspec

from weightbus.schemas.common import Epoch, PolicyId, Timestamp, Version

__all__ = [
    "AppliedMessage",
    "LoraAdapter",
    "PublisherClaimed",
    "WeightApplied",
    "WeightEvent",
    "WeightMessage",
    "WeightUpdated",
]


class LoraAdapter(msgspec.Struct, frozen=True, kw_only=True):
    """The LoRA adapter a push loaded; engines serve it under ``name`` (SGLang's ``lora_path`` in /generate)."""

    name: str
    path: str | None = None


class WeightEvent(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of weight-family events; encoded as ``{"type": <tag>, ...}``."""


class WeightUpdated(WeightEvent, tag="weight.updated"):
    """Every engine of ``policy`` serves ``version``.

    Attributes:
        policy: the policy id.
        version: the new version; full-weight and LoRA pushes share one sequence.
        epoch: the publisher's epoch (bumped on every takeover).
        trainer_id: who published it.
        published_at: Unix time of the publish.
        lora: the adapter this push loaded, or None for a full-weight push.
        engines: the engine URLs that were stamped and read back.
    """

    policy: PolicyId
    version: Version
    epoch: Epoch
    trainer_id: str
    published_at: Timestamp
    lora: LoraAdapter | None = None
    engines: tuple[str, ...] = ()


class PublisherClaimed(WeightEvent, tag="weight.claimed"):
    """``trainer_id`` took over the counter of ``policy`` at ``epoch``; ``version`` is still current.

    ``version`` is None for a policy that has never published a version.
    """

    policy: PolicyId
    epoch: Epoch
    trainer_id: str
    published_at: Timestamp
    version: Version | None = None
    previous_trainer_id: str | None = None


class WeightApplied(WeightEvent, tag="weight.applied"):
    """One engine's read-back after it was stamped with ``version``.

    ``read_back`` is the engine's live ``/model_info`` ``weight_version`` string; ``ok`` is whether it
    equals ``str(version)``.
    """

    policy: PolicyId
    version: Version
    engine: str
    read_back: str
    ok: bool
    published_at: Timestamp
    lora: LoraAdapter | None = None


WeightMessage = WeightUpdated | PublisherClaimed
AppliedMessage = WeightApplied
