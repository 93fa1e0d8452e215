"""The pure coverage rule: which engines hold the weight set a version names after a push, and the lineage fold."""

from __future__ import annotations

from functools import partial

import pytest

from tests._builders import updated
from weightbus.producers.coverage import Lineage, cover, covers, fold_lineage, is_boot_label, pending_label
from weightbus.schemas import LoraAdapter, PublisherClaimed, VersionReserved

P = "p"
ADAPTER = LoraAdapter(name="a", path="/a")


def _claim(epoch: int = 0, version: int | None = None, reserved: int | None = None, previous: str | None = None):
    return PublisherClaimed(
        policy=P, epoch=epoch, trainer_id="t", published_at=1.0, version=version, reserved=reserved,
        previous_trainer_id=previous, incarnation=f"i{epoch}",
    )  # fmt: skip


# The one publisher of these chains: epoch 0, incarnation i0, each update reserving the next version.
_updated = partial(updated, policy=P, epoch=0, at=1.0, incarnation="i0", reserves_next=True)


def _reserved(version: int, lora: LoraAdapter | None = None) -> VersionReserved:
    return VersionReserved(policy=P, version=version, epoch=0, trainer_id="t", published_at=1.0, lora=lora)


def test_boot_labels_are_neither_versions_nor_weightbus_labels() -> None:
    assert is_boot_label("default") and is_boot_label("") and is_boot_label("base-v0")
    assert not is_boot_label("3") and not is_boot_label("quarantine:3") and not is_boot_label(pending_label(3))
    assert pending_label(7) == "pending:7"


@pytest.mark.parametrize(
    ("label", "lineage", "push", "lora", "expected"),
    [
        # A full push covers every engine it reached, whatever it carried.
        ("default", Lineage.UNKNOWN, "full", False, True),
        ("quarantine:4", Lineage.UNKNOWN, "full", False, True),
        # A delta covers the difference from the previous version: an engine at it holds v after the push.
        ("5", Lineage.UNKNOWN, "delta", True, True),
        ("5", Lineage.UNKNOWN, "delta", False, True),
        # The issue's case: a restarted engine after a full push holds base weights, not W5's base.
        ("default", Lineage(boot_base=False), "delta", True, False),
        # In a LoRA-only run the restarted engine's base is the base v names.
        ("default", Lineage(boot_base=True), "delta", True, True),
        # ... but a quarantined engine may hold a failed full push, unless no such push was ever taken.
        ("quarantine:4", Lineage(boot_base=True), "delta", True, False),
        ("quarantine:4", Lineage(boot_base=True, untouched=True), "delta", True, True),
        ("pending:4", Lineage(boot_base=True), "delta", True, False),
        ("3", Lineage(boot_base=True), "delta", True, False),
        # A delta that is not an adapter load changes the base: only engines at the previous version.
        ("default", Lineage(boot_base=True, untouched=True), "delta", False, False),
        ("quarantine:4", Lineage(boot_base=True, untouched=True), "delta", False, False),
        ("6", Lineage(boot_base=True), "delta", True, False),  # the new number before the push: not known
        ("6", Lineage.GENESIS, "delta", True, True),  # no push but adapter loads ever: every base is the boot base
    ],
)
def test_covers(label: str, lineage: Lineage, push: str, lora: bool, expected: bool) -> None:
    assert covers(label, push=push, lora=lora, previous=5, lineage=lineage) is expected  # type: ignore[arg-type]


def test_a_delta_from_the_boot_weights_covers_boot_labelled_engines_before_the_first_announcement() -> None:
    assert covers("default", push="delta", lora=False, previous=None, lineage=Lineage.GENESIS)
    assert not covers("default", push="delta", lora=False, previous=None, lineage=Lineage.UNKNOWN)
    assert not covers("quarantine:1", push="delta", lora=False, previous=None, lineage=Lineage.GENESIS)


def test_cover_splits_in_order() -> None:
    labels = {"http://a": "5", "http://b": "default", "http://c": "quarantine:5", "http://d": "5"}
    got = cover(labels, push="delta", lora=True, previous=5, lineage=Lineage.UNKNOWN)
    assert got.holds == ("http://a", "http://d") and got.missing == ("http://b", "http://c")


def test_the_lineage_is_unknown_without_the_first_claim() -> None:
    assert fold_lineage([]) == Lineage.UNKNOWN
    assert fold_lineage([_updated(4, lora=ADAPTER), _updated(5, lora=ADAPTER)]) == Lineage(ahead=6)  # evicted start
    # A claim that found nothing issued is a genesis only when it is the first retained event.
    assert fold_lineage([_updated(4, lora=ADAPTER), _claim(1)]) == Lineage.UNKNOWN
    # A claim over a lost history takes its version from the engines' labels: nothing is known.
    assert fold_lineage([_claim(0, version=4, reserved=4)]) == Lineage.UNKNOWN


def test_the_lineage_of_a_lora_only_run_and_what_ends_it() -> None:
    lora_only = [_claim(), _updated(1, lora=ADAPTER), _updated(2, lora=ADAPTER)]
    assert fold_lineage(lora_only) == Lineage(boot_base=True, untouched=True, ahead=3)
    assert fold_lineage([_claim()]) == Lineage.GENESIS
    full = fold_lineage([*lora_only, _updated(3)])
    assert (full.boot_base, full.untouched, full.boot_weights) == (False, False, False)
    # A failed full push leaves the announced base as it was but may have touched any engine.
    failed_full = fold_lineage([*lora_only, _reserved(4)])
    assert (failed_full.boot_base, failed_full.untouched) == (True, False)
    failed_lora = fold_lineage([*lora_only[:2], _reserved(2, ADAPTER)])  # 2 was reserved ahead, then 2 stored
    assert (failed_lora.boot_base, failed_lora.untouched) == (True, True)


def test_a_number_reserved_ahead_and_never_accounted_for_may_have_been_any_push() -> None:
    run = [_claim(), _updated(1, lora=ADAPTER), _reserved(3, ADAPTER)]  # 2 was taken by a read and failed
    assert fold_lineage(run) == Lineage(boot_base=True, untouched=False)
    takeover = fold_lineage([_claim(), _updated(1, lora=ADAPTER), _claim(1, version=1, reserved=2, previous="t")])
    assert (takeover.boot_base, takeover.untouched) == (True, False)
    # The same publisher knows what it took: a LoRA attempt under the reserved number keeps it untouched.
    own = fold_lineage(run[:2]).taken(2, lora_only=True).taken(3, lora_only=True)
    assert own.untouched and own.boot_base
    assert not fold_lineage(run[:2]).taken(2, lora_only=False).untouched


def test_announcing_ends_the_boot_weights_and_reserving_ahead_is_remembered() -> None:
    after = Lineage.GENESIS.taken(1, lora_only=False).announced(1, lora=False, reserves_next=False)
    assert after == Lineage.UNKNOWN
    after = Lineage.GENESIS.taken(1, lora_only=True).announced(1, lora=True, reserves_next=True)
    assert after == Lineage(boot_base=True, untouched=True, ahead=2)
