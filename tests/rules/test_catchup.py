"""The catch-up rule, pure: the plan from the announced versions, and where an engine's label stands."""

from __future__ import annotations

import pytest

from tests._builders import updated
from weightbus.rules.catchup import CatchupPlan, PlanRefused, label_standing, plan_catchup
from weightbus.schemas import LoraAdapter, WeightArtifact, WeightUpdated

DIGEST = "sha256:" + "ab" * 32


def full(version: int) -> WeightUpdated:
    return updated(version, at=100.0, artifact=WeightArtifact(uri=f"/w{version}", manifest_digest=DIGEST))


def adapter(version: int, base: int, *, more: bool = False) -> WeightUpdated:
    extra = (LoraAdapter(name="other"),) if more else ()
    lora = LoraAdapter(name=f"lora-v{version}", path=f"/a{version}", more=extra)
    return updated(
        version, at=100.0, lora=lora, artifact=WeightArtifact(uri=f"/a{version}", lineage="delta", base=base)
    )


def test_a_full_version_is_its_own_plan() -> None:
    assert plan_catchup([full(1), full(2)], 2) == CatchupPlan(2, full(2))


def test_a_lora_version_is_its_adapter_on_the_full_base_its_chain_of_adapters_stands_on() -> None:
    history = [full(1), adapter(2, 1), adapter(3, 2)]
    assert plan_catchup(history, 3) == CatchupPlan(3, full(1), adapter(3, 2))
    assert plan_catchup(history, 3).announcements == (full(1), adapter(3, 2))  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("history", "target", "reason", "version"),
    [
        ([full(1)], 2, "no_artifact", 2),  # not retained (or never announced)
        ([updated(1)], 1, "no_artifact", 1),  # announced without an artifact
        ([updated(1, lora=LoraAdapter(name="a")), adapter(2, 1)], 2, "no_artifact", 1),  # the first adapter's base
        ([adapter(5, 3)], 5, "unannounced_base", 5),
        ([full(1), adapter(3, 2)], 3, "unannounced_base", 3),
        ([full(1), adapter(2, 1, more=True)], 2, "unsupported", 2),
        ([full(1), updated(2, artifact=WeightArtifact(uri="/d2", lineage="delta", base=1))], 2, "unsupported", 2),
    ],
)
def test_no_plan_without_verified_lineage(history: list[WeightUpdated], target: int, reason: str, version: int) -> None:
    refused = plan_catchup(history, target)
    assert isinstance(refused, PlanRefused) and (refused.reason, refused.version) == (reason, version)


@pytest.mark.parametrize(
    ("label", "standing"),
    [
        ("5", "current"),
        ("9", "ahead"),
        ("4", "behind"),
        ("default", "behind"),
        ("quarantine:5", "behind"),
        ("pending:5", "behind"),  # a push that ended: an engine it left out was quarantined by the update
        ("pending:6", "busy"),
        ("pending:x", "behind"),
        ("²", "behind"),
    ],
)
def test_label_standing(label: str, standing: str) -> None:
    assert label_standing(label, 5) == standing


def test_on_the_boot_base_a_lora_version_is_its_adapter_alone() -> None:
    first = updated(1, at=100.0, lora=LoraAdapter(name="lora-v1"))  # the first adapter announces no artifact
    history = [first, adapter(2, 1), adapter(3, 2)]
    assert plan_catchup(history, 3, boot_base=True) == CatchupPlan(3, None, adapter(3, 2))
    assert isinstance(plan_catchup(history, 3), PlanRefused)  # without the lineage's word, nothing to stand on
    refused = plan_catchup(history, 1, boot_base=True)  # the first adapter itself has no verifiable file
    assert isinstance(refused, PlanRefused) and refused.reason == "no_artifact"
    assert isinstance(plan_catchup([updated(1, at=100.0), adapter(2, 1)], 2, boot_base=True), PlanRefused)
