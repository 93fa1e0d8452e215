"""Which engines hold the weight set a version names after a push: the pure rule behind every stamp.

A full push covers every engine it reached, a delta those at the previous version (a LoRA load also those on its
base); anything else is missing, never stamped. Why: docs/design.md#the-update-protocol-step-by-step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

from weightbus.schemas import (
    PENDING_PREFIX,
    QUARANTINE_PREFIX,
    PublisherClaimed,
    VersionReserved,
    WeightUpdated,
    parse_version,
)

__all__ = [
    "PENDING_PREFIX",
    "Coverage",
    "Lineage",
    "Push",
    "cover",
    "covers",
    "fold_lineage",
    "is_boot_label",
    "pending_label",
]

Push = Literal["full", "delta"]
"""What a push covers: ``full`` (the whole model) or ``delta`` (the difference from the last announced version)."""


def pending_label(version: int) -> str:
    """The non-numeric label engines carry while update ``version`` pushes: ``pending:<version>``."""
    return f"{PENDING_PREFIX}{version}"


def is_boot_label(label: str) -> bool:
    """Whether ``label`` is an engine's boot label: not a version and not one weightbus sets (quarantine, pending)."""
    return parse_version(label) is None and not label.startswith((QUARANTINE_PREFIX, PENDING_PREFIX))


@dataclass(frozen=True, slots=True)
class Lineage:
    """What the announcements since the engines booted say about the weights.

    Attributes:
        boot_weights: nothing was announced since the policy's first claim: the previous weight
            set is the engines' boot weights.
        boot_base: every announcement since the first claim was a LoRA push: the previous weight
            set's base is the boot base.
        untouched: no push other than a LoRA load was ever taken (announced or failed): every
            engine's base is the boot base, whatever its label.
        ahead: a number an announcement reserved ahead (``reserves_next``) that no event has
            accounted for yet; if another event follows instead, its push (of unknown kind) may
            have reached the engines, and ``untouched`` no longer holds.
    """

    boot_weights: bool = False
    boot_base: bool = False
    untouched: bool = False
    ahead: int | None = None

    UNKNOWN: ClassVar[Lineage]
    GENESIS: ClassVar[Lineage]

    def taken(self, version: int, *, lora_only: bool) -> Lineage:
        """After number ``version`` is taken for a push; ``lora_only`` when it loads an adapter and nothing else."""
        touched = self.ahead is not None and self.ahead != version
        return replace(self, untouched=self.untouched and lora_only and not touched, ahead=None)

    def announced(self, version: int, *, lora: bool, reserves_next: bool) -> Lineage:
        """After ``WeightUpdated(version)``; ``lora`` when it announced an adapter on the previous base."""
        after = self.taken(version, lora_only=lora)
        return Lineage(
            boot_weights=False,
            boot_base=after.boot_base and lora,
            untouched=after.untouched,
            ahead=version + 1 if reserves_next else None,
        )

    def claimed(self, claim: PublisherClaimed, *, first: bool) -> Lineage:
        """After ``claim``; ``first`` when no earlier event is retained (only then can it be the policy's genesis)."""
        if claim.version is None and claim.reserved is None:
            return Lineage.GENESIS if first else Lineage.UNKNOWN
        if claim.previous_trainer_id is None:
            return Lineage.UNKNOWN  # a claim over a lost history: the engines' labels, not the bus, gave its version
        # A takeover: the predecessor's number reserved ahead may have been pushed, with a kind no event tells.
        return replace(self, untouched=self.untouched and self.ahead is None, ahead=None)


Lineage.UNKNOWN = Lineage()
Lineage.GENESIS = Lineage(boot_weights=True, boot_base=True, untouched=True)


def fold_lineage(events: Iterable[object]) -> Lineage:
    """The lineage after a weights subject's retained events, oldest first (payloads of ``Envelope.event``).

    Unknown unless the first retained event is the policy's first claim (nothing issued before it).
    A number reserved ahead by the last announcement is still ``ahead``: a new publisher instance
    cannot know what its predecessor pushed under it, and ``claimed`` (its own claim) resolves it.
    """
    lineage = Lineage.UNKNOWN
    first = True
    for event in events:
        if isinstance(event, PublisherClaimed):
            lineage = lineage.claimed(event, first=first)
        elif isinstance(event, VersionReserved):
            lineage = lineage.taken(event.version, lora_only=event.lora is not None)
        elif isinstance(event, WeightUpdated):
            lineage = lineage.announced(event.version, lora=event.lora is not None, reserves_next=event.reserves_next)
        else:
            continue
        first = False
    return lineage


def covers(label: str, *, push: Push, lora: bool, previous: int | None, lineage: Lineage) -> bool:
    """Whether an engine that carried ``label`` before the push holds the new weight set after it.

    Args:
        label: the engine's ``weight_version`` read before the push.
        push: what the push covers (``full`` or ``delta``).
        lora: the delta is a LoRA adapter load (the base is left as it was).
        previous: the last announced version (None before the first announcement).
        lineage: what the announcements since the engines booted say.
    """
    if push == "full":
        return True
    if previous is not None and label == str(previous):
        return True
    if lora:
        return lineage.untouched or (lineage.boot_base and is_boot_label(label))
    return lineage.boot_weights and is_boot_label(label)


@dataclass(frozen=True, slots=True)
class Coverage:
    """Which engines a push brings to the weight set the new version names.

    Attributes:
        holds: engines that hold it after the push (they may be stamped), in input order.
        missing: engines that do not: they need the missing part first, or stay quarantined.
    """

    holds: tuple[str, ...]
    missing: tuple[str, ...]


def cover(labels: Mapping[str, str], *, push: Push, lora: bool, previous: int | None, lineage: Lineage) -> Coverage:
    """Split engines by ``covers`` (``labels``: each engine's label before the push, by URL)."""
    holds: list[str] = []
    missing: list[str] = []
    for engine, label in labels.items():
        target = holds if covers(label, push=push, lora=lora, previous=previous, lineage=lineage) else missing
        target.append(engine)
    return Coverage(tuple(holds), tuple(missing))
