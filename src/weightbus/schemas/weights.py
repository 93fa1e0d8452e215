"""Weight events, trainer → rollout workers and monitors (``weightbus.<policy>.weights``, ``.applied``, ``.counter``).

The weights subject's three events share one conditional publish, which orders and fences them
(docs/design.md#the-counter-one-owner-fenced-by-the-bus). Evolution: new fields get defaults and go at the end;
unknown fields are ignored on decode.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from weightbus.schemas.common import MAX_VERSION, Epoch, PolicyId, Timestamp, Version

__all__ = [
    "DIGEST_PATTERN",
    "AppliedMessage",
    "ClaimStanding",
    "CounterEvent",
    "CounterHighWater",
    "CounterMessage",
    "LoraAdapter",
    "PublisherClaimed",
    "VersionReserved",
    "WeightApplied",
    "WeightArtifact",
    "WeightEvent",
    "WeightMessage",
    "WeightUpdated",
]


class LoraAdapter(msgspec.Struct, frozen=True, kw_only=True):
    """The LoRA adapter a push loaded; engines serve it under ``name`` (SGLang's ``lora_path`` in /generate).

    Attributes:
        name: the name the engines serve it under.
        path: where it was loaded from, when known.
        trainer_name: the trainer's own name for it when that differs from ``name`` (a miles multi-LoRA
            adapter ``math`` is served as its controller slot's ``__miles_slot_0``); None otherwise.
        more: the other adapters the same push loaded (a multi-LoRA push), each as above; ``adapters()``
            lists them all.
    """

    name: str
    path: str | None = None
    trainer_name: str | None = None
    more: tuple[LoraAdapter, ...] = ()

    def adapters(self) -> tuple[LoraAdapter, ...]:
        """Every adapter the push loaded: this one, then ``more``."""
        return (msgspec.structs.replace(self, more=()), *self.more)


#: A checksum: ``<algorithm>:<lowercase hex>`` (``sha256:`` followed by 64 hex digits, as OCI writes digests).
DIGEST_PATTERN = r"^[a-z0-9]{1,16}:[0-9a-f]{32,128}$"

_Digest = Annotated[str, msgspec.Meta(pattern=DIGEST_PATTERN)]


class WeightArtifact(msgspec.Struct, frozen=True, kw_only=True):
    """Where the weights of a version are, what they are the difference from, and their checksums.

    A replica that was not pushed to materializes the version from it (docs/events.md#weightartifact). A
    self-contradicting artifact (a delta without a base, a full one with one, a malformed digest, a tensor named
    twice) fails the typed decode like any malformed event; whether a delta's base was announced is the chain's
    question (``unexplained_base``).

    Attributes:
        uri: where the trainer wrote the weights (a path or a URI).
        lineage: ``full`` (the whole model) or ``delta`` (the difference from ``base``; a LoRA adapter is one).
        base: the version a delta is the difference from; None for a full artifact.
        manifest_digest: the checksum of the whole artifact (e.g. ``sha256:<hex>`` of the file), when known.
        tensors: ``(name, digest)`` per tensor, where the trainer gives them; names are unique.
    """

    uri: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    lineage: Literal["full", "delta"] = "full"
    base: Version | None = None
    manifest_digest: _Digest | None = None
    tensors: tuple[tuple[str, _Digest], ...] = ()

    def __post_init__(self) -> None:
        if self.lineage == "delta" and self.base is None:
            raise ValueError("a delta artifact names its base version")
        if self.lineage == "full" and self.base is not None:
            raise ValueError("a full artifact has no base version")
        if len({name for name, _ in self.tensors}) != len(self.tensors):
            raise ValueError("a tensor is named twice in the artifact's checksums")


class ClaimStanding(msgspec.Struct, frozen=True, kw_only=True):
    """Where the host's own failover order put a claimant when it claimed (miles: its cell's place in its group).

    A host that picks one of several trainer replicas to update the engines, and moves the pick only
    forward, says so here: within one ``scope`` (the host job), a standing with a higher ``(term,
    rank)`` was picked after every lower one. miles: ``scope`` is the Ray job id of the driver,
    ``term`` the group's quorum id (``IndepDPInfo.quorum_id``) and ``rank`` the cell's alive rank in
    that quorum: its group runs ``update_weights`` on the first alive cell, a cell that stops being
    alive comes back only in a later quorum, so the cell picked moves up the alive ranks within a
    quorum and a new quorum is given only to the cells the group keeps alive.
    """

    scope: str
    term: Annotated[int, msgspec.Meta(ge=0, le=MAX_VERSION)]
    rank: Annotated[int, msgspec.Meta(ge=0, le=MAX_VERSION)]


class WeightEvent(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of weight-family events; encoded as ``{"type": <tag>, ...}``."""


class WeightUpdated(WeightEvent, frozen=True, tag="weight.updated"):
    """Every engine of ``policy`` serves ``version``.

    Attributes:
        policy: the policy id.
        version: the new version; full-weight and LoRA pushes share one sequence.
        epoch: the publisher's epoch (bumped on every takeover).
        trainer_id: who published it.
        published_at: Unix time of the publish.
        lora: the adapter this push loaded, or None for a full-weight push.
        engines: the engine URLs that were stamped and read back.
        incarnation: the publisher instance (unique per ``start()``); empty from old publishers.
        reserves_next: this event also reserves ``version + 1`` for the same publisher's next update
            (used up from here on, as by a ``VersionReserved``); False from old publishers.
        artifact: where the version's weights are and what they are a delta of, when the trainer says so (None:
            old publishers, or a push that wrote nothing a replica could load). Its base is below ``version``;
            a LoRA push's artifact is a delta (the adapter on the base the previous version names).
    """

    policy: PolicyId
    version: Version
    epoch: Epoch
    trainer_id: str
    published_at: Timestamp
    lora: LoraAdapter | None = None
    engines: tuple[str, ...] = ()
    incarnation: str = ""
    reserves_next: bool = False
    artifact: WeightArtifact | None = None

    def __post_init__(self) -> None:
        artifact = self.artifact
        if artifact is None:
            return
        if artifact.base is not None and artifact.base >= self.version:
            raise ValueError(f"an artifact's base ({artifact.base}) must be below its version ({self.version})")
        if self.lora is not None and artifact.lineage == "full":
            raise ValueError("a LoRA push's artifact is a delta: the adapter on the previous base")


class PublisherClaimed(WeightEvent, frozen=True, tag="weight.claimed"):
    """``trainer_id`` took over the counter of ``policy`` at ``epoch``; ``version`` is still current.

    ``version`` is None for a policy that has never published a version. ``previous_trainer_id`` is
    None when the claimant found no earlier event (a new policy, or a history that was lost: then
    ``version`` may come from the engines' labels). ``reserved`` is the highest number ever issued
    (reserved or published) that the claimant saw; its own first update is above it. ``standing`` is
    where the host's failover order put the claimant (None: a host without one); a publisher that
    was fenced claims again only over an owner whose standing its own outranks (``rules.standing``).
    """

    policy: PolicyId
    epoch: Epoch
    trainer_id: str
    published_at: Timestamp
    version: Version | None = None
    previous_trainer_id: str | None = None
    incarnation: str = ""
    reserved: Version | None = None
    standing: ClaimStanding | None = None


class VersionReserved(WeightEvent, frozen=True, tag="weight.reserved"):
    """The owner took ``version`` for an update; no engine carries it yet and none may before this is stored.

    It never changes the current version: a reserved number becomes current only with its
    ``WeightUpdated``, and a reserved number whose update failed is skipped for ever.
    """

    policy: PolicyId
    version: Version
    epoch: Epoch
    trainer_id: str
    published_at: Timestamp
    incarnation: str = ""
    lora: LoraAdapter | None = None


class WeightApplied(WeightEvent, frozen=True, tag="weight.applied"):
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


class CounterEvent(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of counter-family events; encoded as ``{"type": <tag>, ...}``."""


class CounterHighWater(CounterEvent, frozen=True, tag="counter.high_water"):
    """The counter of ``policy`` has issued every number up to ``version``; none of them is ever issued again.

    Written by the owner on ``weightbus.<policy>.counter`` with each reservation and announcement
    (conditional on the subject's last mark, so the newest mark is the highest), before any engine
    can carry a number it does not cover.

    Attributes:
        version: the highest number taken (reserved, or reserved ahead by an announcement).
        epoch, trainer_id, incarnation: the writer (the owner when it wrote).
        announced: the highest version announced and acknowledged when the mark was written (None:
            none yet). A tracker that holds less has lost history: a counter reset.
        standing: the writer's claim standing (``PublisherClaimed.standing``), so that it outlives the
            claim in the weights history.
    """

    policy: PolicyId
    version: Version
    epoch: Epoch
    trainer_id: str
    published_at: Timestamp
    incarnation: str = ""
    announced: Version | None = None
    standing: ClaimStanding | None = None


WeightMessage = WeightUpdated | PublisherClaimed | VersionReserved
AppliedMessage = WeightApplied
CounterMessage = CounterHighWater
