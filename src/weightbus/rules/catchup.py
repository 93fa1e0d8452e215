"""The catch-up rule, pure: which announced artifacts make an engine serve a version, and whether its label allows it.

A plan loads one full artifact (a full push is self-contained) and, for a LoRA version, the target's adapter on it (an
adapter replaces the one before it on the same base, so only the newest is loaded); every base on the way down must
be an announced version. Where the engine's base is known to be its boot weights (``boot_base``: the lineage rule of
``producers.coverage``, which the trainer's own stamps trust), a LoRA version whose chain reaches the first adapter
(announced without an artifact) is the target's adapter alone. Nothing else is planned: a version announced without
an artifact, a delta whose base was never announced (or is no longer retained), a delta that is not a LoRA adapter.
An engine labelled at or above the target is never brought down to it; one that carries a trainer's ``pending:``
label above the target is left alone. See docs/operations.md#catching-an-engine-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from weightbus.schemas.alerts import PENDING_PREFIX
from weightbus.schemas.rollouts import parse_version
from weightbus.schemas.weights import WeightUpdated

__all__ = ["CatchupPlan", "LabelStanding", "PlanRefused", "label_standing", "plan_catchup"]

#: Where an engine's label stands against the target: ``behind`` (any label it may be brought up from: an older
#: number, ``default``, a quarantine label, a stale ``pending:``), ``current`` (it carries the target), ``ahead`` (a
#: higher number: the bus read is older than the engine), ``busy`` (a trainer's update above the target holds it).
LabelStanding = Literal["behind", "current", "ahead", "busy"]


def label_standing(label: str, target: int) -> LabelStanding:
    """Where ``label`` (an engine's live ``weight_version``) stands against ``target``; see ``LabelStanding``."""
    number = parse_version(label)
    if number is not None:
        return "current" if number == target else "ahead" if number > target else "behind"
    if label.startswith(PENDING_PREFIX):
        pending = parse_version(label[len(PENDING_PREFIX) :])
        # A pending number at or below the announced one is a push that ended (an engine it left out is quarantined
        # by the update): nothing holds it now. Above it, an update may be pushing to it this moment.
        if pending is not None and pending > target:
            return "busy"
    return "behind"


@dataclass(frozen=True, slots=True)
class CatchupPlan:
    """What to load to serve ``target``: ``full``'s artifact, then ``adapter``'s (the target's LoRA push) if any.

    Attributes:
        target: the version the engine is brought to.
        full: the announcement whose full artifact is loaded (the target's own, or the base its adapter is on); None
            when the adapter goes on the boot weights the engine holds (``boot_base``).
        adapter: the target's announcement when it is a LoRA version (its artifact is the adapter), else None.
    """

    target: int
    full: WeightUpdated | None
    adapter: WeightUpdated | None = None

    @property
    def announcements(self) -> tuple[WeightUpdated, ...]:
        """The announcements whose files are loaded, in load order."""
        return tuple(u for u in (self.full, self.adapter) if u is not None)


@dataclass(frozen=True, slots=True)
class PlanRefused:
    """Why no plan reaches ``target``.

    Attributes:
        reason: ``no_artifact`` (``version`` was announced without one, or is not retained),
            ``unannounced_base`` (``version`` is a delta on a base no retained announcement names),
            ``unsupported`` (a delta the engine can apply only by a push: not a single LoRA adapter).
        version: the version that lacks what the plan needs.
        detail: one sentence for the error.
    """

    reason: Literal["no_artifact", "unannounced_base", "unsupported"]
    version: int
    detail: str


def plan_catchup(
    updates: Sequence[WeightUpdated], target: int, *, boot_base: bool = False
) -> CatchupPlan | PlanRefused:
    """The plan that brings an engine to ``target`` from ``updates`` (the announced versions, e.g.
    ``WeightsHistory.updates``), or why there is none; see the module docstring.

    Args:
        updates: the announced versions, oldest first.
        target: the version to bring the engine to.
        boot_base: the engine's base weights are its boot weights (every push since the policy's first claim was
            a LoRA load, and the engine carries its boot label or no other push was ever taken).
    """
    announced = {u.version: u for u in updates}
    current = announced.get(target)
    if current is None:
        return PlanRefused("no_artifact", target, f"v{target} is not among the retained announcements")
    adapter: WeightUpdated | None = None
    while True:
        artifact = current.artifact
        if artifact is None:
            if boot_base and adapter is not None and current.lora is not None:
                # The first adapter carries no artifact: it, and so the target's adapter, stand on the boot base.
                return CatchupPlan(target, None, adapter)
            return PlanRefused("no_artifact", current.version, f"v{current.version} was announced without an artifact")
        if artifact.lineage == "full":
            return CatchupPlan(target, current, adapter)
        lora = current.lora
        if lora is None or lora.more:
            what = "a delta that is not a LoRA adapter" if lora is None else "several LoRA adapters"
            return PlanRefused("unsupported", current.version, f"v{current.version} is {what}: only a push applies it")
        if adapter is None:
            adapter = current
        assert artifact.base is not None  # a delta names its base (WeightArtifact's own check)
        base = announced.get(artifact.base)
        if base is None:
            return PlanRefused(
                "unannounced_base",
                current.version,
                f"v{current.version} is a delta on v{artifact.base}, which no retained announcement names",
            )
        current = base
